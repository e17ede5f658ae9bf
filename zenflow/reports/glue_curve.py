"""GLUE accuracy against training time: the dev score each run recorded every `--eval-every` steps
(record.metrics["curve"]: step, training seconds so far, score), read from the records only.

Per task, engine and seed, the target is the final score of the every-step ZeRO-Offload run (ds-zero-offload, else
ref-offload) with the same seed (same weights and data order); an engine's time to target is the training time of its
first point at or above it, or "not reached"; its time-to-accuracy speedup is the baseline's time to target over its
own, beside its step-time speedup (the baseline's total training time over its own). Both are paired by seed, as a
geometric mean with its 95% interval over the seeds (intervals.py); an engine that misses the target with any seed
gets no time-to-accuracy speedup. Training time counts the steps only: the evaluations between them cost none of it.
The figure draws the points averaged over seeds (they share step numbers).

    curve.md / curve.csv   one row per (task, engine)
    accuracy-vs-time.png   one panel per task: score against training seconds, the target dashed
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from zenflow.harness.records import RunRecord
from zenflow.harness.tables import fmt, markdown, pyplot, save_figure, write_csv, write_text_atomic
from zenflow.reports.convergence import BASELINES, reached_cell  # BASELINES: where the target comes from
from zenflow.reports.intervals import columns, ratio_cell, ratio_interval, row_interval, target_speedup

COLUMNS = ("task", "engine", "seeds", "points", "final score", "training s", "target", "time to target s",
           "step-time speedup", "time-to-accuracy speedup")


def seed_curves(records: list[RunRecord]) -> dict[tuple[str, str], dict[int, list[dict[str, float]]]]:
    """(task, engine) -> seed -> its points in step order: step, train_s, score."""
    out: dict[tuple[str, str], dict[int, list[dict[str, float]]]] = {}
    for r in records:
        points = r.metrics.get("curve") if r.status == "ok" else None
        if points:
            key = (r.metrics.get("task") or r.workload.get("task"), r.engine)
            out.setdefault(key, {})[int(r.workload.get("seed", 0))] = sorted(points, key=lambda p: p["step"])
    return out


def curves(records: list[RunRecord]) -> dict[tuple[str, str], list[dict[str, float]]]:
    """(task, engine) -> its points averaged over seeds (they share step numbers): step, train_s, score, seeds."""
    out = {}
    for key, by_seed in seed_curves(records).items():
        steps: dict[int, list[dict[str, float]]] = {}
        for points in by_seed.values():
            for p in points:
                steps.setdefault(int(p["step"]), []).append(p)
        out[key] = [{"step": step, "train_s": statistics.fmean(p["train_s"] for p in ps),
                     "score": statistics.fmean(p["score"] for p in ps), "seeds": len(ps)}
                    for step, ps in sorted(steps.items())]
    return out


def time_to(points: list[dict[str, float]], target: float) -> float | None:
    """Training seconds at the first point whose score reaches `target`, or None."""
    return next((p["train_s"] for p in points if p["score"] >= target), None)


def curve_rows(records: list[RunRecord]) -> list[dict[str, Any]]:
    """Per (task, engine): seed s's target is the baseline's final score with seed s (same weights and data order),
    and both speedups are paired by seed (intervals.target_speedup / ratio_interval)."""
    found = seed_curves(records)
    rows = []
    for task in sorted({task for task, _ in found}):
        base = next((e for e in BASELINES if (task, e) in found), None)
        base_runs = found.get((task, base), {})
        targets = {seed: points[-1]["score"] for seed, points in base_runs.items()}
        base_times = {seed: time_to(points, targets[seed]) for seed, points in base_runs.items()}
        base_train = {seed: points[-1]["train_s"] for seed, points in base_runs.items()}
        for (t, engine), by_seed in sorted(found.items()):
            if t != task:
                continue
            times = {seed: time_to(points, targets[seed]) for seed, points in by_seed.items() if seed in targets}
            reached = [x for x in times.values() if x is not None]
            rows.append({"task": task, "engine": engine, "seeds": len(by_seed),
                         "points": statistics.median(len(p) for p in by_seed.values()),
                         "final_score": statistics.fmean(p[-1]["score"] for p in by_seed.values()),
                         "train_s": statistics.median(p[-1]["train_s"] for p in by_seed.values()), "baseline": base,
                         "target": statistics.fmean(targets.values()) if targets else None,
                         "time_to_target_s": statistics.median(reached) if times and len(reached) == len(times)
                         else None, "reached": len(reached), "compared": len(times),
                         **columns("step_time_speedup", ratio_interval(
                             base_train, {s: p[-1]["train_s"] for s, p in by_seed.items()})),
                         **columns("time_to_accuracy_speedup", target_speedup(base_times, times))})  # type: ignore
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    body = [[r["task"], r["engine"], r["seeds"], r["points"], fmt(r["final_score"], ".1f"), fmt(r["train_s"], ".1f"),
             fmt(r["target"], ".1f"), reached_cell(r, "with {missed} of {compared} seeds"),
             *(["1.00× (baseline)"] * 2 if r["engine"] == r["baseline"] else
               [ratio_cell(row_interval(r, "step_time_speedup")),
                ratio_cell(row_interval(r, "time_to_accuracy_speedup"))])]
            for r in rows]
    return markdown(body, COLUMNS)


def figure(found: dict[tuple[str, str], list[dict[str, float]]], rows: list[dict[str, Any]], path: Path,
           title: str) -> None:
    plt = pyplot()
    tasks = sorted({task for task, _ in found})
    fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4.2), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for (t, engine), points in sorted(found.items()):
            if t == task:
                ax.plot([p["train_s"] for p in points], [p["score"] for p in points], marker="o", ms=3, label=engine)
        target = next((r["target"] for r in rows if r["task"] == task and r["target"] is not None), None)
        if target is not None:
            ax.axhline(target, color="0.5", ls="--", lw=1, label="ZeRO-Offload's final score")
        ax.set_title(task, fontsize=10)
        ax.set_xlabel("training time, s (steps only)")
        ax.set_ylabel("dev score")
        ax.spines[["top", "right"]].set_visible(False)
        ax.legend(fontsize=7, frameon=False)
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path)


def curve_report(records: list[RunRecord], out: Path, label: str) -> list[str]:
    """curve.md/.csv and accuracy-vs-time.png in `out` when any record has a curve; the Markdown lines (else [])."""
    rows = curve_rows(records)
    if not rows:
        return []
    text = [f"# GLUE accuracy against training time — {label}", "",
            "Dev score every `--eval-every` steps, between steps (evaluations cost no training time; an overlapped "
            "host update in flight runs on during one, uncounted). Target: the final score of ds-zero-offload (else "
            "ref-offload) with the same seed; the target column is its mean over seeds, the final score the engine's "
            "mean, training s its median. Speedups over that baseline: step time (its total training time over the "
            "engine's) and time to the target accuracy, paired by seed: geometric mean and 95% interval (\"no "
            "difference\" where it includes 1); an engine that misses the target with any seed gets none.", "",
            table(rows), ""]
    write_text_atomic(out / "curve.md", "\n".join(text))
    write_csv(rows, out / "curve.csv")
    figure(curves(records), rows, out / "accuracy-vs-time.png", f"GLUE accuracy against training time — {label}")
    return text
