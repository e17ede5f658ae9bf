"""Every part of a ZenFlow step against its byte bound (zenflow/reports/bounds.py has the bounds; docs/design.md §4).

    .venv/bin/python -m pytest bench/test_bounds.py --benchmark-only

Each benchmark times one part through the optimizer's own function, on the state of a real ZenFlowAdamW (one
weight, `topk_ratio` 0.1, after its first step), and before every round a plain contiguous copy of the bytes that
part must move at least (the reference, interleaved round by round). extra_info gets `bound_ratio` (part / copy,
round by round: the geometric mean) and its 95% interval, the bytes and the copy's GB/s. A ratio over its limit in
`[bound_ratios]` of bench/thresholds.toml fails the benchmark in one line. The device is CUDA when present, else the
CPU; the shape is in the name, so a smoke run is never compared with a full one.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

from zenflow.device import device_update_, start_offload, upload_
from zenflow.device_accumulation import accumulate_on_device_, ship_
from zenflow.host import GradCopy, accumulate_, host_adamw_
from zenflow.optimizer import ZenFlowAdamW
from zenflow.reports.bounds import (
    PARTS,
    InterleavedReference,
    bound_ratio,
    copy_bytes,
    device_update_line_floor,
    line_floor_ratio,
    load_limits,
    reference_copy,
    violation,
)
from zenflow.selection import num_selected, select_columns
from zenflow.state import column_states, host_groups

SMALL = os.environ.get("ZENFLOW_BENCH_SMALL", "0") not in ("", "0")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# [out, in]: a Llama-2-7B MLP weight on a GPU; the 4096x4096 weight of the CPU measurements; tiny in smoke mode
OUT, IN = (256, 256) if SMALL else (4096, 11008) if DEVICE.type == "cuda" else (4096, 4096)
DTYPE = torch.bfloat16
TOPK_RATIO = 0.1
ROUNDS, WARMUP_ROUNDS = (5, 1) if SMALL else (20, 3)
HOST_PARTS = ["selection", "device-update", "gradient-offload", "host-accumulate", "host-adamw", "parameter-upload"]
DEVICE_SUM_PARTS = ["device-accumulate", "ship"]


def _optimizer(accumulate_on: str) -> tuple[ZenFlowAdamW, torch.Tensor]:
    """A ZenFlowAdamW over one bf16 weight with a gradient, after one step: columns selected, host part built."""
    weight = torch.nn.Parameter(torch.randn(OUT, IN, generator=torch.Generator().manual_seed(0)).to(DEVICE, DTYPE))
    weight.grad = torch.randn(OUT, IN, generator=torch.Generator().manual_seed(1)).to(DEVICE, DTYPE)
    opt = ZenFlowAdamW([weight], lr=1e-4, weight_decay=0.01, accumulate_on=accumulate_on,
                       zenflow={"topk_ratio": TOPK_RATIO, "update_interval": 10**6, "select_interval": 10**6,
                                "overlap_step": False})
    opt.step()
    return opt, weight


def _part(name: str, opt: ZenFlowAdamW, weight: torch.Tensor) -> tuple[Callable[[], None], Callable[[], None] | None]:
    """(the part as one call, its untimed per-round preparation): the optimizer's own functions on its state."""
    st, link, params = opt.state[weight], opt.link, [weight]
    part = st.host
    if name == "selection":
        k = num_selected(IN, TOPK_RATIO)
        return lambda: select_columns(weight.grad, k), None
    if name == "device-update":
        return lambda: device_update_(opt.param_groups, opt.state, None), None
    if name == "gradient-offload":  # the copy into staging, landed (CPU device: the gather is the copy)
        return lambda: [c.land(link) for c in start_offload(params, opt.state, link, 0)], None
    if name == "host-accumulate":  # staging already holds the columns: the add alone
        return lambda: accumulate_(link, [GradCopy(part, part.grad_staging[0])], 0), None
    if name == "host-adamw":
        groups = host_groups(opt.param_groups, opt.state)
        return lambda: host_adamw_(groups, 0), lambda: part.counts.__setitem__(0, 1)
    if name == "parameter-upload":
        return lambda: upload_(params, opt.state, link, opt.ranks), lambda: setattr(part, "staged", True)
    if name == "device-accumulate":
        return lambda: accumulate_on_device_(params, opt.state, link, None), None
    if name == "ship":
        states = column_states(opt.param_groups, opt.state)
        return lambda: [c.land(link) for c in ship_(states, link, 0)], lambda: setattr(st, "d_acc_count", 1)
    raise ValueError(name)


def _synced(fn: Callable[[], object]) -> Callable[[], None]:
    def run() -> None:
        with torch.no_grad():  # as step() runs them
            fn()
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()  # the round covers the kernels and copies it queued

    return run


def _measure(benchmark, name: str, accumulate_on: str) -> None:
    opt, weight = _optimizer(accumulate_on)
    try:
        if accumulate_on == "device":
            accumulate_on_device_([weight], opt.state, opt.link, None)  # the device sum exists (for "ship")
        st = opt.state[weight]
        k, n = st.sel.numel(), st.host.n_offloaded  # at least: whole rows move their shadows too, not counted
        nbytes = copy_bytes(name, OUT, IN, k, n, DTYPE.itemsize)
        fn, prepare = _part(name, opt, weight)
        reference = InterleavedReference(reference_copy(PARTS[name].where, nbytes, DEVICE), prepare)
        benchmark.group = "bounds"
        benchmark.pedantic(_synced(fn), setup=reference, rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS)
        benchmark.extra_info.update(part=name, shape=[OUT, IN], dtype=str(DTYPE), device=DEVICE.type,
                                    topk_ratio=TOPK_RATIO, selected=k, host_columns=n, bound_bytes=nbytes)
        if benchmark.stats is None:  # benchmarks disabled (the smoke run): one call, nothing to judge
            return
        measured = bound_ratio(list(benchmark.stats.stats.data), reference.seconds, nbytes)
        benchmark.extra_info.update(bound_ratio=measured.ratio, bound_ratio_low=measured.low,
                                    bound_ratio_high=measured.high, reference_gbps=measured.reference_gbps)
        if name == "device-update":  # scattered columns of a row-major weight: whole cache lines move
            floor = device_update_line_floor(OUT, st.sel, DTYPE.itemsize)
            benchmark.extra_info.update(line_floor_bytes=floor,
                                        line_floor_ratio=line_floor_ratio(measured, nbytes, floor))
        problem = violation(DEVICE.type, name, measured, load_limits())
        if problem and not SMALL:  # limits are for the full shape; a smoke shape is all overhead
            pytest.fail(problem, pytrace=False)
    finally:
        opt.close()


SHAPE = f"{OUT}x{IN}"


@pytest.mark.parametrize("part", HOST_PARTS, ids=[f"{p}-{SHAPE}" for p in HOST_PARTS])
def test_bound(benchmark, part: str) -> None:
    _measure(benchmark, part, "host")


@pytest.mark.parametrize("part", DEVICE_SUM_PARTS, ids=[f"{p}-{SHAPE}" for p in DEVICE_SUM_PARTS])
def test_bound_device_sums(benchmark, part: str) -> None:
    _measure(benchmark, part, "device")
