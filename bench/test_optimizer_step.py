"""Optimizer-step and host-AdamW benchmarks (pytest-benchmark).

    .venv/bin/python -m pytest bench/ --benchmark-only                      # the real run (~50M params)
    ZENFLOW_BENCH_SMALL=1 .venv/bin/python -m pytest bench/ --benchmark-disable   # smoke run (~1M params)

Group "optimizer-step": `step()` alone (gradients are filled once with fixed random values, no forward/backward) of
ZenFlowAdamW sync, ZenFlowAdamW overlap, torch.optim.AdamW(fused=True) and the pure offload configuration
(topk_ratio 0, update_interval 1), all on the same CPU model. Rounds are whole update-interval cycles, so the
*mean* is the amortised per-step cost (boundary steps included); the median is a typical non-boundary step.
extra_info holds the parameter count, the configuration and, for ZenFlow, the bytes moved per timed step.

Group "host-adamw": torch's fused AdamW (zenflow.adam.adamw_) and DeepSpeed's CPU Adam (the ZeRO-Offload
baseline's host optimizer) on a flat fp32 buffer against a plain memory copy of the same traffic. AdamW reads
param, grad, exp_avg, exp_avg_sq and writes param, exp_avg, exp_avg_sq: 28 bytes per parameter. The copy bound is
`dst.copy_(src)` with 14 bytes per parameter in each buffer (14 read + 14 written).
extra_info holds the GB/s of each and the ratio adamw / copy bound. A copy also pays write-allocate traffic on its
destination, which AdamW (writing back into buffers it has just read) does not, so AdamW can beat that "bound"; a
third entry, an in-place read-modify-write pass over the same bytes (`buf.mul_(1.0)`), is the bound of AdamW's
access pattern (ratio adamw / inplace bound).
"""

from __future__ import annotations

import gc
import os

import pytest
import torch
from torch import nn

from zenflow.adam import AdamWHyper, adamw_
from zenflow.harness.cli import interval
from zenflow.optimizer import ZenFlowAdamW

SMALL = os.environ.get("ZENFLOW_BENCH_SMALL", "0") not in ("", "0")
WIDTH, DEPTH = (288, 12) if SMALL else (2048, 12)  # Linear(W, W) x 12 with biases, LayerNorm between: 1.0M / 50.4M
HOST_NUMEL = 1_000_000 if SMALL else 25_000_000

LR, WEIGHT_DECAY = 1e-4, 0.01
# $ZENFLOW_BENCH_INTERVAL (bench/conftest.py checked it): 4, another integer or "auto", named in the ZenFlow ids
UPDATE_INTERVAL = interval(os.environ.get("ZENFLOW_BENCH_INTERVAL") or "4")
SETTING = "" if UPDATE_INTERVAL == 4 else f"-U{UPDATE_INTERVAL}"
CYCLE = UPDATE_INTERVAL if isinstance(UPDATE_INTERVAL, int) else 1  # "auto": no fixed cycle, the mean amortises
ROUNDS, WARMUP_ROUNDS = (-(-n // CYCLE) * CYCLE for n in (16, 4))  # whole update-interval cycles; the warm-up
assert ROUNDS % CYCLE == 0 and WARMUP_ROUNDS % CYCLE == 0         # also absorbs the first selection

_ZENFLOW = dict(topk_ratio=0.1, update_interval=UPDATE_INTERVAL, select_interval=1000, full_warm_up_rounds=0)
ENGINES: dict[str, dict | None] = {
    f"zenflow-sync{SETTING}": _ZENFLOW,
    f"zenflow-overlap{SETTING}": {**_ZENFLOW, "overlap_step": True},
    "torch-adamw-fused": None,
    "zenflow-offload": dict(topk_ratio=0.0, update_interval=1, select_interval=1000),
}

ADAMW_BYTES_PER_PARAM = 28  # 4 fp32 reads + 3 fp32 writes
COPY_BYTES_PER_PARAM = ADAMW_BYTES_PER_PARAM // 2  # per buffer: read once from src, written once to dst
HOST_ROUNDS, HOST_WARMUP_ROUNDS = 20, 2
HYPER = AdamWHyper(lr=LR, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=WEIGHT_DECAY)


# ---- optimizer-step ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(DEPTH):
        if i:
            layers.append(nn.LayerNorm(WIDTH))
        layers.append(nn.Linear(WIDTH, WIDTH))
    net = nn.Sequential(*layers)
    gen = torch.Generator().manual_seed(1)
    for p in net.parameters():
        p.grad = torch.randn(p.shape, generator=gen) * 1e-2
    return net


@pytest.fixture(scope="module")
def initial_weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _make(engine: str, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    config = ENGINES[engine]
    if config is None:
        return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    return ZenFlowAdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, zenflow=config)


@pytest.mark.parametrize("engine", list(ENGINES))
def test_optimizer_step(benchmark, model: nn.Module, initial_weights: list[torch.Tensor], engine: str) -> None:
    params = list(model.parameters())
    with torch.no_grad():  # every engine starts from the same weights
        for p, w in zip(params, initial_weights):
            p.copy_(w)
    opt = _make(engine, params)
    zenflow = isinstance(opt, ZenFlowAdamW)
    rounds_started = 0
    window_start: dict[tuple[str, str], int] = {}

    def setup() -> None:  # untimed, before every round: note the byte counters when the timed rounds begin
        nonlocal rounds_started
        if zenflow and rounds_started == WARMUP_ROUNDS:
            window_start.update(opt.transfer_bytes)
        rounds_started += 1

    benchmark.group = "optimizer-step"
    benchmark.extra_info.update(engine=engine, params=sum(p.numel() for p in params), width=WIDTH, depth=DEPTH,
                                config=ENGINES[engine] or {"fused": True}, lr=LR, weight_decay=WEIGHT_DECAY,
                                rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS)
    try:
        benchmark.pedantic(opt.step, setup=setup, rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS, iterations=1)
        benchmark.extra_info["compute_threads"] = torch.get_num_threads()  # overlap gives cores to the worker
        if zenflow and rounds_started > WARMUP_ROUNDS:  # not when the benchmark is disabled (one call)
            timed = rounds_started - WARMUP_ROUNDS
            end = opt.transfer_bytes
            per_step = {f"{d}/{k}": (end[(d, k)] - window_start.get((d, k), 0)) / timed for d, k in sorted(end)}
            benchmark.extra_info["transfer_bytes_per_step"] = {k: v for k, v in per_step.items() if v}
            benchmark.extra_info["transfer_bytes_per_step_total"] = sum(per_step.values())
            benchmark.extra_info["host_updates"] = opt.host_updates  # what "auto" chose, over every round
    finally:
        if zenflow:
            opt.close()  # restores the main thread's cores and torch threads after overlap
        opt.state.clear()  # free the moments and host buffers before the next engine allocates its own
        gc.collect()


# ---- host-adamw -------------------------------------------------------------------------------------------------
_host_results: dict[str, tuple[float, dict]] = {}  # name -> (GB/s, that benchmark's extra_info)


def _record_throughput(benchmark, name: str, numel: int) -> None:
    nbytes = ADAMW_BYTES_PER_PARAM * numel
    benchmark.extra_info.update(numel=numel, bytes_per_round=nbytes, torch_threads=torch.get_num_threads())
    if benchmark.stats is None:  # benchmark disabled
        return
    gbps = nbytes / benchmark.stats.stats.median / 1e9
    benchmark.extra_info["GB/s"] = gbps
    _host_results[name] = (gbps, benchmark.extra_info)
    if "adamw" not in _host_results:
        return
    summary = {f"{key.replace('-', '_')}_GBps": value for key, (value, _) in _host_results.items()}
    for bound in ("copy-bound", "inplace-bound"):
        if bound in _host_results:
            summary[f"adamw_over_{bound.replace('-', '_')}"] = _host_results["adamw"][0] / _host_results[bound][0]
    for _, info in _host_results.values():  # the group's last benchmark completes all of them
        info.update(summary)


def test_host_adamw(benchmark) -> None:
    gen = torch.Generator().manual_seed(2)
    param = torch.randn(HOST_NUMEL, generator=gen)
    grad = torch.randn(HOST_NUMEL, generator=gen) * 1e-2
    exp_avg, exp_avg_sq = torch.zeros(HOST_NUMEL), torch.zeros(HOST_NUMEL)
    step = 0

    def update() -> None:
        nonlocal step
        step += 1
        adamw_([param], [grad], [exp_avg], [exp_avg_sq], [step], HYPER)

    benchmark.group = "host-adamw"
    benchmark.pedantic(update, rounds=HOST_ROUNDS, warmup_rounds=HOST_WARMUP_ROUNDS, iterations=1)
    _record_throughput(benchmark, "adamw", HOST_NUMEL)


def test_host_deepspeed_cpu_adam(benchmark) -> None:
    """DeepSpeed's CPU Adam (its AVX kernel, AdamW mode) on the same flat buffer and threads: the host optimizer
    the paper's ZeRO-Offload baseline ran (its rate per core beside torch's fused AdamW)."""
    if benchmark.disabled and os.environ.get("ZENFLOW_BENCH_SMOKE_DEEPSPEED") != "1":
        pytest.skip("smoke mode (--benchmark-disable): DeepSpeed's op load takes seconds; "
                    "ZENFLOW_BENCH_SMOKE_DEEPSPEED=1 runs it too")
    deepspeed_adam = pytest.importorskip("deepspeed.ops.adam", reason="deepspeed not installed")
    gen = torch.Generator().manual_seed(2)
    param = nn.Parameter(torch.randn(HOST_NUMEL, generator=gen))
    param.grad = torch.randn(HOST_NUMEL, generator=gen) * 1e-2
    opt = deepspeed_adam.DeepSpeedCPUAdam([param], lr=LR, betas=(HYPER.beta1, HYPER.beta2), eps=HYPER.eps,
                                          weight_decay=WEIGHT_DECAY, adamw_mode=True)
    benchmark.group = "host-adamw"
    benchmark.pedantic(opt.step, rounds=HOST_ROUNDS, warmup_rounds=HOST_WARMUP_ROUNDS, iterations=1)
    _record_throughput(benchmark, "deepspeed-cpu-adam", HOST_NUMEL)


def test_host_copy_bound(benchmark) -> None:
    src = torch.ones(COPY_BYTES_PER_PARAM * HOST_NUMEL, dtype=torch.uint8)  # written once: pages are resident
    dst = torch.zeros_like(src)
    benchmark.group = "host-adamw"
    benchmark.pedantic(dst.copy_, args=(src,), rounds=HOST_ROUNDS, warmup_rounds=HOST_WARMUP_ROUNDS, iterations=1)
    _record_throughput(benchmark, "copy-bound", HOST_NUMEL)


def test_host_inplace_bound(benchmark) -> None:
    """Not a copy: one in-place read-modify-write pass over 14 bytes per parameter. AdamW writes back into buffers
    it has just read, so unlike `dst.copy_(src)` it pays no write-allocate (read-for-ownership) traffic on a
    separate destination; this is the streaming bound of that access pattern."""
    buf = torch.ones(COPY_BYTES_PER_PARAM * HOST_NUMEL // 4)  # fp32
    benchmark.group = "host-adamw"
    benchmark.pedantic(buf.mul_, args=(1.0,), rounds=HOST_ROUNDS, warmup_rounds=HOST_WARMUP_ROUNDS, iterations=1)
    _record_throughput(benchmark, "inplace-bound", HOST_NUMEL)
