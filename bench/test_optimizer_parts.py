"""Benchmarks of the optimizer's parts, one per phase of a ZenFlow step (docs/design.md §2), on one weight shape.

    .venv/bin/python -m pytest bench/test_optimizer_parts.py --benchmark-only

| group            | what is timed                                                                            |
|------------------|------------------------------------------------------------------------------------------|
| select-columns   | `zenflow.selection.select_columns`: column norms of a gradient (fp32) + top-k             |
| device-update    | `zenflow.device.device_update_`: gather the selected gradient columns, fused AdamW on their|
|                  | fp32 masters and moments, write the model-dtype columns back (the real optimizer's phase)  |
| link             | `Link.gather_to_host` (unselected gradient columns -> host buffer) and                    |
|                  | `Link.scatter_to_device` (updated host columns -> the weight)                             |

Host AdamW throughput is in test_optimizer_step.py (group host-adamw). The device is CUDA when present (each round
ends with `torch.cuda.synchronize()`, a CPU-GPU sync point, so the round covers the kernels), else the CPU, where
the link's copies are real copies between distinct tensors. The shape is in every benchmark's name, so a small
smoke run is never compared with a full one. extra_info: shape, dtype, columns moved or selected, bytes and GB/s.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from zenflow.device import device_update_
from zenflow.harness.cli import interval
from zenflow.hooks import Observers
from zenflow.link import Link
from zenflow.optimizer import ZenFlowAdamW
from zenflow.selection import complement, num_selected, select_columns

SMALL = os.environ.get("ZENFLOW_BENCH_SMALL", "0") not in ("", "0")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# [out, in]: a Llama-2-7B MLP weight on a GPU; a cpu-scale-sized weight on the CPU; tiny in smoke mode
OUT, IN = (256, 256) if SMALL else (4096, 11008) if DEVICE.type == "cuda" else (1408, 2048)
SHAPE = f"{OUT}x{IN}"
DTYPE = torch.bfloat16
TOPK_RATIO = 0.1
ROUNDS, WARMUP_ROUNDS = (10, 2) if SMALL else (30, 3)
# $ZENFLOW_BENCH_INTERVAL (bench/conftest.py checked it): the block's update interval, 4, another integer or "auto"
UPDATE_INTERVAL = interval(os.environ.get("ZENFLOW_BENCH_INTERVAL") or "4")
SETTING = "" if UPDATE_INTERVAL == 4 else f"-U{UPDATE_INTERVAL}"


def _synced(fn):
    """The function, then a CUDA sync point so the round covers the kernels it queued (a no-op on the CPU)."""
    if DEVICE.type != "cuda":
        return fn

    def run(*args):
        fn(*args)
        torch.cuda.synchronize()

    return run


def _grad(seed: int = 0) -> torch.Tensor:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(OUT, IN, generator=gen, device=DEVICE).to(DTYPE)


def _info(benchmark, nbytes: int, **more) -> None:
    benchmark.extra_info.update(shape=[OUT, IN], dtype=str(DTYPE), device=DEVICE.type, topk_ratio=TOPK_RATIO,
                                bytes_per_round=nbytes, **more)
    if benchmark.stats is not None:  # not when the benchmark is disabled
        benchmark.extra_info["GB/s"] = nbytes / benchmark.stats.stats.median / 1e9


@pytest.mark.parametrize("shape", [SHAPE])
def test_select_columns(benchmark, shape: str) -> None:
    grad, k = _grad(), num_selected(IN, TOPK_RATIO)
    benchmark.group = "select-columns"
    benchmark.pedantic(_synced(select_columns), args=(grad, k), rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS)
    _info(benchmark, grad.numel() * grad.element_size(), selected=k)


@pytest.mark.parametrize("shape", [SHAPE + SETTING])
def test_device_selective_update(benchmark, shape: str) -> None:
    """The device half of a step on two weights of the shape (what `step()` does every step, minus the rest)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(IN, OUT, bias=False), torch.nn.Linear(OUT, IN, bias=False))
    model.to(device=DEVICE, dtype=DTYPE)
    for seed, p in enumerate(model.parameters()):
        p.grad = torch.randn(p.shape, generator=torch.Generator(device=DEVICE).manual_seed(seed + 1),
                             device=DEVICE).to(DTYPE)
    opt = ZenFlowAdamW(model.parameters(), lr=1e-4, weight_decay=0.01,
                       zenflow={"topk_ratio": TOPK_RATIO, "update_interval": UPDATE_INTERVAL, "select_interval": 10**6})
    try:
        opt.step()  # builds the state and selects the columns: from here each call is a steady-state device update
        selected = sum(opt.state[p].sel.numel() * p.shape[0] for p in model.parameters())
        benchmark.group = "device-update"
        # the optimizer's own phase (not a copy of its arithmetic, which would not follow changes to it); step()
        # runs it under no_grad, without clipping here
        update = torch.no_grad()(functools.partial(device_update_, opt.param_groups, opt.state, None))
        benchmark.pedantic(_synced(update), rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS)
        # fp32 master, exp_avg, exp_avg_sq read+written, the gradient read and the model-dtype column written
        _info(benchmark, selected * (3 * 4 * 2 + 2 * DTYPE.itemsize), selected_elements=selected)
    finally:
        opt.close()


@pytest.fixture(scope="module")
def link_case() -> tuple[Link, torch.Tensor, torch.Tensor, torch.Tensor]:
    link = Link(DEVICE, Observers())
    weight = _grad(1)
    unselected = complement(select_columns(_grad(2), num_selected(IN, TOPK_RATIO)), IN)
    host = link.host_empty((OUT, unselected.numel()), DTYPE).zero_()
    return link, weight, unselected, host


@pytest.mark.parametrize("shape", [SHAPE])
def test_link_gather_to_host(benchmark, link_case, shape: str) -> None:
    link, grad, unselected, host = link_case
    benchmark.group = "link"
    benchmark.pedantic(_synced(link.gather_to_host), args=(grad, unselected, host), rounds=ROUNDS,
                       warmup_rounds=WARMUP_ROUNDS)
    _info(benchmark, host.numel() * host.element_size(), columns=unselected.numel(), direction="d2h")


@pytest.mark.parametrize("shape", [SHAPE])
def test_link_scatter_to_device(benchmark, link_case, shape: str) -> None:
    link, weight, unselected, host = link_case
    benchmark.group = "link"
    benchmark.pedantic(_synced(link.scatter_to_device), args=(host, unselected, weight, "params"), rounds=ROUNDS,
                       warmup_rounds=WARMUP_ROUNDS)
    _info(benchmark, host.numel() * host.element_size(), columns=unselected.numel(), direction="h2d")
