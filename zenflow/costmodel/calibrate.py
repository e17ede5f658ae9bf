"""Calibration microbenchmarks for the cost model (docs/cost-model.md), stored as a record.

Each constant is measured alone, outside any end-to-end run, on the machine at hand:

- short training loops of the workload at three sequence lengths (8, 32, 128; the validation runs use 4, 16, 64,
  256, 512), forward+backward timed alone (piecewise linear: fixed + per-token time), with each optimizer in the
  layout it runs in: plain fused `torch.optim.AdamW` on 2 threads (no-offload); `ZenFlowAdamW` synchronous, topk 0
  on 2 threads (ZeRO-Offload) and topk 0.1 / topk 0 on 1 thread (the overlap layout's per-core rates). The
  optimizer's blocking sections give gradient copy / gather to the host, host fp32 accumulation, host AdamW,
  parameter copy / scatter back; the rest of the step is clipping norm + device update;
- contention: forward+backward on one core while the other core runs host AdamW, against each alone.

    python -m zenflow.costmodel.calibrate [--out results/costmodel/<hardware-id>/calibration.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from zenflow.harness.configs import TINY_LLAMA_SHAPE
from zenflow.telemetry.neighbours import NeighbourWatch, wait_until_quiet

ROOT = Path(__file__).resolve().parents[2]
CAL_SEQS = (8, 32, 128)  # calibration points; validation runs use other sequence lengths (4, 16, 64, 256, 512)
SCHEMA = "costmodel-calibration/1"
SMOKE_SHAPE = TINY_LLAMA_SHAPE


def _line(points: dict[int, float]) -> dict[str, float]:
    return {str(k): v for k, v in sorted(points.items())}


def _training_loop(w: Any, block: dict[str, Any] | None, threads: int, seqs: tuple[int, ...],
                   repeats: int) -> dict[str, Any]:
    """Short runs of the harness's one run loop (session.Session, in this process), one per sequence length:
    `block` None = no-offload (plain fused AdamW, clipping 1.0); otherwise ref-zenflow with that block,
    synchronous, selection once at the first step. The first two steps (selection, allocation) are not used.
    Returns the median forward+backward per sequence length and the median step parts over all used steps: the
    optimizer's blocking sections from the record's `blocks_ms`, the rest of the optimizer step as "device"."""
    from zenflow.harness.engines import deepspeed_config
    from zenflow.harness.session import RunSpec, Session

    engine = "no-offload" if block is None else "ref-zenflow"
    zenflow = {**(block or {}), "overlap_step": False, "select_strategy": "step", "select_interval": 10**6}
    cfg = deepspeed_config(engine, zenflow, w.dtype, micro_batch=1, lr=1e-5, weight_decay=0.01, clipping=1.0,
                           cuda=False)
    fb: dict[int, float] = {}
    rows = []
    for seq in seqs:
        spec = RunSpec(engine=engine, label="calibration", workload={**w.to_dict(), "seq_len": seq,
                                                                    "data": "synthetic", "device": "cpu"},
                       ds_config=cfg, warmup_steps=2, timed_steps=repeats, threads=threads, progress=False)
        session = Session(spec)
        try:
            session.step(2 + repeats)
        finally:
            session.close()
        session.timeline.finish()
        used = session.timeline.steps[2:]
        fb[seq] = statistics.median(t.forward_backward_ms for t in used)
        rows += [{**t.blocks_ms, "total": t.optimizer_ms} for t in used]
    keys = {k for r in rows for k in r}
    parts = {k: statistics.median(r.get(k, 0.0) for r in rows) for k in keys}
    parts["device"] = parts["total"] - sum(v for k, v in parts.items() if k != "total")  # clip norm + device update
    return {"threads": threads, "block": block, "forward_backward_ms": _line(fb), "step_parts_ms": parts}


def calibrate(seq_lens: tuple[int, ...] = CAL_SEQS, repeats: int = 5, shape: dict | None = None) -> dict[str, Any]:
    from zenflow.harness.session import model_facts
    from zenflow.harness.workloads import Workload, build_model
    from zenflow.telemetry.environment import capture_environment

    env = capture_environment()
    w = Workload(**(shape or {}))
    model = build_model(w)
    facts = model_facts(model)
    loops = {"no_offload_2t": (None, 2), "offload_2t": ({"topk_ratio": 0.0, "update_interval": 1}, 2),
             "zenflow_r0.1_1t": ({"topk_ratio": 0.1, "update_interval": 1}, 1),
             "zenflow_r0_1t": ({"topk_ratio": 0.0, "update_interval": 1}, 1)}
    measured = {name: _training_loop(w, block, threads, seq_lens, repeats)
                for name, (block, threads) in loops.items()}
    contention = _contention(build_model(w), w, repeats)
    return {"schema": SCHEMA, "hardware_id": env["hardware_id"], "environment": env,
            "workload": w.to_dict(), "model": facts, "element_bytes": model.lm_head.weight.element_size(),
            "column_elements": facts["column_parameters"], "calibration_seq_lens": list(seq_lens),
            "loops": measured, "contention": contention, "repeats": repeats, "method": __doc__.split("\n\n")[1]}


def _contention(model: torch.nn.Module, w: Any, repeats: int) -> dict[str, float]:
    """Slow-down of forward+backward (main thread, pinned to one core) while host AdamW runs on a thread pinned to
    the other core, and of host AdamW while forward+backward runs; 1.0 = no contention. Alone and together are
    interleaved round by round and the ratio is the median of per-round ratios, so a neighbour's load on a shared
    machine hits both sides of each ratio alike."""

    from zenflow.adam import AdamWHyper, adamw_

    torch.set_num_threads(1)
    n = 12_000_000
    host = [torch.zeros(n) for _ in range(3)]
    grad = torch.randn(n) * 1e-3
    hyper = AdamWHyper(lr=1e-5, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    ids = torch.randint(0, 32000, (1, 32))
    cores = sorted(os.sched_getaffinity(0))
    run, stop, adam_times = threading.Event(), threading.Event(), []

    def fwd_bwd() -> float:
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
        return (time.perf_counter() - start) * 1e3

    def worker() -> None:
        if len(cores) > 1:
            os.sched_setaffinity(0, {cores[-1]})
        torch.set_num_threads(1)
        while not stop.is_set():
            if not run.wait(0.01):
                continue
            start = time.perf_counter()
            adamw_([host[0]], [grad], [host[1]], [host[2]], [1], hyper)
            adam_times.append(((time.perf_counter() - start) * 1e3, busy_main[0]))
    busy_main = [False]
    saved = set(cores)
    if len(cores) > 1:
        os.sched_setaffinity(0, {cores[0]})
    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    fb_alone, fb_busy = [], []
    try:
        fwd_bwd()
        for _ in range(repeats + 1):
            fb_alone.append(fwd_bwd())          # worker idle
            run.set()
            time.sleep(0.05)                    # worker alone (main thread sleeping)
            busy_main[0] = True
            fb_busy.append(fwd_bwd())           # both busy
            busy_main[0] = False
            time.sleep(0.05)
            run.clear()
    finally:
        stop.set()
        thread.join()
        os.sched_setaffinity(0, saved)
    adam_alone = [t for t, busy in adam_times if not busy] or [t for t, _ in adam_times]
    adam_busy = [t for t, busy in adam_times if busy] or adam_alone
    fb_ratio = statistics.median(b / a for a, b in zip(fb_alone, fb_busy))
    return {"fb_alone_ms": statistics.median(fb_alone), "fb_with_host_adamw_ms": statistics.median(fb_busy),
            "compute_slowdown": max(1.0, fb_ratio), "adamw_alone_ms": statistics.median(adam_alone),
            "adamw_with_fb_ms": statistics.median(adam_busy),
            "host_slowdown": max(1.0, statistics.median(adam_busy) / statistics.median(adam_alone)),
            "adamw_elements": n}


def main(argv: list[str] | None = None) -> int:
    from zenflow.telemetry.environment import capture_environment

    ap = argparse.ArgumentParser(description="Calibrate the cost model on this machine (≈1 minute).")
    ap.add_argument("--out", type=Path, default=None, help="default: results/costmodel/<hardware-id>/calibration.json")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="a tiny model (tests only; not a calibration)")
    ap.add_argument("--wait-quiet", type=float, default=180, help="wait up to this many seconds until no other "
                    "heavy job (training run, benchmark, compiler) runs on this machine")
    args = ap.parse_args(argv)
    wait_until_quiet(args.wait_quiet)
    out = args.out or ROOT / "results" / "costmodel" / capture_environment()["hardware_id"] / "calibration.json"
    with NeighbourWatch() as watch:
        record = calibrate(repeats=args.repeats, shape=SMOKE_SHAPE if args.smoke else None)
    record["neighbour_busy_fraction"] = watch.busy_fraction
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1, default=str) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
