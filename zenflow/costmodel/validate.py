"""Validation: the cost model's predictions against cpu-scale run records of the same machine and day.

Our engines are predicted from the calibration alone (no end-to-end run is fitted); DeepSpeed on the CPU accelerator
gets constants of its own, fitted on the sequence-16 records and tested at the other sequences.

Two sets of runs can be validated against: the full validation (`validation/seqN/`, seq 16 from
`results/llama7b/<hw>/` where it has none: 2 runs per point, ≈30 min) and the same-day sample that `make project`
takes after calibrating (`validation-sample/seqN/`: 1 run per point). This VM's speed changes between days, so a
calibration is compared only with runs taken within MAX_AGE_H of it (`dating`); records and calibrations carry the
time they were taken (`taken_at`), and those made before they did are dated from git.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timezone
from pathlib import Path
from typing import Any

from zenflow.costmodel.model import Block, Inputs, Prediction, predict
from zenflow.costmodel.presets import cpu_scale_inputs
from zenflow.harness.configs import DEEPSPEED_EXAMPLES_BLOCK
from zenflow.harness.engines.build import deepspeed_config
from zenflow.harness.engines.registry import engine_spec, is_deepspeed
from zenflow.harness.records import RunRecord, read_records, steps_seconds
from zenflow.harness.result_sets import COMPLETE, MARKER
from zenflow.harness.runner import run_in_subprocess
from zenflow.harness.session import RunSpec
from zenflow.harness.when import Span, committed, span_of, taken, utc_now
from zenflow.telemetry.neighbours import NeighbourWatch, wait_until_quiet

ROOT = Path(__file__).resolve().parents[2]
# The ZenFlow block of every run and projection (DeepSpeedExamples' settings), in the cost model's terms.
BLOCK = Block(DEEPSPEED_EXAMPLES_BLOCK["topk_ratio"], DEEPSPEED_EXAMPLES_BLOCK["update_interval"],
              DEEPSPEED_EXAMPLES_BLOCK["overlap_step"])
SEQ16 = "results/llama7b/{hw}"  # the committed seq-16 scenario is the middle validation point
EXTRA_SEQS = (4, 64, 256)  # with seq 16: host optimizer / compute of ref-offload from ~1.2 down to ~0.6 on this CPU
QUIET = 0.2  # a run is "quiet" when other heavy jobs ran during less than this fraction of it
VALIDATED = ("ds-zero-offload", "ds-zenflow", "ref-offload", "ref-zenflow", "ref-offload-gas", "no-offload")
# The same-day sample: the points of the verdict's count ("N of 15": our three engines at these five sequences) and
# the DeepSpeed engines, whose constants are fitted at seq 16 of the same sample. ref-offload-gas (VALIDATED where it
# was run) is left out: it is not among the committed count's points and would change what the count is out of.
SAMPLE = "validation-sample"
SAMPLE_ENGINES = ("no-offload", "ref-offload", "ref-zenflow", "ds-zero-offload", "ds-zenflow")
VERDICT_SEQS = (4, 16, 64, 256, 512)
SAMPLE_REPEATS = 1
SAMPLE_BUDGET_S = 15 * 60  # what `make project` may spend on the sample on this 2-core machine
MAX_AGE_H = 12.0  # a calibration validates only against runs taken within this many hours of it, either way
RUNS = ("sample", "full")  # which runs a validation compares with
SUMMARY_KEYS = ("cycle_mean_ms", "accumulate_step_ms", "update_step_ms", "compute_ms", "io_ms", "stall_ms",
                "forward_backward_ms")


def record_sets(hw: str, root: Path = ROOT, runs: str = "full") -> dict[int, Path]:
    """Sequence length -> folder of run records. "full": seq 16 from results/llama7b/<hw>/ unless validation/seq16/
    exists, the rest from validation/seqN/; "sample": every sequence from validation-sample/seqN/."""
    if runs not in RUNS:
        raise ValueError(f"runs {runs!r}: one of {RUNS}")
    folders = {16: root / SEQ16.format(hw=hw)} if runs == "full" else {}
    extra = root / "results" / "costmodel" / hw / ("validation" if runs == "full" else SAMPLE)
    if extra.exists():  # every seqN folder present, not only the default sequences
        folders.update({int(f.name[3:]): f for f in extra.glob("seq*") if f.name[3:].isdigit()})
    return {s: f for s, f in sorted(folders.items()) if f.exists()}


def runs_source(hw: str, root: Path = ROOT, runs: str = "full") -> str:
    sets = record_sets(hw, root, runs)
    if runs == "sample":
        return f"the same-day sample, `{SAMPLE}/seqN/` for every sequence"
    if 16 in sets and sets[16] == root / SEQ16.format(hw=hw):
        return f"seq 16 from `results/llama7b/{hw}/`, the others from `validation/seqN/`"
    return "`validation/seqN/` for every sequence"


def measured(folder: Path, placement: str = "shared") -> dict[str, dict[str, float]]:
    """`summarize` of a folder's runs at one placement (the model's inputs differ by placement: presets.INPUTS)."""
    return summarize([r for r in read_records(folder) if r.protocol.get("placement", "shared") == placement])


def summarize(records: list[RunRecord]) -> dict[str, dict[str, float]]:
    """Per engine, medians over its runs of the summary values (runs without telemetry excluded; runs on a quiet
    machine when there are any)."""
    out: dict[str, dict[str, float]] = {}
    runs = [r for r in records if r.status == "ok" and r.protocol.get("telemetry", True)]
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


def deepspeed_constants(cal: dict[str, Any], at: dict[str, dict[str, float]], seq: int = 16,
                        inputs: Callable[[dict[str, Any], int], Inputs] = cpu_scale_inputs) -> dict[str, float]:
    """DeepSpeed on the CPU accelerator needs its own constants, fitted on one point's records only (`at`, sequence
    `seq`): its forward+backward overhead over plain torch (hooks, bucket copies), its step (CPU Adam + copies), and
    its ZenFlow's extra time on accumulation and update steps (ds-zenflow's, or ds-zenflow-intended's where the
    point has no ds-zenflow). The other points then test them."""
    fb = inputs(cal, seq).fb_ms
    off = at.get("ds-zero-offload")
    zen = at.get("ds-zenflow") or at.get("ds-zenflow-intended")
    k = {}
    if off:
        k["ds_fb_overhead_ms"] = off["forward_backward_ms"] - fb
        k["ds_step_ms"] = off["stall_ms"]
    if zen and off:
        k["dsz_accumulate_extra_ms"] = zen["accumulate_step_ms"] - fb - k["ds_fb_overhead_ms"]
        k["dsz_update_extra_ms"] = zen["update_step_ms"] - fb - k["ds_fb_overhead_ms"]
        k["dsz_stall_ms"] = zen["stall_ms"]  # its engine.step() wall time per step, the same measure as measured
    return k


def predict_engine(engine: str, x: Inputs, ds: dict[str, float]) -> Prediction | None:
    modelled_as = engine_spec(engine).modelled_as  # the cost model's engine that describes it (its registry row)
    if modelled_as:
        return predict(x, modelled_as, BLOCK)
    fb = x.fb_ms + ds.get("ds_fb_overhead_ms", float("nan"))
    if engine == "ds-zero-offload" and "ds_step_ms" in ds:
        t = fb + ds["ds_step_ms"]
        return Prediction(engine, None, t, t, fb, 0.0, ds["ds_step_ms"], 2 * x.column_params * x.dtype_bytes)
    if engine in ("ds-zenflow", "ds-zenflow-intended") and "dsz_update_extra_ms" in ds:
        acc, upd = fb + ds["dsz_accumulate_extra_ms"], fb + ds["dsz_update_extra_ms"]
        cycle = (3 * acc + upd) / 4
        stall = ds["dsz_stall_ms"]
        return Prediction(engine, acc, upd, cycle, cycle - stall, 0.0, stall, float("nan"))
    return None


def validation(cal: dict[str, Any], hw: str, root: Path = ROOT, runs: str = "full") -> list[dict[str, Any]]:
    """One row per (sequence, engine) with records: measured and predicted cycle, accumulate, update, stall."""
    return compare(cal, {s: measured(f) for s, f in record_sets(hw, root, runs).items()})


def compare(cal: dict[str, Any], sets: dict[int, dict[str, dict[str, float]]],
            inputs: Callable[[dict[str, Any], int], Inputs] = cpu_scale_inputs,
            engines: tuple[str, ...] = VALIDATED, fitted_at: int = 16) -> list[dict[str, Any]]:
    """One row per (sequence, engine) of `sets` (sequence -> `summarize`d runs) among `engines`, predicted from the
    calibration alone through `inputs` (the placement's: presets.INPUTS), DeepSpeed fitted at `fitted_at`."""
    ds = deepspeed_constants(cal, sets.get(fitted_at, {}), fitted_at, inputs)
    rows = []
    for seq, found in sets.items():
        x = inputs(cal, seq)
        off = found.get("ref-offload")
        ratio = (off["stall_ms"] + off["io_ms"]) / off["compute_ms"] if off else None
        for engine in engines:
            m, p = found.get(engine), predict_engine(engine, x, ds)
            if not m or not p:
                continue
            rows.append({"seq": seq, "opt_to_compute_measured": ratio, "engine": engine, "runs": m["runs"],
                         "measured_cycle_ms": m["cycle_mean_ms"], "predicted_cycle_ms": p.cycle_ms,
                         "error_pct": 100 * (p.cycle_ms / m["cycle_mean_ms"] - 1),
                         "measured_accumulate_ms": m["accumulate_step_ms"], "predicted_accumulate_ms": p.accumulate_ms,
                         "measured_update_ms": m["update_step_ms"], "predicted_update_ms": p.update_ms,
                         "measured_stall_ms": m["stall_ms"], "predicted_stall_ms": p.stall_ms,
                         "fitted_here": is_deepspeed(engine) and seq == fitted_at,
                         "neighbours_busy": m["neighbours"]})
    return rows


def plan(engines: list[str] | tuple[str, ...], repeats: int, seqs: tuple[int, ...]) -> list[tuple[int, int, str]]:
    """(repeat, sequence, engine) in the order a sitting runs them: each repeat goes through every sequence, each
    sequence through every engine, so a slow spell of the machine lands on several points, not on one point's runs."""
    return [(rep, seq, engine) for rep in range(repeats) for seq in seqs for engine in engines]


def run_validation(folder: Path, engines: list[str] | tuple[str, ...], repeats: int,
                   seqs: tuple[int, ...] = EXTRA_SEQS, max_wait_s: float = 90, replace: bool = False,
                   run: Callable[[RunSpec, Path], RunRecord] = run_in_subprocess) -> bool:
    """The cpu-scale runs of `plan`, one fresh run child each (the harness runner `run`), each started when no
    neighbour's heavy job runs (waits up to max_wait_s); each record notes when it was taken and whether a neighbour
    ran meanwhile. The records are staged in `<folder>.partial/` and reach `folder` only when every run is ok (or
    skipped): `replace` swaps the whole folder for them (the sample: one sitting's set), otherwise they replace the
    records of the same names (the full validation, a subset of sequences at a time). An interrupted or failed
    sitting leaves `folder` as it was. True when published."""
    stage = folder.with_name(folder.name + ".partial")
    shutil.rmtree(stage, ignore_errors=True)  # an earlier, unfinished sitting's runs are not of this sitting
    runs, failed = plan(engines, repeats, seqs), []
    _mark(stage, folder, 0, len(runs), failed)
    for i, (rep, seq, engine) in enumerate(runs):
        wait_until_quiet(max_wait_s, poll_s=2)
        path = stage / f"seq{seq}" / f"{engine}-r{rep}.json"
        cfg = deepspeed_config(engine, DEEPSPEED_EXAMPLES_BLOCK, "bf16", 1, lr=2e-5, weight_decay=0.01,
                               clipping=1.0, cuda=False)
        spec = RunSpec(engine=engine, label="costmodel-validation", ds_config=cfg,
                       workload={"model": "cpu-scale", "dtype": "bf16", "seq_len": seq, "micro_batch": 1},
                       extra={"repeat": rep}, progress=False)
        taken, start = utc_now(), time.perf_counter()
        with NeighbourWatch() as watch:
            record = run(spec, path)
        record.protocol["neighbour_busy_fraction"] = watch.busy_fraction
        record.protocol["taken_at"] = taken
        record.metrics["wall_seconds"] = time.perf_counter() - start
        record.write(path)
        if record.status not in COMPLETE:
            failed.append(f"seq{seq}/{path.name}")
        _mark(stage, folder, i + 1, len(runs), failed)
        print(f"[{i + 1}/{len(runs)}] seq {seq} {engine} r{rep}: {record.status} "
              f"{record.summary.get('cycle_mean_ms') or 0:.1f} ms (neighbours busy {100 * watch.busy_fraction:.0f}% "
              "of the run)", file=sys.stderr, flush=True)
    if failed:
        print(f"failed runs ({', '.join(failed)}): {folder} is as it was; this sitting's records are in {stage}",
              file=sys.stderr)
        return False
    _publish(stage, folder, replace)
    return True


def _mark(stage: Path, folder: Path, done: int, total: int, failed: list[str]) -> None:
    """The stage's PARTIAL file: how far the sitting got (rewritten after every run, so a kill leaves it right)."""
    stage.mkdir(parents=True, exist_ok=True)
    (stage / MARKER).write_text(f"UNFINISHED: {done} of {total} runs of a sitting done, failed: "
                                f"{', '.join(failed) or '-'}. They reach {folder} only when every run is ok; no "
                                "validation reads this folder; the next sitting removes it.\n")


def _publish(stage: Path, folder: Path, replace: bool) -> None:
    (stage / MARKER).unlink()
    if not replace:
        for path in sorted(stage.glob("seq*/*.json")):
            (folder / path.parent.name).mkdir(parents=True, exist_ok=True)
            os.replace(path, folder / path.parent.name / path.name)
        shutil.rmtree(stage)
        return
    old = folder.with_name(folder.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if folder.exists():
        os.replace(folder, old)
    os.replace(stage, folder)  # a reader finds the old set, none, or the new one: never a mix
    shutil.rmtree(old, ignore_errors=True)


def sample_seconds(hw: str, root: Path = ROOT, repeats: int = SAMPLE_REPEATS,
                   engines: tuple[str, ...] = SAMPLE_ENGINES, seqs: tuple[int, ...] = VERDICT_SEQS) -> float:
    """The sample's duration on `hw`, estimated from its committed records: per run, the steps of that (sequence,
    engine)'s committed runs (the sum of their periods, median over the repeats), plus a run child's start-up
    (import, model, engine: the median of wall time less steps over the committed cpu-scale records that note their
    wall time, this machine's where it has any)."""
    steps: dict[tuple[int, str], list[float]] = {}
    for seq, folder in record_sets(hw, root).items():
        for r in read_records(folder):
            steps.setdefault((seq, r.engine), []).append(steps_seconds(r))
    return sum(statistics.median(steps[(seq, engine)]) + _startup_s(hw, root)
               for _, seq, engine in plan(engines, repeats, seqs))


def _startup_s(hw: str, root: Path) -> float:
    def startups(pattern: str) -> list[float]:
        return [r.metrics["wall_seconds"] - steps_seconds(r) for path in sorted(root.glob(pattern))
                for r in read_records(path) if r.status == "ok" and r.metrics.get("wall_seconds")]
    return statistics.median(startups(f"results/llama7b/{hw}") or startups("results/llama7b/*"))


# ---- when runs and calibration were taken -------------------------------------------------------------------
def runs_span(hw: str, root: Path = ROOT, runs: str = "full") -> tuple[Span, bool]:
    """When the runs a validation reads were taken, and whether git had to say (records without `taken_at`)."""
    spans, by_git = [], False
    for folder in record_sets(hw, root, runs).values():
        records = [(p, RunRecord.read(p)) for p in sorted(folder.glob("*.json")) if not p.name.startswith(".")]
        records = [(p, r) for p, r in records
                   if r.engine in VALIDATED and r.status == "ok" and r.protocol.get("telemetry", True)]
        undated = any(not r.protocol.get("taken_at") for _, r in records)
        committed_at = committed(folder) if undated else {}
        by_git |= undated
        spans += [taken(p, r.protocol.get("taken_at"), r.environment, committed_at) for p, r in records]
    return span_of(spans), by_git


def calibration_span(cal: dict[str, Any], path: Path) -> tuple[Span, bool]:
    """When the calibration at `path` was taken, and whether git had to say."""
    stamp = cal.get("taken_at")
    return taken(path, stamp, cal.get("environment", {}), {} if stamp else committed(path.parent)), not stamp


def apart_h(a: Span, b: Span) -> float | None:
    """The longest time between a moment of span `a` and one of `b`, in hours (None when either is unknown)."""
    if None in a or None in b:
        return None
    return max((a[1] - b[0]).total_seconds(), (b[1] - a[0]).total_seconds(), 0.0) / 3600


def dating(cal_span: tuple[Span, bool], run_span: tuple[Span, bool], runs: str) -> dict[str, Any]:
    """What a validation table states about its age: when the runs and the calibration were taken (ISO, UTC), how
    far apart at most, the bound, and whether it is exceeded (unknown counts as exceeded)."""
    (cal, cal_git), (ran, ran_git) = cal_span, run_span
    apart = apart_h(cal, ran)

    def iso(s: Span) -> list[str | None]:
        return [t.astimezone(timezone.utc).isoformat(timespec="seconds") if t else None for t in s]
    return {"runs": runs, "runs_taken": iso(ran), "calibration_taken": iso(cal),
            "apart_h": None if apart is None else round(apart, 2), "bound_h": MAX_AGE_H,
            "over_bound": apart is None or apart > MAX_AGE_H, "dated_by_git": cal_git or ran_git}


def validation_dating(cal: dict[str, Any], hw: str, root: Path = ROOT, runs: str = "full") -> dict[str, Any]:
    """`dating` of the calibration record of `hw` under `root` (`cal`, as loaded) and the runs it is validated
    against."""
    path = root / "results" / "costmodel" / hw / "calibration.json"
    return dating(calibration_span(cal, path), runs_span(hw, root, runs), runs)
