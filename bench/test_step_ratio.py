"""ZenFlow's whole `step()` against ZeRO-Offload's, in one run, interleaved (docs/benchmarks.md, "Bound ratios").

    .venv/bin/python -m pytest bench/test_step_ratio.py --benchmark-only

The configuration of the CPU measurements: six `Linear(2048, 2048, bias=False)` layers in bf16, one thread, a
micro-batch of one token (backward is cheap: the step is what is timed), `overlap_step` off so every part runs on one
clock. A round is one ZenFlow update cycle (`topk_ratio` 0.1, `update_interval` 4: three accumulation steps and a
boundary), timed around `step()` only; before it, four steps of ZeRO-Offload (`topk_ratio` 0, `update_interval` 1)
on the same model shape, timed the same way (the reference, interleaved round by round). `extra_info`: the ratio of
the cycle mean to ZeRO-Offload's step and its 95% interval; over its `[bound_ratios]` limit
(`<device>/zenflow-cycle`) the benchmark fails. On CUDA the same, with Llama-2-7B-sized layers.

The second benchmark runs the same ZenFlow with `overlap_step` on: the host's work moves to the worker, and what the
training thread's `step()` does at an accumulation step is the device update. Its mean over the cycle's
accumulation steps is timed against a plain copy of the device update's bytes for all the layers
(`<device>/overlap-accumulate`; the issue's goal: within 1.5x).
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from zenflow.optimizer import ZenFlowAdamW
from zenflow.reports import bounds
from zenflow.selection import num_selected

SMALL = os.environ.get("ZENFLOW_BENCH_SMALL", "0") not in ("", "0")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
WIDTH, LAYERS = (256, 2) if SMALL else (4096, 6) if DEVICE.type == "cuda" else (2048, 6)
ROUNDS, WARMUP_ROUNDS = (5, 1) if SMALL else (12, 2)
INTERVAL = 4


class Trainer:
    """A model of LAYERS bias-free linear layers and its optimizer; `steps(n)` times n optimizer steps only."""

    def __init__(self, zenflow: dict) -> None:
        torch.manual_seed(0)
        layers = [torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)]
        self.model = torch.nn.Sequential(*layers).to(DEVICE, torch.bfloat16)
        self.opt = ZenFlowAdamW(self.model.parameters(), lr=1e-4, weight_decay=0.01,
                                zenflow={"select_interval": 10**6, "overlap_step": False, **zenflow})
        self.x = torch.randn(1, WIDTH, device=DEVICE).to(torch.bfloat16)

    def steps(self, n: int) -> float:
        return sum(seconds for seconds, _ in self.timed_steps(n))

    def timed_steps(self, n: int) -> list[tuple[float, bool]]:
        """n steps: (seconds of step(), whether it was an update boundary) for each."""
        times = []
        for _ in range(n):
            self.model(self.x).float().sum().backward()
            _sync()
            start = time.perf_counter()
            self.opt.step()
            _sync()
            times.append((time.perf_counter() - start, self.opt.clock.since_boundary == 0))
            self.opt.zero_grad()
        return times

    def accumulation_seconds(self, n: int) -> float:
        """The mean step() of the accumulation steps among the next n (n covers at least one)."""
        accumulating = [seconds for seconds, boundary in self.timed_steps(n) if not boundary]
        return sum(accumulating) / len(accumulating)


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


@pytest.mark.parametrize("shape", [f"{LAYERS}x{WIDTH}"])
def test_zenflow_cycle_against_zero_offload(benchmark, shape: str) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    zenflow = Trainer({"topk_ratio": 0.1, "update_interval": INTERVAL})
    offload = Trainer({"topk_ratio": 0.0, "update_interval": 1})
    cycles: list[float] = []
    reference: list[float] = []
    try:
        zenflow.steps(INTERVAL)  # selection, host parts built: from here every round is a steady update cycle
        offload.steps(INTERVAL)
        benchmark.group = "step-ratio"
        benchmark.pedantic(lambda: cycles.append(zenflow.steps(INTERVAL) / INTERVAL),
                           setup=lambda: reference.append(offload.steps(INTERVAL) / INTERVAL),
                           rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS)
        # the bound table's keys (zenflow/reports/bounds.py: table): its reference is ZeRO-Offload's step, no copy
        benchmark.extra_info.update(part=bounds.CYCLE, shape=[LAYERS, WIDTH, WIDTH], device=DEVICE.type, topk_ratio=0.1,
                                    update_interval=INTERVAL, threads=1)
        if benchmark.stats is None:  # benchmarks disabled (the smoke run)
            return
        measured = bounds.bound_ratio(cycles[-ROUNDS:], reference, nbytes=0)
        benchmark.extra_info.update(cycle_ms=1e3 * sorted(cycles[-ROUNDS:])[ROUNDS // 2],
                                    zero_offload_ms=1e3 * sorted(reference[-ROUNDS:])[ROUNDS // 2],
                                    bound_ratio=measured.ratio, bound_ratio_low=measured.low,
                                    bound_ratio_high=measured.high, reference_gbps=0.0)
        limit = bounds.limit_for(DEVICE.type, bounds.CYCLE, bounds.load_limits())
        if limit is not None and measured.ratio > limit and not SMALL:
            pytest.fail(f"{DEVICE.type}/{bounds.CYCLE}: ZenFlow's cycle mean is {measured.ratio:.2f}x ZeRO-Offload's "
                        f"step, over its limit {limit:g} (bench/thresholds.toml [bound_ratios])", pytrace=False)
    finally:
        zenflow.opt.close()
        offload.opt.close()
        torch.set_num_threads(threads)


@pytest.mark.parametrize("shape", [f"{LAYERS}x{WIDTH}"])
def test_overlap_accumulation_step_against_the_device_update_bound(benchmark, shape: str) -> None:
    """Overlap mode: the host's work runs on the worker, so an accumulation step's step() on the training thread is
    the device update (and the hand-off). Its mean over a cycle, against a plain copy of the device update's bytes
    for all the layers (docs/design.md §4), interleaved round by round."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    zenflow = Trainer({"topk_ratio": 0.1, "update_interval": INTERVAL, "overlap_step": True})
    k = num_selected(WIDTH, 0.1)
    nbytes = LAYERS * bounds.copy_bytes("device-update", WIDTH, WIDTH, k, WIDTH - k, 2)
    reference = bounds.InterleavedReference(bounds.reference_copy("device", nbytes, DEVICE))
    steps: list[float] = []
    try:
        zenflow.steps(2 * INTERVAL)  # selection, host parts built, one background update applied
        benchmark.group = "step-ratio"
        benchmark.pedantic(lambda: steps.append(zenflow.accumulation_seconds(INTERVAL)), setup=reference,
                           rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS)
        benchmark.extra_info.update(part=bounds.OVERLAP, shape=[LAYERS, WIDTH, WIDTH], device=DEVICE.type,
                                    topk_ratio=0.1, update_interval=INTERVAL, threads=1, bound_bytes=nbytes)
        if benchmark.stats is None:  # benchmarks disabled (the smoke run)
            return
        measured = bounds.bound_ratio(steps[-ROUNDS:], reference.seconds, nbytes)
        floor = sum(bounds.device_update_line_floor(WIDTH, zenflow.opt.state[p].sel, 2)
                    for p in zenflow.model.parameters())
        benchmark.extra_info.update(cycle_ms=1e3 * sorted(steps[-ROUNDS:])[ROUNDS // 2],
                                    bound_ratio=measured.ratio, bound_ratio_low=measured.low,
                                    bound_ratio_high=measured.high, reference_gbps=measured.reference_gbps,
                                    line_floor_bytes=floor,
                                    line_floor_ratio=bounds.line_floor_ratio(measured, nbytes, floor))
        limit = bounds.limit_for(DEVICE.type, bounds.OVERLAP, bounds.load_limits())
        if limit is not None and measured.ratio > limit and not SMALL:
            pytest.fail(f"{DEVICE.type}/{bounds.OVERLAP}: the training thread's accumulation step is "
                        f"{measured.ratio:.2f}x the device update's bound, over its limit {limit:g} "
                        "(bench/thresholds.toml [bound_ratios])", pytrace=False)
    finally:
        zenflow.opt.close()
        torch.set_num_threads(threads)
