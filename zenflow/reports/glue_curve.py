"""GLUE accuracy against training time (issue 24): the dev score each run recorded every `--eval-every` steps
(record.metrics["curve"]: step, training seconds so far, score), read from the records only.

Per task and engine, the points are averaged over seeds (they share step numbers). The target is the final score of
the every-step ZeRO-Offload run (ds-zero-offload, else ref-offload); an engine's time to target is the training time
of its first point at or above it, or "not reached"; its time-to-accuracy speedup is the baseline's time to target
over its own, beside its step-time speedup (the baseline's total training time over its own). Training time counts
the steps only: the evaluations between them cost none of it.

    curve.md / curve.csv   one row per (task, engine)
    accuracy-vs-time.png   one panel per task: score against training seconds, the target dashed
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from zenflow.harness.records import RunRecord
from zenflow.harness.tables import fmt, markdown, pyplot, save_figure, write_csv, write_text_atomic
from zenflow.reports.convergence import BASELINES  # the every-step ZeRO-Offload run the target comes from

COLUMNS = ("task", "engine", "seeds", "points", "final score", "training s", "target", "time to target s",
           "step-time speedup", "time-to-accuracy speedup")


def curves(records: list[RunRecord]) -> dict[tuple[str, str], list[dict[str, float]]]:
    """(task, engine) -> its points averaged over seeds: step, train_s, score (in step order)."""
    by_key: dict[tuple[str, str], dict[int, list[dict[str, float]]]] = {}
    for r in records:
        points = r.metrics.get("curve") if r.status == "ok" else None
        if points:
            key = (r.metrics.get("task") or r.workload.get("task"), r.engine)
            for p in points:
                by_key.setdefault(key, {}).setdefault(int(p["step"]), []).append(p)
    return {key: [{"step": step, "train_s": statistics.fmean(p["train_s"] for p in ps),
                   "score": statistics.fmean(p["score"] for p in ps), "seeds": len(ps)}
                  for step, ps in sorted(steps.items())]
            for key, steps in by_key.items()}


def time_to(points: list[dict[str, float]], target: float) -> float | None:
    """Training seconds at the first point whose score reaches `target`, or None."""
    return next((p["train_s"] for p in points if p["score"] >= target), None)


def curve_rows(records: list[RunRecord]) -> list[dict[str, Any]]:
    found = curves(records)
    rows = []
    for task in sorted({task for task, _ in found}):
        base = next((e for e in BASELINES if (task, e) in found), None)
        base_points = found.get((task, base), [])
        target = base_points[-1]["score"] if base_points else None
        base_time = time_to(base_points, target) if target is not None else None
        for (t, engine), points in sorted(found.items()):
            if t != task:
                continue
            reach = time_to(points, target) if target is not None else None
            rows.append({"task": task, "engine": engine, "seeds": points[-1]["seeds"], "points": len(points),
                         "final_score": points[-1]["score"], "train_s": points[-1]["train_s"], "baseline": base,
                         "target": target, "time_to_target_s": reach,
                         "step_time_speedup": base_points[-1]["train_s"] / points[-1]["train_s"] if base else None,
                         "time_to_accuracy_speedup": base_time / reach if base_time and reach else None})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    body = [[r["task"], r["engine"], r["seeds"], r["points"], fmt(r["final_score"], ".1f"), fmt(r["train_s"], ".1f"),
             fmt(r["target"], ".1f"), fmt(r["time_to_target_s"], ".1f", missing="not reached"),
             fmt(r["step_time_speedup"], ".2f", suffix="×"), fmt(r["time_to_accuracy_speedup"], ".2f", suffix="×")]
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
            "host update in flight runs on during one, uncounted); averaged over seeds. Target: the final score of "
            "ds-zero-offload (else ref-offload). Speedups over that baseline: step time (its total training time "
            "over the engine's) and time to the target accuracy.", "", table(rows), ""]
    write_text_atomic(out / "curve.md", "\n".join(text))
    write_csv(rows, out / "curve.csv")
    figure(curves(records), rows, out / "accuracy-vs-time.png", f"GLUE accuracy against training time — {label}")
    return text
