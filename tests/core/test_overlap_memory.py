"""Overlap mode holds a bounded amount of gradient memory (docs/host-worker.md, "Memory bound").

The CPU twin of the GPU out-of-memory a reading of the CUDA path predicted: when the host part is slower than a training
step, background accumulation jobs queue up, and each one used to keep its step's whole gradient alive. With the
backpressure bound (at most one accumulation queued behind the running one), background work keeps at most two
gradient sets alive after `step()` + `zero_grad()`, however slow the host is. On CUDA the bound is tighter (the
training thread starts the copies itself, so jobs hold no device gradient at all); the same queue bound applies.
"""

from __future__ import annotations

import time
import weakref

import torch

from zenflow import ZenFlowAdamW


class Wide(torch.nn.Module):
    """One wide layer at batch 1: the host part (accumulation) costs more than the step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(512, 512, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def _slow_host(seconds: float):
    """A HostWorker.before_job hook: the host part is slower than a training step."""
    def slow(kind: str) -> None:
        if kind == "accumulate":
            time.sleep(seconds)

    return slow


def _gradient_sets_alive_after_each_step(opt: ZenFlowAdamW, model: torch.nn.Module, steps: int) -> list[int]:
    alive_sets: list[list[weakref.ref]] = []
    counts = []
    for i in range(steps):
        x = torch.randn(1, 512, generator=torch.Generator().manual_seed(i))
        model(x).pow(2).mean().backward()
        alive_sets.append([weakref.ref(p.grad) for p in model.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
        counts.append(sum(any(r() is not None for r in refs) for refs in alive_sets))
    return counts


def test_background_work_keeps_at_most_two_gradient_sets_alive():
    model = Wide()
    opt = ZenFlowAdamW(model.parameters(), lr=1e-3, zenflow={
        "topk_ratio": 0.1, "update_interval": 4, "select_interval": 1000, "overlap_step": True,
        "full_warm_up_rounds": 0})
    opt.worker.before_job = _slow_host(0.2)
    try:
        counts = _gradient_sets_alive_after_each_step(opt, model, 14)
    finally:
        opt.close()
    assert max(counts) <= 2, f"gradient sets alive after each step: {counts}"
    assert max(counts) >= 1, "the background work held no gradient: the test cannot see the bound"


def test_sync_mode_keeps_no_gradient_alive_after_the_step():
    model = Wide()  # sync mode has no worker: every accumulation runs inline, within the step
    opt = ZenFlowAdamW(model.parameters(), lr=1e-3, zenflow={
        "topk_ratio": 0.1, "update_interval": 4, "select_interval": 1000, "overlap_step": False})
    counts = _gradient_sets_alive_after_each_step(opt, model, 6)
    assert counts == [0] * 6


def test_backpressure_waits_are_booked_as_stall():
    """Waiting for the worker to make room is a wait of the training thread for the host: a `host_wait`."""
    model = Wide()
    opt = ZenFlowAdamW(model.parameters(), lr=1e-3, zenflow={
        "topk_ratio": 0.1, "update_interval": 8, "select_interval": 1000, "overlap_step": True,
        "full_warm_up_rounds": 0})
    opt.worker.before_job = _slow_host(0.05)
    blocks: list[str] = []

    class Recorder:
        def on_transfer(self, direction: str, kind: str, nbytes: int) -> None: ...
        def on_block_start(self, what: str) -> None: blocks.append(what)
        def on_block_end(self, what: str) -> None: ...

    opt.add_observer(Recorder())
    try:
        _gradient_sets_alive_after_each_step(opt, model, 6)  # no boundary after the first: only backpressure
    finally:
        opt.close(flush=False)
    assert blocks.count("host_wait") >= 3
