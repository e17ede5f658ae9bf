"""The host parts of a ZenFlow step against the host's streaming bound: one benchmark per part, each
with its bytes moved, GB/s and fraction of the triad bound in extra_info; the streams (copy, triad, in-place add)
are benchmarks of the same group, on the same cores (the worker's, as the optimizer pins them).

    .venv/bin/python -m pytest bench/test_host_parts.py --benchmark-only
    python -m zenflow.costmodel.host_bandwidth     # the same numbers as one table, both scenario sizes

Sizes: the host share of the cpu-scale model's largest column param (14.7M elements) and of a Llama-2-7B MLP
weight (40.6M); the streams over 3 x 256 MB (larger than the caches). ZENFLOW_BENCH_SMALL=1: 1M elements
each (a smoke, not a measurement).
"""

from __future__ import annotations

import os
from contextlib import nullcontext

import pytest
import torch

from zenflow.config import ZenFlowConfig
from zenflow.costmodel import host_bandwidth as hb
from zenflow.host import accumulate_into_
from zenflow.worker import reserved_cores

SMALL = os.environ.get("ZENFLOW_BENCH_SMALL", "0") not in ("", "0")
PART_NUMEL = 1_000_000 if SMALL else hb.SIZES["cpu-scale"]
SIZE_NUMEL = {size: 1_000_000 if SMALL else numel for size, numel in hb.SIZES.items()}  # cpu-scale, 7b-layer
STREAM_NUMEL = 1_000_000 if SMALL else hb.BOUND_NUMEL
ROUNDS, WARMUP_ROUNDS = (3, 1) if SMALL else (9, 2)
SPLIT = reserved_cores(ZenFlowConfig().pt_reserved_cores_perc)
WORKER, COMPUTE = (SPLIT[0], SPLIT[1]) if SPLIT else (None, None)
_bound: dict[str, float] = {}  # the triad's GB/s once measured in this session


def _record(benchmark, name: str, nbytes: int) -> None:
    benchmark.extra_info.update(bytes_per_round=nbytes, worker_cores=WORKER, torch_threads=torch.get_num_threads())
    if benchmark.stats is None:  # --benchmark-disable: nothing measured
        return
    gbps = nbytes / benchmark.stats.stats.median / 1e9
    benchmark.extra_info["GB/s"] = gbps
    if name == "triad":
        _bound["triad"] = gbps
    if "triad" in _bound:
        benchmark.extra_info["fraction_of_triad_bound"] = gbps / _bound["triad"]


@pytest.mark.parametrize("stream", list(hb.STREAM_BYTES))
def test_host_stream(benchmark, stream: str) -> None:
    fn = hb.stream_kernels(STREAM_NUMEL)[stream]
    benchmark.group = "host-parts"
    with hb.on_cores(WORKER):
        benchmark.pedantic(fn, rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS, iterations=1)
    _record(benchmark, stream, hb.STREAM_BYTES[stream] * STREAM_NUMEL)


@pytest.mark.parametrize("size", list(SIZE_NUMEL))
@pytest.mark.parametrize("part", list(hb.PART_BYTES))
def test_host_part(benchmark, part: str, size: str) -> None:
    numel = SIZE_NUMEL[size]
    fn = hb.part_kernels(numel)[part]
    benchmark.group = "host-parts"
    busy = hb.python_busy(COMPUTE) if part == "accumulate_beside_python" else nullcontext()
    with hb.on_cores(WORKER), busy:
        benchmark.pedantic(fn, rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS, iterations=1)
    _record(benchmark, part, hb.PART_BYTES[part] * hb.elements(numel))


def test_host_accumulate_before_issue_25(benchmark) -> None:
    """The clipped accumulation as main did it before the one-pass host.accumulate_into_ (docs/history.md, "The host
    path at its bandwidth bound"), in the same run as `accumulate` above: the staging buffer scaled in place (its own
    pass over memory), then added in 256K-element blocks. The factor alternates 0.5 / 2 (exact in bf16) so repeated
    rounds neither underflow nor change the arithmetic's cost."""
    rows = max(1, PART_NUMEL // 4096)
    staging = (torch.randn(rows, 4096) * 1e-3).to(torch.bfloat16)
    acc, factors = torch.zeros(rows, 4096), [torch.tensor(0.5), torch.tensor(2.0)]

    def two_passes() -> None:
        factors.reverse()
        staging.mul_(factors[0])
        accumulate_into_(acc, staging, None, block_elements=1 << 18)

    benchmark.group = "host-parts"
    with hb.on_cores(WORKER):
        benchmark.pedantic(two_passes, rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS, iterations=1)
    _record(benchmark, "accumulate_before_issue_25", hb.PART_BYTES["accumulate"] * hb.elements(PART_NUMEL))
