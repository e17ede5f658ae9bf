"""host.accumulate_into_ (issue 25): the clipped gradient is added in one pass over memory as acc + clip·src, every
element rounded once in fp32 (a fused multiply-add on the upcast gradient), the first gradient as clip·src.

The reference computes each element in float64 and rounds it once to fp32: exact for these inputs (an fp32 product
fits float64's 53 bits; the checks below would see a second rounding, and did, see the negative controls)."""

from __future__ import annotations

import pytest
import torch

from zenflow.host import accumulate_into_


def _rounded_once(acc: torch.Tensor, src: torch.Tensor, clip: float | None, first: bool) -> torch.Tensor:
    """The reference: clip·src (+ acc) formed in float64 from the exact upcasts, rounded once to fp32."""
    product = src.double() * (1.0 if clip is None else float(torch.tensor(clip, dtype=torch.float32)))
    return (product if first else acc.double() + product).float()


def _inputs(dtype: torch.dtype, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    src = (torch.randn(1000, 37, generator=gen) * 50).to(dtype)
    return torch.randn(1000, 37, generator=gen), src


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("clip", [None, 1.0, 0.37, 3e-4])
@pytest.mark.parametrize("first", [False, True])
def test_clipped_accumulation_rounds_each_element_once(dtype, clip, first) -> None:
    acc, src = _inputs(dtype)
    expected = _rounded_once(acc, src, clip, first)
    coef = None if clip is None else torch.tensor(clip, dtype=torch.float32)
    for block in (100, 1 << 20):  # many blocks with a ragged last one, and one block
        out, kept = acc.clone(), src.clone()
        accumulate_into_(out, src, coef, first=first, block_elements=block)
        assert torch.equal(out, expected), block
        assert torch.equal(src, kept)  # the staging buffer is only read


def test_one_dimensional_and_a_python_coefficient() -> None:
    acc, src = torch.randn(5000), torch.randn(5000).to(torch.bfloat16)
    expected = _rounded_once(acc, src, 0.81, first=False)
    accumulate_into_(acc, src, 0.81)
    assert torch.equal(acc, expected)


def test_negative_controls_two_roundings_or_a_bf16_product_are_seen() -> None:
    """Rounding the product before the add (two roundings), or rounding it to the gradient's dtype as torch's
    in-place bf16 clipping does (the rule before issue 25), both differ from one rounding: the oracle above can
    fail."""
    acc, src = _inputs(torch.bfloat16, seed=4)
    expected = _rounded_once(acc, src, 0.37, first=False)
    two_roundings = acc + src.float() * 0.37
    bf16_product = acc + (src * 0.37).float()
    assert not torch.equal(two_roundings, expected)
    assert not torch.equal(bf16_product, expected)


def test_a_coefficient_of_one_is_skipped_exactly() -> None:
    src, acc = torch.randn(300, 7).to(torch.bfloat16), torch.randn(300, 7)
    a, b = acc.clone(), acc.clone()
    accumulate_into_(a, src, torch.tensor(1.0))
    accumulate_into_(b, src, None)
    assert torch.equal(a, b)
