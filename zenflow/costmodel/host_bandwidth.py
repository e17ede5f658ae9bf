"""The host path against the memory system: a streaming bound measured on the worker's cores, and every
host part of a ZenFlow step as bytes moved per second against it.

Each part runs the optimizer's own kernel on buffers of one column param's host share (larger than the caches):

| part | kernel | bytes per element |
|---|---|---|
| accumulate | `host.accumulate_into_`: fp32 acc += clip · bf16 staging (upcast, one fused multiply-add) | 10 |
| accumulate_first | the first gradient of an interval: acc = clip · staging (upcast, scaled in fp32) | 6 |
| accumulate_unclipped | the same with no clipping, or a coefficient of 1 (the norm within its bound) | 10 |
| accumulate_beside_python | accumulate_unclipped while the training thread runs Python on its cores (the GIL) | 10 |
| adamw | `adam.adamw_`: fused AdamW on the mean (divided as read); fp32 master, m, v read + written, grad read | 28 |
| cast_upload | `param_staging.copy_(master)`: fp32 -> bf16 into the upload buffer | 6 |

The bound is STREAM's triad (`a = b + s·c`, 12 bytes counted per fp32 element) over buffers larger than the
caches (BOUND_NUMEL: 3 x 256 MB; the Intel Xeon VM's L3 is 480 MB), on the same threads. Bytes are the ones the
algorithm must move, STREAM's convention: a triad's write-allocate read of `a` is not counted. The accumulation and
AdamW write back what they read, so they pay no write-allocate and can exceed the triad: the in-place stream
`a += s·c` (12 bytes, all of them real traffic) is reported beside it as the stricter reference. Goal:
accumulate and AdamW at ≥ 0.8 of the bound, at the host share of the largest column param of the cpu-scale model and
of a Llama-2-7B layer (docs/host-worker.md, "The host path at the bandwidth bound").

    python -m zenflow.costmodel.host_bandwidth                       # cpu-scale and 7B-layer sizes, worker's cores
    python -m zenflow.costmodel.host_bandwidth --numel 1000000 --out /tmp/bw.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch

from zenflow.adam import AdamWHyper, adamw_
from zenflow.config import ZenFlowConfig
from zenflow.harness.atomic import write_text_atomic
from zenflow.harness.tables import markdown
from zenflow.host import accumulate_into_
from zenflow.telemetry.environment import capture_environment
from zenflow.worker import reserved_cores

SCHEMA = "host-bandwidth/1"
PART_BYTES = {"accumulate": 10, "accumulate_first": 6, "accumulate_unclipped": 10, "accumulate_beside_python": 10,
              "adamw": 28, "cast_upload": 6}
STREAM_BYTES = {"copy": 8, "triad": 12, "inplace_add": 12}
BOUND_NUMEL = 64 * 2**20  # fp32 elements per stream buffer: 256 MB
GOAL = 0.8  # accumulate and AdamW at >= 0.8 of the bound
GOAL_PARTS = ("accumulate", "accumulate_unclipped", "accumulate_beside_python", "adamw")
# The host share (90% of the columns) of the largest column param of each scenario: cpu-scale's 32000 x 512
# embedding and LM head; Llama-2-7B's MLP weights (11008 x 4096).
SIZES = {"cpu-scale": int(0.9 * 32000 * 512), "7b-layer": int(0.9 * 11008 * 4096)}
HYPER = AdamWHyper(lr=1e-5, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


@contextmanager
def on_cores(cores: list[int] | None) -> Iterator[int]:
    """Run the block on these cores with one torch thread per core (the worker's layout); restore after."""
    threads, affinity = torch.get_num_threads(), os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    if cores and affinity is not None:
        os.sched_setaffinity(0, cores)  # the calling thread only
        torch.set_num_threads(len(cores))
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(threads)
        if cores and affinity is not None:
            os.sched_setaffinity(0, affinity)


def _median_seconds(fn: Callable[[], object], steps: int, warmup: int = 2) -> float:
    for _ in range(warmup):  # first touch of the pages, the kernels' first call
        fn()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def stream_kernels(numel: int) -> dict[str, Callable[[], object]]:
    """The streams of STREAM_BYTES as calls over fp32 buffers of `numel` elements."""
    a, b, c = torch.ones(numel), torch.ones(numel), torch.ones(numel)
    return {"copy": partial(b.copy_, a), "triad": partial(torch.add, b, c, alpha=0.5, out=a),
            "inplace_add": partial(a.add_, c, alpha=1e-9)}


def stream_rates(numel: int, steps: int = 7) -> dict[str, float]:
    """GB/s of copy, triad and in-place add over fp32 buffers of `numel` elements, on the current threads."""
    return {name: STREAM_BYTES[name] * numel / _median_seconds(fn, steps) / 1e9
            for name, fn in stream_kernels(numel).items()}


@contextmanager
def python_busy(cores: list[int] | None) -> Iterator[None]:
    """A thread on the compute cores doing what a forward pass does to the GIL: small torch ops with Python between
    them (each op releases the GIL, each return takes it back)."""
    stop = threading.Event()

    def busy() -> None:
        if cores and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cores)
        x, w = torch.randn(64, 64), torch.randn(64, 64)
        while not stop.is_set():
            x = torch.tanh(x @ w) * 0.5

    thread = threading.Thread(target=busy, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def part_kernels(numel: int) -> dict[str, Callable[[], object]]:
    """Each host part (PART_BYTES) as a call on buffers of about `numel` elements, through the optimizer's own
    kernels (accumulate_beside_python is accumulate_unclipped: the caller makes the training thread busy)."""
    rows, cols = max(1, numel // 4096), min(numel, 4096)
    gen = torch.Generator().manual_seed(0)
    staging = (torch.randn(rows, cols, generator=gen) * 1e-3).to(torch.bfloat16)
    acc, master = torch.zeros(rows, cols), torch.randn(rows, cols, generator=gen)
    exp_avg, exp_avg_sq = torch.zeros(rows, cols), torch.zeros(rows, cols)
    upload = torch.empty(rows, cols, dtype=torch.bfloat16)
    clip, step = torch.tensor(0.5), [0]

    def adamw() -> None:
        step[0] += 1
        adamw_([master], [acc], [exp_avg], [exp_avg_sq], [step[0]], HYPER, divisor=4)  # a 4-step interval's mean

    unclipped = partial(accumulate_into_, acc, staging, None, first=False)
    return {"accumulate": partial(accumulate_into_, acc, staging, clip, first=False),
            "accumulate_first": partial(accumulate_into_, acc, staging, clip, first=True),
            "accumulate_unclipped": unclipped, "accumulate_beside_python": unclipped,
            "adamw": adamw, "cast_upload": partial(upload.copy_, master)}


def part_rates(numel: int, steps: int = 7, compute_cores: list[int] | None = None) -> dict[str, float]:
    """GB/s of each host part on buffers of `numel` elements; accumulate_beside_python with python_busy on
    `compute_cores`."""
    rates = {}
    for name, fn in part_kernels(numel).items():
        if name == "accumulate_beside_python":
            with python_busy(compute_cores):
                seconds = _median_seconds(fn, steps)
        else:
            seconds = _median_seconds(fn, steps)
        rates[name] = PART_BYTES[name] * elements(numel) / seconds / 1e9
    return rates


def elements(numel: int) -> int:
    """The elements part_kernels(numel) actually allocates (whole rows of 4096)."""
    return max(1, numel // 4096) * min(numel, 4096)


def measure(sizes: dict[str, int] = SIZES, compute_fraction: float = ZenFlowConfig().pt_reserved_cores_perc,
            steps: int = 7, bound_numel: int = BOUND_NUMEL) -> dict[str, Any]:
    """The streams (over `bound_numel` elements) and every part at each size, on the worker's cores (the block's
    default split; every core when there is only one): GB/s, and each part's fraction of the triad bound and of the
    in-place stream."""
    split = reserved_cores(compute_fraction)
    worker = split[0] if split else None
    out: dict[str, Any] = {"schema": SCHEMA, "taken_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "worker_cores": worker, "part_bytes_per_element": PART_BYTES, "goal": GOAL,
                           "bound_numel": bound_numel, "sizes": {}}
    with on_cores(worker) as threads:
        out["threads"] = threads
        out["stream_gbps"] = streams = stream_rates(bound_numel, steps)
        out["bound_gbps"] = bound = streams["triad"]
        for name, numel in sizes.items():
            parts = part_rates(numel, steps, split[1] if split else None)
            out["sizes"][name] = {"numel": numel, "part_gbps": parts,
                                  "fraction_of_bound": {k: v / bound for k, v in parts.items()},
                                  "fraction_of_inplace": {k: v / streams["inplace_add"] for k, v in parts.items()}}
    return out


def table(record: dict[str, Any]) -> str:
    """One Markdown table: per size and part, GB/s and its fraction of the triad bound (the goal's) and of the
    in-place stream."""
    streams = record["stream_gbps"]
    rows = [["streams", f"{record['bound_numel'] / 1e6:.0f}M", name, f"{gbps:.2f}",
             f"{gbps / record['bound_gbps']:.2f}", f"{gbps / streams['inplace_add']:.2f}",
             "the bound" if name == "triad" else ""]
            for name, gbps in streams.items()]
    for size, r in record["sizes"].items():
        for i, (part, gbps) in enumerate(r["part_gbps"].items()):
            frac = r["fraction_of_bound"][part]
            goal = ("meets ≥ 0.8" if frac >= GOAL else "below 0.8") if part in GOAL_PARTS else ""
            rows.append([size if i == 0 else "", f"{r['numel'] / 1e6:.1f}M" if i == 0 else "", part, f"{gbps:.2f}",
                         f"{frac:.2f}", f"{r['fraction_of_inplace'][part]:.2f}", goal])
    return markdown(rows, ["size", "elements", "part", "GB/s", "of triad (bound)", "of in-place add", "goal"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zenflow.costmodel.host_bandwidth",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=None, help="one size of this many elements instead of the scenarios'")
    ap.add_argument("--steps", type=int, default=7, help="timed steps per kernel (median)")
    ap.add_argument("--out", type=Path, default=None, help="write the record here (JSON, whole or not at all)")
    args = ap.parse_args(argv)
    if args.numel is not None and args.numel < 4096:
        ap.error(f"argument --numel: {args.numel} is not allowed: expected an integer >= 4096")
    if args.steps < 1:
        ap.error(f"argument --steps: {args.steps} is not allowed: expected an integer >= 1")
    record = measure({"given": args.numel} if args.numel else SIZES, steps=args.steps,
                     bound_numel=max(args.numel, 4096) if args.numel else BOUND_NUMEL)
    record["environment"] = {k: capture_environment().get(k) for k in ("hardware_id", "cpu")}
    if args.out:
        write_text_atomic(args.out, json.dumps(record, indent=1) + "\n")
    print(table(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
