"""The knobs study's figures (zenflow/reports/knobs.py), from its rows and the runs' step records only.

- frontier.png: per workload (columns) and target (rows), each setting's time to target relative to ref-offload's
  (paired by seed, 95% interval)
  against its step time (95% interval): one point per setting, "auto" settings as stars; a setting that missed the
  target with some seed sits on the top edge as a cross, labelled with how often it got there.
- auto-intervals.png: per workload, the steps between host updates each "auto" run chose, at the step each boundary
  fell, one line per seed; the steps that selected columns are ticks along the bottom.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zenflow.harness.tables import pyplot, save_figure

Trace = tuple[int, list[tuple[int, int]], list[int]]  # seed, (step, interval) at each boundary, selection steps


def frontier_figure(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    plt = pyplot()
    workloads = list(dict.fromkeys(r["workload"] for r in rows)) or [""]
    targets = list(dict.fromkeys(r.get("target", "") for r in rows)) or [""]
    fig, axes = plt.subplots(len(targets), len(workloads), figsize=(6.4 * len(workloads), 4.6 * len(targets)),
                             squeeze=False)
    for ax, (target, workload) in zip(axes.flat, [(t, w) for t in targets for w in workloads]):
        mine = [r for r in rows if r["workload"] == workload and r.get("target", "") == target
                and r["step_ms"] is not None]
        top = max([r["relative_time_high"] or r["relative_time"] for r in mine if r["relative_time"]] or [1.0]) * 1.15
        for i, r in enumerate(mine):
            color, marker = f"C{i % 10}", "*" if r["auto"] else "o"
            x, xerr = r["step_ms"], _err(r["step_ms"], r["step_ms_low"], r["step_ms_high"])
            if r["relative_time"] is None:  # missed the target with some seed: no ratio to place
                ax.plot([x], [top], marker="x", color=color, ms=9, ls="none",
                        label=f"{r['setting']}: reached {r['reached']} of {r['compared']}")
                continue
            yerr = _err(r["relative_time"], r["relative_time_low"], r["relative_time_high"])
            ax.errorbar([x], [r["relative_time"]], xerr=xerr, yerr=yerr, marker=marker, ms=11 if r["auto"] else 7,
                        color=color, ls="none", capsize=3, label=r["setting"])
        ax.axhline(1.0, color="0.5", lw=0.8, ls="--")
        ax.set(xlabel="step time, ms (95% interval)", ylabel="time to target / ref-offload's (paired, 95%)",
               title=f"{workload}, target: {target}" if target else workload)
        ax.spines[["top", "right"]].set_visible(False)
        ax.legend(fontsize=6.5, frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path)


def _err(center: float, low: float | None, high: float | None) -> list[list[float]] | None:
    if low is None or high is None:
        return None
    return [[center - low], [high - center]]


def intervals_figure(traces: dict[str, dict[str, list[Trace]]], path: Path, title: str) -> None:
    plt = pyplot()
    workloads = list(traces) or ["(no records)"]
    fig, axes = plt.subplots(1, len(workloads), figsize=(7.4 * len(workloads), 4.0), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        drawn = 0
        for i, (setting, runs) in enumerate((traces.get(workload) or {}).items()):
            for j, (seed, boundaries, selected) in enumerate(runs):
                if not boundaries and not selected:
                    continue
                label = f"{setting}, seed {seed}"
                # "pre": each interval spans the steps that led up to the boundary that closed it
                ax.step([s for s, _ in boundaries], [u for _, u in boundaries], where="pre", marker="o", ms=3,
                        color=f"C{i % 10}", alpha=1.0 if j == 0 else 0.5, lw=1.2, label=label)
                ax.plot(selected, [0] * len(selected), marker="|", ms=12, ls="none", color=f"C{i % 10}")
                drawn += 1
        if not drawn:  # DeepSpeed's runs, or records written before steps named their decisions
            ax.text(0.5, 0.5, "no per-step boundaries in these records", ha="center", va="center",
                    transform=ax.transAxes, fontsize=9, color="0.4")
        ax.set(xlabel="step", ylabel="steps since the previous host update", title=workload)
        ax.set_ylim(bottom=-0.5)
        ax.spines[["top", "right"]].set_visible(False)
        if drawn:
            ax.legend(fontsize=6.5, frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(title + "  (ticks at 0: selections)", fontsize=10)
    save_figure(fig, path)
