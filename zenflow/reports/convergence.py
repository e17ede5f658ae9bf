"""Loss against wall-clock time: a faster step that needs more steps to reach the same loss is not the
same win. From the records' per-step losses and periods only:

- the target is the final smoothed loss of the every-step ZeRO-Offload run (ds-zero-offload, else ref-offload) in
  the same round (`--repeats`: one seed per round, shared by its engines): the mean loss of its last `window` steps,
  a fifth of its run (4 to MAX_WINDOW: micro-batch 1 losses swing by a unit from one Alpaca record to the next, and
  a short window makes the target one lucky stretch of records);
- an engine's time to target is the training wall time (the sum of its step periods, warm-up included) until its
  smoothed loss (the trailing mean over the same window) first reaches the target, or "not reached";
- the loss at equal wall time is each engine's smoothed loss after the shortest run's total time;
- the time-to-loss speedup (target time of the baseline / the engine's) stands beside the step-time speedup, so a
  reader sees how much of the latter survives; over several rounds both are paired by round, with their 95%
  interval (intervals.py), and an engine that misses the target in any round gets no time-to-loss speedup.

Within a round every engine trains on the same batches from the same weights, so the curves are comparable step for
step.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from zenflow.harness.records import RunRecord
from zenflow.harness.tables import fmt, markdown, pyplot, save_figure, write_csv, write_text_atomic
from zenflow.reports.intervals import Interval, columns, ratio_cell, row_interval, target_speedup

MAX_WINDOW = 32  # steps in the smoothing window at most: 8 update cycles at U = 4
BASELINES = ("ds-zero-offload", "ref-offload")  # the every-step ZeRO-Offload run that sets the target


def window_for(steps: int) -> int:
    """The smoothing window of a comparison whose baseline ran `steps` steps: a fifth of them, 4 to MAX_WINDOW."""
    return max(4, min(MAX_WINDOW, steps // 5))


def curve(record: RunRecord, window: int) -> list[tuple[float, float]]:
    """(seconds of training so far, smoothed loss) after each step with a full window."""
    out, elapsed, losses = [], 0.0, []
    for step in record.steps:
        elapsed += (step.get("period_ms") or 0.0) / 1e3
        losses.append(step["loss"])
        if len(losses) >= window:
            out.append((elapsed, statistics.fmean(losses[-window:])))
    return out


def time_to(points: list[tuple[float, float]], target: float) -> float | None:
    """The first time the smoothed loss is at or below `target`, or None."""
    return next((t for t, loss in points if loss <= target), None)


def loss_at(points: list[tuple[float, float]], seconds: float) -> float | None:
    """The smoothed loss of the last point at or before `seconds`."""
    before = [loss for t, loss in points if t <= seconds * (1 + 1e-9)]  # summed periods: rounding
    return before[-1] if before else None


def convergence_rows(records: list[RunRecord], step_speedup: dict[str, Interval | None]) -> tuple[list[dict], dict]:
    """Per engine over its runs, and the facts of the comparison: baseline, targets by repeat, equal time, window
    and every run's curve by engine and repeat (what the figure draws). Round r's target is the baseline's final
    smoothed loss in round r: the runs of a round share a seed (weights and data order), so each round is its own
    comparison, and the speedups are paired by round (intervals.target_speedup)."""
    usable = [r for r in records if r.status == "ok" and r.protocol.get("telemetry", True)]
    baseline = next((b for b in BASELINES if any(r.engine == b for r in usable)), None)
    if baseline is None:
        return [], {"baseline": None}
    window = window_for(min(len(r.steps) for r in usable if r.engine == baseline))
    runs: dict[str, dict[int, list[tuple[float, float]]]] = {}
    for r in usable:
        if len(r.steps) >= window:
            runs.setdefault(r.engine, {})[int(r.protocol.get("repeat", 0))] = curve(r, window)
    targets = {rep: c[-1][1] for rep, c in runs[baseline].items()}
    base_times = {rep: time_to(c, targets[rep]) for rep, c in runs[baseline].items()}  # its own final: reached
    equal = min(c[-1][0] for curves in runs.values() for c in curves.values())
    rows = []
    for engine, curves in runs.items():
        times = {rep: time_to(c, targets[rep]) for rep, c in curves.items() if rep in targets}
        reached = [t for t in times.values() if t is not None]
        at_equal = [v for c in curves.values() if (v := loss_at(c, equal)) is not None]
        rows.append({"engine": engine, "runs": len(curves),
                     "final_smoothed_loss": statistics.median(c[-1][1] for c in curves.values()),
                     "time_to_target_s": statistics.median(reached) if times and len(reached) == len(times) else None,
                     "reached": len(reached), "compared": len(times),
                     "loss_at_equal_time": statistics.median(at_equal) if at_equal else None,
                     **columns("step_time_speedup", step_speedup.get(engine)),
                     **columns("time_to_loss_speedup", target_speedup(base_times, times))})  # type: ignore[arg-type]
    return rows, {"baseline": baseline, "targets": targets, "target": statistics.median(targets.values()),
                  "equal_time_s": equal, "window": window, "curves": runs}


def reached_cell(row: dict[str, Any], runs: str = "in {missed} of {compared} rounds") -> str:
    """Time to target: the median over the runs when every run reached it, else how many missed it (`runs` names
    them: rounds here, seeds for GLUE)."""
    if row["time_to_target_s"] is not None:
        return f"{row['time_to_target_s']:.1f}"
    said = runs.format(missed=row["compared"] - row["reached"], compared=row["compared"])
    return "not reached" + (f" (missed {said})" if row["reached"] else "")


def convergence_report(records: list[RunRecord], rows_by_engine: dict[str, dict[str, Any]], out: Path,
                       title: str) -> str | None:
    """convergence.md/.csv and loss-vs-time.png in `out`; None (nothing written) without a baseline run."""
    speedups = {e: row_interval(r, "speedup") for e, r in rows_by_engine.items()}
    rows, facts = convergence_rows(records, speedups)
    if not rows:
        return None
    order = list(rows_by_engine)
    rows.sort(key=lambda r: order.index(r["engine"]) if r["engine"] in order else len(order))
    body = [[r["engine"], r["runs"], fmt(r["final_smoothed_loss"], ".3f"), reached_cell(r),
             fmt(r["loss_at_equal_time"], ".3f"),
             *(["1.00× (baseline)"] * 2 if r["engine"] == facts["baseline"] else
               [ratio_cell(row_interval(r, "step_time_speedup")), ratio_cell(row_interval(r, "time_to_loss_speedup"))])]
            for r in rows]
    rounds = len(facts["targets"])
    text = "\n".join([
        f"# Loss against wall-clock time — {title}", "",
        f"Target: {facts['baseline']}'s final smoothed loss in the same round (the mean of its last "
        f"{facts['window']} steps; every engine's loss is smoothed the same way): "
        + (f"{facts['target']:.3f}" if rounds == 1 else
           f"median {facts['target']:.3f} over {rounds} rounds, one seed each (weights and data order)")
        + ". Time: the sum of the step periods, warm-up included; equal time: "
        f"{facts['equal_time_s']:.1f} s, the shortest run. Medians of the runs; speedups are geometric means of the "
        "ratios paired by round with their 95% interval (\"no difference\" where it includes 1).", "",
        markdown(body, ["engine", "runs", "final smoothed loss", "time to target s", "loss at equal time",
                        "step-time speedup", "time-to-loss speedup"]), "",
        "- The time-to-loss speedup is the baseline's time to its own final loss over the engine's, round by round; "
        "beside the step-time speedup it shows how much of a faster step survives once the steps' worth is counted. "
        "An engine that misses the target in any round gets none: a speedup over only the rounds that made it "
        "would hide the others.",
        "- A short run (the default scenario) barely separates the curves; `--convergence` trains long enough "
        "for them to (reproduce/llama7b.py)."])
    write_text_atomic(out / "convergence.md", text + "\n")
    write_csv(rows, out / "convergence.csv")
    _figure(out / "loss-vs-time.png", title, facts)
    return text


def _figure(path: Path, title: str, facts: dict[str, Any]) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9.5, 4.6))
    for i, (engine, curves) in enumerate(facts["curves"].items()):
        for j, points in enumerate(curves.values()):  # every round, one color per engine
            ax.plot([t for t, _ in points], [loss for _, loss in points], color=f"C{i % 10}", lw=1.0,
                    alpha=0.8 if len(curves) > 1 else 1.0, label=engine if j == 0 else None)
    median = " (median over rounds)" if len(facts["targets"]) > 1 else ""
    ax.axhline(facts["target"], color="black", lw=0.8, ls="--", label=f"target: {facts['baseline']}'s final{median}")
    ax.set(xlabel="training wall time, s", ylabel=f"loss (mean of the last {facts['window']} steps)",
           title=f"Loss against wall-clock time\n{title}")
    ax.legend(fontsize=7, frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: no curve hidden
    save_figure(fig, path)
