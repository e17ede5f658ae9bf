"""host.accumulate_into_ (issue 25): clipping fused into the one pass over memory must give the bits that clipping
the staging buffer in place (torch's rule, in the gradient's dtype) and then accumulating gave."""

from __future__ import annotations

import pytest
import torch

from zenflow.host import accumulate_into_


def _two_passes(acc: torch.Tensor, src: torch.Tensor, clip: torch.Tensor | None, first: bool) -> torch.Tensor:
    """The reference: clip the staging buffer in place as clip_grad_norm_ does, then copy or add it upcast."""
    scaled = src.clone()
    if clip is not None:
        scaled.mul_(clip)
    return scaled.float() if first else acc + scaled.float()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("clip", [None, 1.0, 0.37, 3e-4])
@pytest.mark.parametrize("first", [False, True])
def test_fused_clip_and_accumulate_equals_clipping_then_accumulating(dtype, clip, first) -> None:
    gen = torch.Generator().manual_seed(3)
    src = (torch.randn(1000, 37, generator=gen) * 50).to(dtype)
    acc = torch.randn(1000, 37, generator=gen)
    coef = None if clip is None else torch.tensor(clip, dtype=torch.float32)
    expected = _two_passes(acc, src, coef, first)
    for scratch in (False, True):  # blocks, or (first only) the staging buffer scaled in place and copied whole
        out = acc.clone()
        accumulate_into_(out, src.clone(), coef, first=first, block_elements=100, scratch_src=scratch)
        assert torch.equal(out, expected), scratch


def test_one_dimensional_and_single_block() -> None:
    src, acc = torch.randn(5000).to(torch.bfloat16), torch.randn(5000)
    coef = torch.tensor(0.81)
    expected = _two_passes(acc, src, coef, first=False)
    accumulate_into_(acc, src, coef)
    assert torch.equal(acc, expected)


def test_the_rounding_step_is_what_makes_it_exact() -> None:
    """Negative control: scaling in fp32 without rounding the product to the gradient's dtype (what a fused kernel
    that skips the cast would do) differs from torch's clipping, and the test above would see it."""
    gen = torch.Generator().manual_seed(4)
    src = (torch.randn(1000, 37, generator=gen) * 50).to(torch.bfloat16)
    acc = torch.randn(1000, 37, generator=gen)
    coef = torch.tensor(0.37)
    unrounded = acc + src.float() * 0.37
    assert not torch.equal(unrounded, _two_passes(acc, src, coef, first=False))


def test_a_coefficient_of_one_is_skipped_exactly() -> None:
    src, acc = torch.randn(300, 7).to(torch.bfloat16), torch.randn(300, 7)
    a, b = acc.clone(), acc.clone()
    accumulate_into_(a, src, torch.tensor(1.0))
    accumulate_into_(b, src, None)
    assert torch.equal(a, b)
