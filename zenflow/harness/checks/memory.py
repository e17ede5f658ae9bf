"""The `memory` check of `make gpu-check`: extra device memory of overlap mode over sync mode, against its bound.

What the allocator sees: a gathered gradient block or a landing buffer is freed by Python as soon
as its copy is queued and kept only by `record_stream`. The caching allocator lowers `allocated_bytes` at that free,
before the copy has run; only `active_bytes` waits for the stream-use events. So the peak is
`memory_stats()["active_bytes.all.peak"]`, reset after warm-up and the first selection and read over steps between
reselections (reselection drains and syncs in both modes). The copies are made slow next to the step (a spin kernel
queued on the d2h stream before every gradient copy), the regime where overlap keeps blocks in flight.

The bound: two sets of the unselected gradient columns. Backpressure lets step t gather while step t-1's block is
still on its way (step t-2's copies are done): one set more than sync, which waits for every copy inside the step.
At an overlap boundary the upload's landing buffer (one more set) is allocated while those two are in flight; in
sync mode the boundary's landing buffer comes after the step's copies landed. The negative control is the same run
with backpressure disabled: blocks of up to 2U-1 steps are then in flight, and it must exceed the bound.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch

from zenflow import ZenFlowAdamW
from zenflow.harness.checks.differential import DIFF_HYPER, SmallNet, make_batches
from zenflow.harness.checks.verdict import blind_spots, check, control
from zenflow.link import Link
from zenflow.selection import num_selected
from zenflow.worker import HostWorker

# Warm-up round at step 0, first selection at step 1; the window is the steps after it (no reselection in it).
MEMORY_CASE = {"topk_ratio": 0.25, "update_interval": 4, "select_interval": 64, "full_warm_up_rounds": 1,
               "select_strategy": "step"}
WARM_STEPS = 2
SETS_IN_BOUND = 2
SLOW_D2H_CYCLES = 20_000_000  # ~10 ms of spin on the d2h stream before each gradient copy (H100: 1.6-2.0 GHz)


def unselected_bound_bytes(model: torch.nn.Module, topk_ratio: float) -> int:
    """One set of the unselected gradient columns: sum over 2-D+ params of out * (in - k) * element size."""
    total = 0
    for p in model.parameters():
        if p.requires_grad and p.dim() >= 2:
            out, cols = p.shape[0], p[0].numel()
            total += out * (cols - num_selected(cols, topk_ratio)) * p.element_size()
    return total


@contextlib.contextmanager
def slow_d2h(link: Link, cycles: int) -> Iterator[None]:
    """Queue a `cycles`-long spin on `link`'s d2h stream before every gradient copy (this Link instance only): the
    link looks slow next to the step. The spin is queued, never waited for, so the host thread is not slowed."""
    original = link.gather_to_host

    def gather(src: torch.Tensor, columns: torch.Tensor, dst: torch.Tensor) -> Any:
        if cycles and link.cuda:
            with torch.cuda.stream(link.d2h_stream):
                torch.cuda._sleep(cycles)
        return original(src, columns, dst)

    link.gather_to_host = gather  # an instance attribute shadows the class's method
    try:
        yield
    finally:
        del link.gather_to_host


def without_backpressure() -> contextlib.AbstractContextManager:
    """The negative control: HostWorker.backpressure does nothing while the context is open."""
    return mock.patch.object(HostWorker, "backpressure", lambda self: None)


def _step(model: torch.nn.Module, opt: ZenFlowAdamW, x: torch.Tensor, y: torch.Tensor) -> None:
    (model(x) - y).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def window_peak(block: dict[str, Any], widths: tuple[int, ...], steps: int, backpressure: bool = True,
                slow_cycles: int = SLOW_D2H_CYCLES) -> int:
    """CUDA: peak active bytes over `steps` steps after warm-up and the first selection, above the active bytes
    when the window opened."""
    model = SmallNet(widths, seed=0).cuda()
    data = [(x.cuda(), y.cuda()) for x, y in make_batches(widths, WARM_STEPS + steps, 0, rows=8)]
    opt = ZenFlowAdamW(model.parameters(), zenflow=dict(block), **DIFF_HYPER)
    try:
        for x, y in data[:WARM_STEPS]:
            _step(model, opt, x, y)
        torch.cuda.synchronize()  # sync point: warm-up and first selection done, every copy landed
        # Blocks kept by record_stream count as active until the allocator processes their (now complete) events:
        # empty_cache does, and so does any allocation. Then the window starts from what is really in use.
        torch.cuda.empty_cache()
        torch.empty(1, device="cuda")
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_stats()["active_bytes.all.current"]
        broken = contextlib.nullcontext() if backpressure else without_backpressure()
        with slow_d2h(opt.link, slow_cycles), broken:
            for x, y in data[WARM_STEPS:]:
                _step(model, opt, x, y)
            torch.cuda.synchronize()  # sync point: the window's copies have all run
        peak = torch.cuda.memory_stats()["active_bytes.all.peak"]
    finally:
        opt.close()
    return peak - start


def memory_check(cuda: bool, widths: tuple[int, ...] = (4096,) * 5, steps: int = 12) -> dict[str, Any]:
    """Wide layers at a small batch, slow copies: sync, overlap, and overlap without backpressure (the control)."""
    if not cuda:
        return check("memory", "not checked", "no CUDA: device memory exists only on a GPU",
                     controls=[control("overlap without backpressure", None, "needs CUDA")])
    details = dict(widths=list(widths), steps=steps, slow_d2h_cycles=SLOW_D2H_CYCLES, metric="active_bytes.all.peak")
    try:  # the two runs the verdict compares: without either there is none
        sync = window_peak({**MEMORY_CASE, "overlap_step": False}, widths, steps)
        overlap = window_peak({**MEMORY_CASE, "overlap_step": True}, widths, steps)
    except Exception as exc:
        return check("memory", "fail", f"raised {type(exc).__name__}: {exc}", traceback=traceback.format_exc(),
                     **details)
    try:  # the control's run raising costs the control, not the two peaks
        unbounded: int | str = window_peak({**MEMORY_CASE, "overlap_step": True}, widths, steps, backpressure=False)
    except Exception as exc:
        unbounded = f"raised {type(exc).__name__}: {exc}"
    one_set = unselected_bound_bytes(SmallNet(widths, seed=0), MEMORY_CASE["topk_ratio"])
    return memory_verdict(sync, overlap, SETS_IN_BOUND * one_set, unbounded, set_bytes=one_set, **details)


def memory_verdict(sync: int, overlap: int, bound: int, unbounded: int | str, **details: Any) -> dict[str, Any]:
    """Pass when overlap's peak is at most `bound` bytes above sync's and the run without backpressure (the negative
    control) is above it: a measurement that cannot see the unbounded run cannot vouch for the bounded one.
    `unbounded`: the control's peak, or why it has none (its run raised: a problem too)."""
    extra = overlap - sync
    problems = [] if extra <= bound else [
        f"overlap used {extra / 2**20:.1f} MiB more than sync, bound {bound / 2**20:.1f} MiB"]
    if isinstance(unbounded, str):
        controls = [control("overlap without backpressure", None, unbounded)]
        problems.append(f"negative control overlap without backpressure: {unbounded}")
        return check("memory", "fail", "; ".join(problems), sync_peak_bytes=sync, overlap_peak_bytes=overlap,
                     extra_bytes=extra, bound_bytes=bound, controls=controls, **details)
    control_extra = unbounded - sync
    controls = [control("overlap without backpressure", control_extra > bound,
                        f"{control_extra / 2**20:.1f} MiB above sync, bound {bound / 2**20:.1f} MiB")]
    problems += [f"negative control passed: {name} stayed within the bound, so this measurement cannot see blocks in "
                 "flight" for name in blind_spots(controls)]
    return check("memory", "fail" if problems else "pass", "; ".join(problems) or None, sync_peak_bytes=sync,
                 overlap_peak_bytes=overlap, extra_bytes=extra, bound_bytes=bound, control_peak_bytes=unbounded,
                 control_extra_bytes=control_extra, controls=controls, **details)
