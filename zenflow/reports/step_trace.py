"""A Llama scenario folder's step-time trace, ZeRO-Offload against ZenFlow, from its records.

DeepSpeedExamples' ZenFlow fine-tuning README shows ZenFlow as a trace: fast accumulation steps, a slower update step
every `update_interval`, both under ZeRO-Offload's every-step update. `scenario_report` calls step_trace_report.

step-trace.png: a panel per engine (ds-zero-offload, ref-offload, each ZenFlow engine by its records' overlap_step:
sync / overlap), a bar per step index up to TRACE_STEPS, the median over the folder's timed runs (whiskers: fastest,
slowest), coloured by the step's kind. Engines without runs in the folder are named in the caption.

step-trace.csv (COLUMNS; another report quotes them, so the names stay), a row per ZenFlow engine and mode:
  engine, mode, runs       the engine, "sync" / "overlap", its timed runs
  accumulate_ms, update_ms median over runs of each run's median accumulate / update step (every timed step)
  update_over_accumulate   each run's update / accumulate, geometric mean over runs; `_low`/`_high`: 95% interval
  offload_engine, _ms      its ZeRO-Offload (ds engines: ds-zero-offload, ours: ref-offload), median step as above
  hidden_share             the share of the host update hidden in the accumulation steps,
                               1 − (update − accumulate) / (offload − accumulate):
                           1: the update step costs no more than an accumulate step; 0: a whole ZeRO-Offload step
                           more; below 0 beyond. Per repeat against the offload run of the same repeat (one seed),
                           the mean; `_low`/`_high`: its 95% t interval; empty where offload ≤ accumulate
  paired_runs, source      the repeats both engines ran; "records", or EXAMPLE_SOURCE
Intervals: intervals.log_interval and mean_interval, empty with one run. The last row (EXAMPLE_ENGINE) holds the
README's numbers: ~700 ms, 2–2.2 s, ~4 s: 3.0× and a hidden share of 1 − (2.1 − 0.7) / (4 − 0.7) ≈ 0.58, its "half".
"""

from __future__ import annotations

import statistics
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from zenflow.harness.engines.registry import ENGINE_SPECS, engine_names, zenflow_engines
from zenflow.harness.records import RunRecord
from zenflow.harness.tables import FIGURE_DPI, fmt, pyplot, save_figure, write_csv
from zenflow.harness.when import runs_day
from zenflow.reports.intervals import columns, log_interval, mean_interval

PNG, CSV = "step-trace.png", "step-trace.csv"
TRACE_STEPS = 32  # the steps drawn at most: 8 update cycles at U 4, still a readable bar each at 1200 px
FIG_WIDTH_IN, PANEL_IN = 9.0, 1.45  # 9 in at FIGURE_DPI 130: 1170 px wide
KIND_COLORS = {"warmup": "#B0B0B0", "accumulate": "#4C72B0", "update": "#C44E52"}
KIND_LABELS = {"warmup": "warm-up", "accumulate": "accumulate (host update deferred)", "update": "update"}
COLUMNS = ("engine", "mode", "runs", "accumulate_ms", "update_ms", "update_over_accumulate",
           "update_over_accumulate_low", "update_over_accumulate_high", "offload_engine", "offload_ms",
           "hidden_share", "hidden_share_low", "hidden_share_high", "paired_runs", "source")

EXAMPLE_ENGINE, EXAMPLE_SOURCE = "deepspeedexamples-readme", "DeepSpeedExamples ZenFlow fine-tuning README, Key Insight"
# "Steps like 5，6 and 7 are accumulation steps where ZenFlow overlaps part of the optimizer step in the background.
#  These steps remain fast (~700ms)."
EXAMPLE_ACCUMULATE_MS = 700.0
# "Step 8 performs the remaining part of optimizer step and updates parameters to the GPU (2–2.2s)." (the midpoint)
EXAMPLE_UPDATE_MS = 2100.0
# "Without ZenFlow, a full update would take nearly 4 seconds, and ZenFlow distributes half of this cost across
#  earlier accumulation steps via asynchronous overlap."
EXAMPLE_OFFLOAD_MS = 4000.0


def hidden_share(accumulate: float, update: float, offload: float) -> float | None:
    """1 − (update − accumulate) / (offload − accumulate); None when offload is no slower than accumulate."""
    return 1 - (update - accumulate) / (offload - accumulate) if offload > accumulate else None


def mode_of(record: RunRecord) -> str | None:
    """"overlap" / "sync" for a ZenFlow engine's run (its config's overlap_step), None for any other engine."""
    spec = ENGINE_SPECS.get(record.engine)
    if not spec or not spec.stall_baseline:
        return None
    block = (record.config.get("zero_optimization") or {}).get("zenflow") or {}
    return "overlap" if block.get("overlap_step") else "sync"


def wanted_engines() -> list[str]:
    """Every ZenFlow engine and its ZeRO-Offload, in table order."""
    names = {n for spec in zenflow_engines() for n in (spec.name, spec.stall_baseline)}
    order = engine_names()
    return sorted(names, key=lambda n: (order.index(n) if n in order else len(order), n))


def group_runs(records: Sequence[RunRecord]) -> dict[tuple[str, str | None], list[RunRecord]]:
    """The timed, ok runs of the wanted engines by (engine, mode), in table order."""
    wanted = wanted_engines()
    groups: dict[tuple[str, str | None], list[RunRecord]] = {}
    for r in records:
        if r.status == "ok" and r.protocol.get("telemetry", True) and r.engine in wanted and r.steps:
            groups.setdefault((r.engine, mode_of(r)), []).append(r)
    return dict(sorted(groups.items(), key=lambda kv: (wanted.index(kv[0][0]), kv[0][1] or "")))


def trace(runs: Sequence[RunRecord], max_steps: int) -> dict[str, list[Any]]:
    """Per step index (up to max_steps): its kind (the runs' most common), the median, fastest and slowest period."""
    out: dict[str, list[Any]] = {"kinds": [], "ms": [], "low": [], "high": []}
    for i in range(min(max_steps, max(len(r.steps) for r in runs))):
        steps = [r.steps[i] for r in runs if i < len(r.steps) and r.steps[i].get("period_ms") is not None]
        if not steps:
            break
        periods = [s["period_ms"] for s in steps]
        out["kinds"].append(statistics.mode(s["kind"] for s in steps))
        out["ms"].append(statistics.median(periods))
        out["low"].append(min(periods))
        out["high"].append(max(periods))
    return out


def by_repeat(runs: Sequence[RunRecord], kind: str) -> dict[int, float]:
    """Each run's median period over its steps of `kind`, by repeat."""
    periods = {int(r.protocol.get("repeat", 0)): [s["period_ms"] for s in r.steps if s["kind"] == kind
                                                  and s.get("period_ms") is not None] for r in runs}
    return {rep: statistics.median(v) for rep, v in periods.items() if v}


def trace_rows(records: Sequence[RunRecord]) -> list[dict[str, Any]]:
    """step-trace.csv's rows (COLUMNS): one per ZenFlow engine and mode, then the README's example."""
    groups = group_runs(records)
    rows = []
    for (engine, mode), runs in groups.items():
        if mode is None:
            continue
        base = ENGINE_SPECS[engine].stall_baseline
        acc, upd = by_repeat(runs, "accumulate"), by_repeat(runs, "update")
        off = by_repeat(groups.get((base, None), []), "update")
        ratio = [upd[k] / acc[k] for k in sorted(set(acc) & set(upd)) if acc[k] > 0]
        paired = sorted(set(acc) & set(upd) & set(off))
        shares = [hidden_share(acc[k], upd[k], off[k]) for k in paired]
        rows.append({"engine": engine, "mode": mode, "runs": len(runs), "accumulate_ms": _median(acc),
                     "update_ms": _median(upd), **columns("update_over_accumulate", log_interval(ratio) if ratio
                                                          else None),
                     "offload_engine": base, "offload_ms": _median(off),
                     **columns("hidden_share", mean_interval(shares) if shares and None not in shares else None),
                     "paired_runs": len(paired), "source": "records"})
    return rows + [example_row()]


def example_row() -> dict[str, Any]:
    """The README's numbers as a row of the same columns (no runs, no intervals)."""
    return {**dict.fromkeys(COLUMNS), "engine": EXAMPLE_ENGINE, "mode": "overlap",
            "accumulate_ms": EXAMPLE_ACCUMULATE_MS, "update_ms": EXAMPLE_UPDATE_MS,
            "update_over_accumulate": EXAMPLE_UPDATE_MS / EXAMPLE_ACCUMULATE_MS, "offload_engine": "ZeRO-Offload",
            "offload_ms": EXAMPLE_OFFLOAD_MS,
            "hidden_share": hidden_share(EXAMPLE_ACCUMULATE_MS, EXAMPLE_UPDATE_MS, EXAMPLE_OFFLOAD_MS),
            "source": EXAMPLE_SOURCE}


def _median(values: dict[int, float]) -> float | None:
    return statistics.median(values.values()) if values else None


def caption(groups: dict[tuple[str, str | None], list[RunRecord]], runs: int) -> str:
    """What the bars are, and every wanted engine (and the sync mode) the folder has no runs of."""
    present = {engine for engine, _ in groups}
    absent = [e for e in wanted_engines() if e not in present]
    text = (f"Bar: one step's start-to-start time, median over the folder's timed runs ({runs} per engine at most) "
            "of that step index; whiskers: fastest and slowest run. Dashed: the matching ZeRO-Offload's median step. "
            "Hidden share: 1 − (update − accumulate) / (ZeRO-Offload − accumulate), — where ZeRO-Offload's step is "
            "no slower than an accumulate step.")
    if absent:
        text += f" Not in this folder's records (not drawn): {', '.join(absent)}."
    if not any(mode == "sync" for _, mode in groups):
        text += " No ZenFlow sync runs (overlap_step false) here: every ZenFlow engine drawn ran with overlap."
    return text


def figure(records: Sequence[RunRecord], path: Path, title: str, max_steps: int = TRACE_STEPS) -> dict[str, Any]:
    """step-trace.png; returns what was drawn (each panel's steps, median ms and the kinds read back from the bars'
    colours; the caption; the size in pixels), so tests need no pixel parsing."""
    from matplotlib.patches import Patch

    plt = pyplot()
    groups = group_runs(records)
    traces = {key: trace(runs, max_steps) for key, runs in groups.items()}
    timed = [hi for t in traces.values() for hi, k in zip(t["high"], t["kinds"]) if k != "warmup"]
    # the y range fits the timed steps: a slow first step (allocation, the first boundary) would flatten the rest
    top = 1.3 * max(timed or [hi for t in traces.values() for hi in t["high"]])
    rows = {(r["engine"], r["mode"]): r for r in trace_rows(records)}
    offload = {engine: _median(by_repeat(runs, "update")) for (engine, mode), runs in groups.items() if not mode}
    fig, axes = plt.subplots(len(groups), 1, sharex=True, sharey=True, squeeze=False,
                             figsize=(FIG_WIDTH_IN, PANEL_IN * len(groups) + 1.9))
    drawn = [_panel(ax, key, len(groups[key]), traces[key], rows.get(key), offload, top)
             for ax, key in zip(axes[:, 0], groups)]
    text = caption(groups, max(len(runs) for runs in groups.values()))
    # the caption and legend ride on the axes, so that save_figure's tight layout keeps them in the frame
    axes[-1, 0].set_xlabel("step (warm-up included)\n\n" + "\n".join(textwrap.wrap(text, 140)), fontsize=8,
                           loc="left")
    axes[-1, 0].set_xticks(range(1, max(len(d["steps"]) for d in drawn) + 1))
    axes[-1, 0].tick_params(axis="x", labelsize=7)
    axes[0, 0].set_ylim(0, top)
    handles = [Patch(color=c, label=KIND_LABELS[k]) for k, c in KIND_COLORS.items()]
    axes[0, 0].legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.12), ncol=3, fontsize=7.5,
                      frameon=False)
    fig.supylabel("step time, ms", fontsize=9)
    fig.suptitle(title, fontsize=10)
    size = tuple(round(v * FIGURE_DPI) for v in fig.get_size_inches())  # save_figure's dpi
    save_figure(fig, path)
    return {"panels": drawn, "caption": text, "title": title, "size_px": size}


def _panel(ax: Any, key: tuple[str, str | None], runs: int, t: dict[str, list[Any]], row: dict[str, Any] | None,
           offload: dict[str, float | None], top: float) -> dict[str, Any]:
    """One engine's bars (coloured by kind), whiskers, its ZeRO-Offload's level and its medians; what was drawn."""
    from matplotlib.colors import to_hex

    engine, mode = key
    name = f"{engine} ({mode})" if mode else engine
    x = list(range(1, len(t["ms"]) + 1))
    bars = ax.bar(x, t["ms"], color=[KIND_COLORS[k] for k in t["kinds"]], width=0.8)
    ax.vlines(x, t["low"], [min(h, top) for h in t["high"]], color="0.15", linewidth=0.8)
    for i, ms in zip(x, t["ms"]):
        if ms > top:  # clipped by the y range: its value written at the top
            ax.text(i, top * 0.96, f"{ms:.0f} ↑", ha="center", va="top", fontsize=6.5, rotation=90)
    base = ENGINE_SPECS[engine].stall_baseline if mode else None
    if offload.get(base):
        ax.axhline(offload[base], color="0.3", linestyle="--", linewidth=1)
    ax.set_title(f"{name} — {runs} runs", fontsize=9, loc="left")
    ax.set_title(_medians_line(row, offload.get(engine)), fontsize=8, loc="right")
    ax.spines[["top", "right"]].set_visible(False)
    back = {to_hex(v): k for k, v in KIND_COLORS.items()}  # the kinds as drawn, read back for the tests
    return {"name": name, "steps": x, "ms": t["ms"], "kinds": [back.get(to_hex(b.get_facecolor())) for b in bars]}


def _medians_line(row: dict[str, Any] | None, own_update: float | None) -> str:
    """A panel's numbers, as step-trace.csv has them."""
    if row is None:
        return f"median step {fmt(own_update, '.0f')} ms"
    return (f"accumulate {fmt(row['accumulate_ms'], '.0f')} ms, update {fmt(row['update_ms'], '.0f')} ms "
            f"({fmt(row['update_over_accumulate'], '.2f')}×); hidden share {fmt(row['hidden_share'], '.2f')}")


def step_trace_report(records: Sequence[RunRecord], out: Path, label: str,
                      max_steps: int = TRACE_STEPS) -> dict[str, Any] | None:
    """step-trace.png and step-trace.csv in `out` from its records (`label`: the runs' hardware line); what was
    drawn, or None (and nothing written) when the folder holds no run of the trace's engines."""
    if not isinstance(max_steps, int) or max_steps < 1:
        raise ValueError(f"max_steps = {max_steps!r} is not allowed: expected an integer ≥ 1 (default {TRACE_STEPS})")
    if not group_runs(records):
        return None
    write_csv(trace_rows(records), out / CSV)
    steps = max(len(r.steps) for runs in group_runs(records).values() for r in runs)
    title = (f"Step-time trace: ZeRO-Offload vs ZenFlow, the first {min(steps, max_steps)} steps\n"
             f"{label}; runs of {runs_day(records, out)}")
    return figure(records, out / PNG, title, max_steps)
