"""Calibration microbenchmarks for the cost model (docs/cost-model.md), stored as a record.

Each constant is measured alone, outside any end-to-end run, on the machine at hand:

- forward+backward of the workload at two sequence lengths, on 1 and on 2 threads (fit: fixed + per-token time);
- the optimizer parts, by driving the real `ZenFlowAdamW` on the workload's parameters with synthetic gradients
  (no forward/backward), sync mode, reading its blocking sections: gradient copy / gather to the host, host fp32
  accumulation, host AdamW, parameter copy / scatter back, and the rest of the step (clipping norm + device update);
- plain `torch.optim.AdamW` (fused, bf16 params, with clipping): the no-offload optimizer step;
- contention: forward+backward on one core while the other core runs host AdamW, against each alone.

    python -m zenflow.harness.calibrate [--out results/costmodel/<hardware-id>/calibration.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
CAL_SEQS = (8, 32)  # calibration points; validation runs use other sequence lengths (4, 16, 64)
SCHEMA = "costmodel-calibration/1"
SMOKE_SHAPE = {"hidden": 64, "layers": 2, "intermediate": 128, "heads": 4}


def _median_ms(fn, repeats: int = 5, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


class _Blocks:
    """Observer: wall time per blocking section of one step."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = {}
        self._open: dict[str, float] = {}

    def on_transfer(self, direction: str, kind: str, nbytes: int) -> None:
        pass

    def on_block_start(self, what: str) -> None:
        self._open[what] = time.perf_counter()

    def on_block_end(self, what: str) -> None:
        self.ms[what] = self.ms.get(what, 0.0) + (time.perf_counter() - self._open.pop(what)) * 1e3


def _fill_grads(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3


def _zenflow_step_parts(model: torch.nn.Module, block: dict[str, Any], threads: int, repeats: int) -> dict:
    """Median per-section times (ms) of synchronous ZenFlowAdamW steps on synthetic gradients."""
    from zenflow import ZenFlowAdamW

    torch.set_num_threads(threads)
    opt = ZenFlowAdamW(model.parameters(), lr=1e-5, weight_decay=0.01, gradient_clipping=1.0, skip_nonfinite=True,
                       zenflow={**block, "overlap_step": False, "select_strategy": "step", "select_interval": 10**6})
    rows = []
    for i in range(repeats + 2):  # the first step selects (and moves columns): not timed, nor the next
        _fill_grads(model)
        obs = _Blocks()
        handle = opt.add_observer(obs)
        start = time.perf_counter()
        opt.step()
        total = (time.perf_counter() - start) * 1e3
        handle.remove()
        if i >= 2:
            rows.append({**obs.ms, "total": total})
    opt.close()
    keys = {k for r in rows for k in r}
    out = {k: statistics.median(r.get(k, 0.0) for r in rows) for k in keys}
    out["device"] = out["total"] - sum(v for k, v in out.items() if k != "total")  # clip norm + device update
    return out


def calibrate(seq_lens: tuple[int, ...] = CAL_SEQS, repeats: int = 5, shape: dict | None = None) -> dict[str, Any]:
    from zenflow.harness.runner import _model_facts
    from zenflow.harness.workloads import Workload, build_model
    from zenflow.telemetry.environment import capture_environment

    env = capture_environment()
    w = Workload(**(shape or {}))
    model = build_model(w)
    facts = _model_facts(model)
    n_col, elem = facts["column_parameters"], model.lm_head.weight.element_size()
    fb: dict[str, dict[str, float]] = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for seq in seq_lens:
            ids = torch.randint(0, 32000, (1, seq))

            def fwd_bwd(ids: torch.Tensor = ids) -> None:
                model(input_ids=ids, labels=ids).loss.backward()
                model.zero_grad(set_to_none=True)
            fb.setdefault(str(threads), {})[str(seq)] = _median_ms(fwd_bwd, repeats)
    torch.set_num_threads(2)
    _fill_grads(model)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01, fused=True)

    def plain_step() -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        adamw.step()
    no_offload_ms = _median_ms(plain_step, repeats)
    offload2 = _zenflow_step_parts(build_model(w), {"topk_ratio": 0.0, "update_interval": 1}, 2, repeats)
    zen1 = _zenflow_step_parts(build_model(w), {"topk_ratio": 0.1, "update_interval": 1}, 1, repeats)
    zen0 = _zenflow_step_parts(build_model(w), {"topk_ratio": 0.0, "update_interval": 1}, 1, repeats)
    contention = _contention(build_model(w), w, repeats)
    return {"schema": SCHEMA, "hardware_id": env["hardware_id"], "environment": env,
            "workload": w.to_dict(), "model": facts, "element_bytes": elem, "column_elements": n_col,
            "forward_backward_ms": fb, "no_offload_optimizer_ms_2t": no_offload_ms,
            "offload_step_parts_ms_2t": offload2, "zenflow_r0.1_step_parts_ms_1t": zen1,
            "zenflow_r0_step_parts_ms_1t": zen0,
            "contention": contention, "repeats": repeats,
            "method": __doc__.split("\n\n")[1]}


def _contention(model: torch.nn.Module, w: Any, repeats: int) -> dict[str, float]:
    """Slow-down of forward+backward (main thread, 1 core) while host AdamW runs on a thread pinned to the
    other core, and of host AdamW while forward+backward runs; 1.0 = no contention."""
    import os

    from zenflow.adam import AdamWHyper, adamw_

    torch.set_num_threads(1)
    n = 12_000_000
    host = [torch.zeros(n) for _ in range(3)]
    grad = torch.randn(n) * 1e-3
    hyper = AdamWHyper(lr=1e-5, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    ids = torch.randint(0, 32000, (1, 32))

    def fwd_bwd() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    def adam() -> None:
        adamw_([host[0]], [grad], [host[1]], [host[2]], [1], hyper)
    fb_alone, adam_alone = _median_ms(fwd_bwd, repeats), _median_ms(adam, repeats)
    cores = sorted(os.sched_getaffinity(0))
    stop, adam_times = threading.Event(), []

    def worker() -> None:
        if len(cores) > 1:
            os.sched_setaffinity(0, {cores[-1]})
        torch.set_num_threads(1)
        while not stop.is_set():
            start = time.perf_counter()
            adam()
            adam_times.append((time.perf_counter() - start) * 1e3)
    if len(cores) > 1:
        os.sched_setaffinity(0, {cores[0]})
    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    fb_busy = _median_ms(fwd_bwd, repeats * 2)
    stop.set()
    thread.join()
    os.sched_setaffinity(0, set(cores))
    adam_busy = statistics.median(adam_times) if adam_times else adam_alone
    return {"fb_alone_ms": fb_alone, "fb_with_host_adamw_ms": fb_busy, "compute_slowdown": fb_busy / fb_alone,
            "adamw_alone_ms": adam_alone, "adamw_with_fb_ms": adam_busy, "host_slowdown": adam_busy / adam_alone,
            "adamw_elements": n}


def main(argv: list[str] | None = None) -> int:
    from zenflow.telemetry.environment import capture_environment

    ap = argparse.ArgumentParser(description="Calibrate the cost model on this machine (≈1 minute).")
    ap.add_argument("--out", type=Path, default=None, help="default: results/costmodel/<hardware-id>/calibration.json")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="a tiny model (tests only; not a calibration)")
    args = ap.parse_args(argv)
    out = args.out or ROOT / "results" / "costmodel" / capture_environment()["hardware_id"] / "calibration.json"
    record = calibrate(repeats=args.repeats, shape=SMOKE_SHAPE if args.smoke else None)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1, default=str) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
