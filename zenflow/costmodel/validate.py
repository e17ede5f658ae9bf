"""Validation: the cost model's predictions against the committed cpu-scale run records.

Our engines are predicted from the calibration alone (no end-to-end run is fitted); DeepSpeed on the CPU accelerator
gets constants of its own, fitted on the sequence-16 records and tested at the other sequences.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

from zenflow.costmodel.model import Block, Inputs, Prediction, predict
from zenflow.costmodel.presets import cpu_scale_inputs
from zenflow.harness.configs import DEEPSPEED_EXAMPLES_BLOCK
from zenflow.harness.engines.build import deepspeed_config
from zenflow.harness.engines.registry import is_deepspeed
from zenflow.harness.records import read_records
from zenflow.harness.runner import run_in_subprocess
from zenflow.harness.session import RunSpec
from zenflow.telemetry.neighbours import NeighbourWatch, wait_until_quiet

ROOT = Path(__file__).resolve().parents[2]
# The ZenFlow block of every run and projection (DeepSpeedExamples' settings), in the cost model's terms.
BLOCK = Block(DEEPSPEED_EXAMPLES_BLOCK["topk_ratio"], DEEPSPEED_EXAMPLES_BLOCK["update_interval"],
              DEEPSPEED_EXAMPLES_BLOCK["overlap_step"])
SEQ16 = "results/llama7b/{hw}"  # the committed seq-16 scenario is the middle validation point
EXTRA_SEQS = (4, 64, 256)  # with seq 16: host optimizer / compute of ref-offload from ~1.2 down to ~0.6 on this CPU
QUIET = 0.2  # a run is "quiet" when other heavy jobs ran during less than this fraction of it
# Harness engine (its registry name) -> the cost model's engine that describes it.
MODELLED_AS = {"no-offload": "no-offload", "ref-offload": "zero-offload", "ref-zenflow": "zenflow-overlap",
               "ref-offload-gas": "zero-offload-gas"}  # the same-frequency control (issue 15): where it was run
VALIDATED = ("ds-zero-offload", "ds-zenflow", "ref-offload", "ref-zenflow", "ref-offload-gas", "no-offload")
SUMMARY_KEYS = ("cycle_mean_ms", "accumulate_step_ms", "update_step_ms", "compute_ms", "io_ms", "stall_ms",
                "forward_backward_ms")


def record_sets(hw: str, root: Path = ROOT) -> dict[int, Path]:
    """Sequence length -> folder of run records: seq 16 from results/llama7b/<hw>/, the rest from validation/seqN/."""
    folders = {16: root / SEQ16.format(hw=hw)}
    extra = root / "results" / "costmodel" / hw / "validation"
    if extra.exists():  # every validation/seqN folder present, not only the default sequences
        folders.update({int(f.name[3:]): f for f in extra.glob("seq*") if f.name[3:].isdigit()})
    return {s: f for s, f in sorted(folders.items()) if f.exists()}


def runs_source(hw: str, root: Path = ROOT) -> str:
    sets = record_sets(hw, root)
    if 16 in sets and sets[16] == root / SEQ16.format(hw=hw):
        return f"seq 16 from `results/llama7b/{hw}/`, the others from `validation/seqN/`"
    return "`validation/seqN/` for every sequence"


def measured(folder: Path) -> dict[str, dict[str, float]]:
    """Per engine, medians over its runs of the summary values (runs without telemetry excluded; runs on a quiet
    machine when there are any)."""
    out: dict[str, dict[str, float]] = {}
    runs = [r for r in read_records(folder) if r.status == "ok" and r.protocol.get("telemetry", True)]
    for engine in sorted({r.engine for r in runs}):
        all_runs = [r for r in runs if r.engine == engine]
        quiet = [r for r in all_runs if r.protocol.get("neighbour_busy_fraction", 0.0) < QUIET]
        chosen = quiet or all_runs
        mine = [r.summary for r in chosen]
        out[engine] = {k: statistics.median(s[k] for s in mine) if all(s.get(k) is not None for s in mine) else None
                       for k in SUMMARY_KEYS}
        out[engine]["runs"] = len(mine)
        out[engine]["neighbours"] = max(r.protocol.get("neighbour_busy_fraction", 0.0) for r in chosen)
    return out


def deepspeed_constants(cal: dict[str, Any], seq16: dict[str, dict[str, float]]) -> dict[str, float]:
    """DeepSpeed on the CPU accelerator needs its own constants, fitted on the seq-16 records only: its
    forward+backward overhead over plain torch (hooks, bucket copies), its step (CPU Adam + copies), and
    ds-zenflow's extra time on accumulation and update steps. The other sequences then test them."""
    fb16 = cpu_scale_inputs(cal, 16).fb_ms
    off, zen = seq16.get("ds-zero-offload"), seq16.get("ds-zenflow")
    k = {}
    if off:
        k["ds_fb_overhead_ms"] = off["forward_backward_ms"] - fb16
        k["ds_step_ms"] = off["stall_ms"]
    if zen and off:
        k["dsz_accumulate_extra_ms"] = zen["accumulate_step_ms"] - fb16 - k["ds_fb_overhead_ms"]
        k["dsz_update_extra_ms"] = zen["update_step_ms"] - fb16 - k["ds_fb_overhead_ms"]
        k["dsz_stall_ms"] = zen["stall_ms"]  # its engine.step() wall time per step, the same measure as measured
    return k


def predict_engine(engine: str, x: Inputs, ds: dict[str, float]) -> Prediction | None:
    if engine in MODELLED_AS:
        return predict(x, MODELLED_AS[engine], BLOCK)
    fb = x.fb_ms + ds.get("ds_fb_overhead_ms", float("nan"))
    if engine == "ds-zero-offload" and "ds_step_ms" in ds:
        t = fb + ds["ds_step_ms"]
        return Prediction(engine, None, t, t, fb, 0.0, ds["ds_step_ms"], 2 * x.column_params * x.dtype_bytes)
    if engine == "ds-zenflow" and "dsz_update_extra_ms" in ds:
        acc, upd = fb + ds["dsz_accumulate_extra_ms"], fb + ds["dsz_update_extra_ms"]
        cycle = (3 * acc + upd) / 4
        stall = ds["dsz_stall_ms"]
        return Prediction(engine, acc, upd, cycle, cycle - stall, 0.0, stall, float("nan"))
    return None


def validation(cal: dict[str, Any], hw: str, root: Path = ROOT) -> list[dict[str, Any]]:
    """One row per (sequence, engine) with records: measured and predicted cycle, accumulate, update, stall."""
    sets = {s: measured(f) for s, f in record_sets(hw, root).items()}
    ds = deepspeed_constants(cal, sets.get(16, {}))
    rows = []
    for seq, engines in sets.items():
        x = cpu_scale_inputs(cal, seq)
        off = engines.get("ref-offload")
        ratio = (off["stall_ms"] + off["io_ms"]) / off["compute_ms"] if off else None
        for engine in VALIDATED:
            m, p = engines.get(engine), predict_engine(engine, x, ds)
            if not m or not p:
                continue
            rows.append({"seq": seq, "opt_to_compute_measured": ratio, "engine": engine, "runs": m["runs"],
                         "measured_cycle_ms": m["cycle_mean_ms"], "predicted_cycle_ms": p.cycle_ms,
                         "error_pct": 100 * (p.cycle_ms / m["cycle_mean_ms"] - 1),
                         "measured_accumulate_ms": m["accumulate_step_ms"], "predicted_accumulate_ms": p.accumulate_ms,
                         "measured_update_ms": m["update_step_ms"], "predicted_update_ms": p.update_ms,
                         "measured_stall_ms": m["stall_ms"], "predicted_stall_ms": p.stall_ms,
                         "fitted_here": is_deepspeed(engine) and seq == 16, "neighbours_busy": m["neighbours"]})
    return rows


def run_validation(folder: Path, engines: list[str], repeats: int, seqs: tuple[int, ...] = EXTRA_SEQS,
                   max_wait_s: float = 90) -> None:
    """The cpu-scale runs at the given sequences, one fresh run child each (the harness runner), each started when
    no neighbour's heavy job runs (waits up to max_wait_s); the record notes whether a neighbour ran meanwhile."""
    for rep in range(repeats):
        for seq in seqs:
            for engine in engines:
                wait_until_quiet(max_wait_s, poll_s=2)
                path = folder / f"seq{seq}" / f"{engine}-r{rep}.json"
                cfg = deepspeed_config(engine, DEEPSPEED_EXAMPLES_BLOCK, "bf16", 1, lr=2e-5, weight_decay=0.01,
                                       clipping=1.0, cuda=False)
                spec = RunSpec(engine=engine, label="costmodel-validation", ds_config=cfg,
                               workload={"model": "cpu-scale", "dtype": "bf16", "seq_len": seq, "micro_batch": 1},
                               extra={"repeat": rep}, progress=False)
                with NeighbourWatch() as watch:
                    record = run_in_subprocess(spec, path)
                record.protocol["neighbour_busy_fraction"] = watch.busy_fraction
                record.write(path)
                print(f"seq {seq} {engine} r{rep}: {record.status} {record.summary.get('cycle_mean_ms') or 0:.1f} ms"
                      f" (neighbours busy {100 * watch.busy_fraction:.0f}% of the run)", file=sys.stderr, flush=True)
