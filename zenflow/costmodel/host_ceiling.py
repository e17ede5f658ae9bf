"""The host's ceiling beside the measured speedup: at micro-batch 1 every offload engine on a 16-core host is bound by
host memory bandwidth, so a ZenFlow speedup short of the paper's may be the host's, not ZenFlow's.

Measured here, in the sitting of the runs: the host AdamW rate (torch's fused AdamW, what our engines run) and the
gradient accumulation rate (a bf16 gradient added into an fp32 accumulator, the worker's per-step host work), each
at the ZenFlow worker's core count (DeepSpeed's `pt_reserved_cores_perc` split) and at every core (ZeRO-Offload's
host step). From them, per step and per parameter:

    ZeRO-Offload host work  ≥ P · (1/accumulate_all + 1/adamw_all)
    ZenFlow host work       ≥ (1 − topk) · P · (1/accumulate_worker + 1/(U · adamw_worker))   (in the background)

ZenFlow's step cannot be shorter than its host work, so the measured ZeRO-Offload step divided by that bound is the
largest speedup this host allows: the ceiling printed next to the measured speedup (reports/scenario.py).

    python -m zenflow.costmodel.host_ceiling --out build/llama7b/llama2-7b-8L     # -> <out>/host/rates.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from zenflow.config import ZenFlowConfig
from zenflow.costmodel.host_adam import measure as measure_adamw
from zenflow.harness.atomic import write_text_atomic
from zenflow.host import add_upcast_
from zenflow.worker import reserved_cores

SCHEMA = "host-rates/1"
FILE = "host/rates.json"  # a sub-folder: the run records are the result set's top-level *.json


def accumulate_rate(numel: int, threads: int, steps: int = 9) -> float:
    """G elements/s of `acc (fp32) += grad (bf16)` through the optimizer's own kernel (add_upcast_)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        acc = torch.zeros(numel // 4096, 4096)
        grad = torch.randn(numel // 4096, 4096).to(torch.bfloat16)
        for _ in range(2):
            add_upcast_(acc, grad)  # untimed: first touch
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            add_upcast_(acc, grad)
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    return acc.numel() / statistics.median(times) / 1e9


def measure(numel: int, compute_fraction: float = ZenFlowConfig().pt_reserved_cores_perc) -> dict[str, Any]:
    """Rates at the worker's cores (the block's default core split) and at all cores; what ceiling_note reads."""
    cores = len(os.sched_getaffinity(0))
    split = reserved_cores(compute_fraction)
    worker = len(split[0]) if split else cores
    threads = sorted({worker, cores})
    adamw = measure_adamw(numel, threads, rounds=1, kernels=("torch-fused-adamw",))["torch-fused-adamw"]
    return {"schema": SCHEMA, "numel": numel, "cores": cores, "worker_cores": worker,
            "adamw_gelem_s": {str(n): adamw[str(n)]["gelem_s"] for n in threads if str(n) in adamw},
            "accumulate_gelem_s": {str(n): accumulate_rate(numel, n) for n in threads}}


def host_bounds_ms(rates: dict[str, Any], params: float, topk: float, interval: int) -> tuple[float, float]:
    """(ZeRO-Offload's, ZenFlow's) least host work per step in ms, for `params` column parameters."""
    every, worker = str(rates["cores"]), str(rates["worker_cores"])
    adam, acc = rates["adamw_gelem_s"], rates["accumulate_gelem_s"]
    offload = params * (1 / acc[every] + 1 / adam[every]) / 1e6
    zenflow = (1 - topk) * params * (1 / acc[worker] + 1 / (interval * adam[worker])) / 1e6
    return offload, zenflow


def ceiling_note(rates: dict[str, Any] | None, params: float, topk: float, interval: int,
                 baseline_ms: float | None, speedup: float | None) -> str | None:
    """One line for the table's notes: the measured speedup beside the ceiling the host's rates imply."""
    if not rates or not baseline_ms or not params:
        return None
    offload, zenflow = host_bounds_ms(rates, params, topk, interval)
    ceiling = baseline_ms / zenflow
    measured = f"{speedup:.2f}×" if speedup else "not measured"
    return (f"- Host ceiling: ref-zenflow over ref-offload {measured}, at most {ceiling:.2f}× on this host "
            f"(ZenFlow's host work ≥ {zenflow:.0f} ms/step on the worker's {rates['worker_cores']} cores; "
            f"ZeRO-Offload's ≥ {offload:.0f} ms on {rates['cores']}; rates measured in this sitting, {FILE})")


def load(folder: Path) -> dict[str, Any] | None:
    path = Path(folder) / FILE
    if not path.exists():
        return None
    record = json.loads(path.read_text())
    return record if record.get("schema") == SCHEMA else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zenflow.costmodel.host_ceiling", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help=f"the result set's folder (the record goes to {FILE})")
    ap.add_argument("--numel", type=int, default=32 * 2**20, help="elements per measured buffer (default 32M)")
    args = ap.parse_args(argv)
    if args.numel < 4096:
        ap.error(f"argument --numel: {args.numel} is not allowed: expected an integer >= 4096")
    out = args.out / FILE
    record = measure(args.numel)
    write_text_atomic(out, json.dumps(record, indent=1) + "\n")  # whole or not at all
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
