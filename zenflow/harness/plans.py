"""A plan of runs, executed the same way by every reproduction: each run in its own child (runner.py), its record
staged (result_sets.py), --resume keeping the ok records of the same runs, Ctrl-C or `kill` stopping cleanly, and
the report written where the records are (the result set when complete, `.partial/` otherwise)."""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zenflow.harness.cli import refuse
from zenflow.harness.deadline import Deadline
from zenflow.harness.records import RunRecord, read_records, steps_seconds
from zenflow.harness.result_sets import StagedPlan
from zenflow.harness.runner import run_in_subprocess
from zenflow.harness.session import RunSpec, failed_record

Report = Callable[[list[RunRecord], Path], Any]


@dataclass
class PlannedRun:
    name: str  # the record's file name
    spec: RunSpec
    protocol: dict[str, Any] = field(default_factory=dict)  # what --resume must also find in a record to keep it
    skip: str | None = None  # why this run cannot run here (the memory plan's verdict): a skipped record, no child
    estimate_s: float | None = None  # the memory plan's rough seconds for the whole run (a Deadline reads it)


class BadInput(Exception):
    """A run child found bad input (a missing split, a model without a head): not a run, no record."""


def report_existing(out: Path, report: Report) -> str | None:
    """--report-only: remake the report from the records in `out`; the problem in one line, or None."""
    records = read_records(out) if out.is_dir() else []
    if not records:
        return f"argument --report-only: no run records in {str(out)!r}: expected the --out of a run"
    report(records, out)
    return None


def execute(out: Path, plan: list[PlannedRun], command: str, report: Report, resume: bool = False,
            bad_input: tuple[str, ...] = (), until: float | None = None) -> int:
    """Run the plan; exit status 0 (every run ok or skipped: the records now form `out`'s result set), 1 (failed
    runs: `out` as it was, records and report in `.partial/`), 2 (bad input found by a child) or 130 (interrupted;
    --resume continues). `until` (a time.time()): a run starts only when its estimate, corrected by the runs done, ends
    before it; the others get a skipped "out of time" record (deadline.py)."""
    staged = StagedPlan(out, [run.name for run in plan], command=command)
    deadline = None if until is None else Deadline(until, {run.name: run.estimate_s for run in plan if run.estimate_s})
    previous = signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops the current child too, as Ctrl-C does
    try:
        records = [_run_one(staged, run, i, len(plan), resume, bad_input, deadline) for i, run in enumerate(plan)]
    except KeyboardInterrupt:
        staged.stop()
        print(f"interrupted: {out} is as it was; the records so far are in {staged.stage} (its PARTIAL file lists "
              "the rest); --resume continues", file=sys.stderr)
        return 130
    except BadInput as exc:
        return refuse(str(exc))
    finally:
        signal.signal(signal.SIGTERM, previous)
    complete = staged.finish()
    if staged.carried:  # not this plan's runs: say where they went, the report below covers this plan only
        print(f"also moved into {out}: {', '.join(staged.carried)} (ok or skipped records an earlier plan left in "
              f"{staged.stage}; --report-only tables every record there)", file=sys.stderr)
    report(records, out if complete else staged.stage)
    if not complete:
        print(f"failed runs: {out} is as it was; this plan's records and report are in {staged.stage}; --resume "
              "reruns the failed runs", file=sys.stderr)
    return 0 if complete else 1


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _run_one(staged: StagedPlan, run: PlannedRun, i: int, n: int, resume: bool,
             bad_input: tuple[str, ...], deadline: Deadline | None = None) -> RunRecord:
    kept = staged.reuse(run.name, run.spec, run.protocol) if resume else None
    print(f"[{i + 1}/{n}] {run.name}{' (kept: --resume)' if kept else ''}", file=sys.stderr, flush=True)
    if kept:
        return kept
    start = time.perf_counter()
    skip = run.skip or (deadline.refusal(run.name) if deadline else None)
    if skip:  # known not to fit, or not in the time left: say so in seconds instead of a child dying later
        failed_record(run.spec, skip, status="skipped").write(staged.path(run.name))
        record = RunRecord.read(staged.path(run.name))
    else:
        limit = deadline.run_limit(run.name) if deadline else None  # a stuck run costs its own time only
        record = run_in_subprocess(run.spec, staged.path(run.name), **({"timeout_s": limit} if deadline else {}))
        cut = deadline.stopped(run.name, limit) if deadline and _timed_out(record) else None
        if cut:  # stopped by the deadline, not stuck: out of time, as a run not started
            failed_record(run.spec, cut, status="skipped").write(staged.path(run.name))
            record = RunRecord.read(staged.path(run.name))
    lines = (record.error or "").splitlines()
    found = next((line for line in lines if line.startswith(bad_input)), None) if bad_input else None
    if record.status != "ok" and found:
        staged.abandon(run.name)  # bad input, not a failed run: no record
        raise BadInput(found.split(": ", 1)[1])
    record.metrics["wall_seconds"] = time.perf_counter() - start
    if record.steps:  # what a run costs besides its steps (process start, imports, model build, set-up): budgets
        record.metrics["fixed_seconds"] = record.metrics["wall_seconds"] - steps_seconds(record)
    if deadline and not skip:
        deadline.observe(run.name, record.metrics["wall_seconds"])
    record.write(staged.path(run.name))
    staged.done(run.name, record)
    print(f"  {_outcome(record)} ({record.metrics['wall_seconds']:.0f} s)", file=sys.stderr, flush=True)
    return record


def _timed_out(record: RunRecord) -> bool:
    """Whether run_in_subprocess stopped the run at its time limit."""
    return record.status == "failed" and (record.error or "").startswith("timeout after")


def _outcome(record: RunRecord) -> str:
    if record.status != "ok":
        word = "SKIPPED" if record.status == "skipped" else "FAILED"
        return f"{word}: {record.error.strip().splitlines()[-1] if record.error else '?'}"
    if record.metrics.get("score") is not None:
        return f"ok, score {record.metrics['score']:.1f}"
    cycle = record.summary.get("cycle_mean_ms")
    return f"ok, {cycle:.1f} ms per step" if cycle else "ok"
