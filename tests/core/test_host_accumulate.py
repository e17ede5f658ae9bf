"""host.accumulate_into_: the clipped gradient is added in one pass over memory as acc + clip·src, every
element rounded once in fp32 (a fused multiply-add on the upcast gradient), the first gradient as clip·src.

The reference computes each element in float64 and rounds it once to fp32: exact for these inputs (an fp32 product
fits float64's 53 bits; the checks below would see a second rounding, and did, see the negative controls).

The scratch each call upcasts into is kept per thread: two threads accumulating at once each get their own, and each
sum is exact."""

from __future__ import annotations

import threading

import pytest
import torch

from zenflow.host import _scratch, accumulate_into_


def _rounded_once(acc: torch.Tensor, src: torch.Tensor, clip: float | None, first: bool) -> torch.Tensor:
    """The reference: clip·src (+ acc) formed in float64 from the exact upcasts, rounded once to fp32."""
    product = src.double() * (1.0 if clip is None else float(torch.tensor(clip, dtype=torch.float32)))
    return (product if first else acc.double() + product).float()


def _inputs(dtype: torch.dtype, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """1001 rows of 37: rows % rows-per-block is 1 for blocks of 1 or 2 rows (a one-row tail), 2 for 3 rows."""
    gen = torch.Generator().manual_seed(seed)
    src = (torch.randn(1001, 37, generator=gen) * 50).to(dtype)
    return torch.randn(1001, 37, generator=gen), src


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("clip", [None, 1.0, 0.37, 3e-4])
@pytest.mark.parametrize("first", [False, True])
@pytest.mark.parametrize("block", [37, 74, 111, 1 << 20], ids=["rows1", "rows2", "rows3", "one-block"])
def test_clipped_accumulation_rounds_each_element_once(dtype, clip, first, block) -> None:
    """Every element, whatever the size of the last block of rows (1, 1 and 2 rows here), and in a single block."""
    acc, src = _inputs(dtype)
    expected = _rounded_once(acc, src, clip, first)
    coef = None if clip is None else torch.tensor(clip, dtype=torch.float32)
    out, kept = acc.clone(), src.clone()
    accumulate_into_(out, src, coef, first=first, block_elements=block)
    assert torch.equal(out, expected)
    assert torch.equal(src, kept)  # the staging buffer is only read


def test_one_dimensional_and_a_python_coefficient() -> None:
    acc, src = torch.randn(5000), torch.randn(5000).to(torch.bfloat16)
    expected = _rounded_once(acc, src, 0.81, first=False)
    accumulate_into_(acc, src, 0.81)
    assert torch.equal(acc, expected)


def test_negative_controls_two_roundings_or_a_bf16_product_are_seen() -> None:
    """Rounding the product before the add (two roundings), or rounding it to the gradient's dtype as torch's
    in-place bf16 clipping does (the rule before accumulate_into_), both differ from one rounding: the oracle above can
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


def test_the_scratch_is_one_buffer_per_thread() -> None:
    """The worker and, on the CPU device, the trainer both accumulate (two optimizers with overlap_step: two
    workers), so each thread upcasts into its own buffer, reused across its calls."""
    mine = _scratch(4096, torch.float32)
    other: list[torch.Tensor] = []
    thread = threading.Thread(target=lambda: other.append(_scratch(4096, torch.float32)))
    thread.start()
    thread.join()
    assert other[0].data_ptr() != mine.data_ptr()
    assert _scratch(4096, torch.float32).data_ptr() == mine.data_ptr()  # kept: no new buffer per call


def test_two_threads_accumulating_at_once_each_get_exact_sums() -> None:
    """30 clipped bf16 accumulations per thread into its own acc, both threads released together, against the same
    accumulations made one thread at a time before. A scratch shared by both threads adds the other's gradient: one
    round caught it 9 times in 10 here (the threads must interleave), so ten rounds are run (~0.05 s each)."""
    gen = torch.Generator().manual_seed(5)
    sources = [(torch.randn(256, 1024, generator=gen) * 50).to(torch.bfloat16) for _ in range(2)]
    start = torch.randn(256, 1024, generator=gen)
    coef = torch.tensor(0.37)

    def run(src: torch.Tensor, out: torch.Tensor, go: threading.Barrier | None = None) -> None:
        if go is not None:
            go.wait()
        for _ in range(30):
            accumulate_into_(out, src, coef, block_elements=1 << 16)  # 4 blocks a call: windows to interleave

    expected = [start.clone() for _ in sources]
    for src, out in zip(sources, expected):
        run(src, out)
    for round_ in range(10):
        results, go = [start.clone() for _ in sources], threading.Barrier(len(sources))
        threads = [threading.Thread(target=run, args=(src, out, go)) for src, out in zip(sources, results)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert all(torch.equal(out, ref) for out, ref in zip(results, expected)), round_
