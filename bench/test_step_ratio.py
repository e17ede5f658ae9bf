"""ZenFlow's whole `step()` against ZeRO-Offload's, in one run, interleaved (docs/benchmarks.md, "Bound ratios").

    .venv/bin/python -m pytest bench/test_step_ratio.py --benchmark-only

The configuration of the CPU measurements: six `Linear(2048, 2048, bias=False)` layers in bf16, one thread, a
micro-batch of one token (backward is cheap: the step is what is timed), `overlap_step` off so every part runs on one
clock. A round is one ZenFlow update cycle (`topk_ratio` 0.1, `update_interval` 4: three accumulation steps and a
boundary), timed around `step()` only; before it, four steps of ZeRO-Offload (`topk_ratio` 0, `update_interval` 1)
on the same model shape, timed the same way (the reference, interleaved round by round). `extra_info`: the ratio of
the cycle mean to ZeRO-Offload's step and its 95% interval; over its `[bound_ratios]` limit
(`<device>/zenflow-cycle`) the benchmark fails. On CUDA the same, with Llama-2-7B-sized layers.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from zenflow.optimizer import ZenFlowAdamW
from zenflow.reports.bounds import CYCLE, bound_ratio, limit_for, load_limits

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
        seconds = 0.0
        for _ in range(n):
            self.model(self.x).float().sum().backward()
            _sync()
            start = time.perf_counter()
            self.opt.step()
            _sync()
            seconds += time.perf_counter() - start
            self.opt.zero_grad()
        return seconds


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
        benchmark.extra_info.update(part=CYCLE, shape=[LAYERS, WIDTH, WIDTH], device=DEVICE.type, topk_ratio=0.1,
                                    update_interval=INTERVAL, threads=1)
        if benchmark.stats is None:  # benchmarks disabled (the smoke run)
            return
        measured = bound_ratio(cycles[-ROUNDS:], reference, nbytes=0)
        benchmark.extra_info.update(cycle_ms=1e3 * sorted(cycles[-ROUNDS:])[ROUNDS // 2],
                                    zero_offload_ms=1e3 * sorted(reference[-ROUNDS:])[ROUNDS // 2],
                                    bound_ratio=measured.ratio, bound_ratio_low=measured.low,
                                    bound_ratio_high=measured.high, reference_gbps=0.0)
        limit = limit_for(DEVICE.type, CYCLE, load_limits())
        if limit is not None and measured.ratio > limit and not SMALL:
            pytest.fail(f"{DEVICE.type}/{CYCLE}: ZenFlow's cycle mean is {measured.ratio:.2f}x ZeRO-Offload's "
                        f"step, over its limit {limit:g} (bench/thresholds.toml [bound_ratios])", pytrace=False)
    finally:
        zenflow.opt.close()
        offload.opt.close()
        torch.set_num_threads(threads)
