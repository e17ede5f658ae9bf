"""The host worker's share of the cores: ZenFlow's step time at each `pt_reserved_cores_perc`.

ZenFlow splits each rank's CPU cores in two: `pt_reserved_cores_perc` of them stay with PyTorch (forward, backward
and, at cpu-scale, the device-side update), the rest run the host worker (the interval's accumulation and the CPU
AdamW). Too few worker cores and the step stalls on the host; too few compute cores and the step itself slows. Which
split a fraction gives depends on the core count and on each engine's rounding, so every row names the split its runs
made (`split`: recorded by the plan, reproduce/llama7b.py --cores-ablation):

- ours (zenflow/worker.py `reserved_cores`): round(fraction × cores) compute cores, at least one on each side; 1.0
  (or one core) pins nothing and both share every core;
- DeepSpeed's (runtime/zenflow/zenflow_utils.py, read, not copied): ceil(fraction × cores) of the rank's physical
  cores for compute, the rest for its optimizer process; a side that rounds to none, or to all, means both share.

Per (engine, fraction): the median cycle-mean step time of the runs with its 95% interval, and the speedup over the
same engine at the default fraction (0.5), paired by repeat (intervals.py).

    cores.md / cores.csv   one row per (engine, fraction)
    cores.png              step time against the fraction, one line per engine, the intervals as error bars
"""

from __future__ import annotations

import math
import os
import statistics
from pathlib import Path
from typing import Any

from zenflow.config import ZenFlowConfig
from zenflow.harness.engines.registry import is_deepspeed
from zenflow.harness.records import RunRecord
from zenflow.harness.tables import fmt, markdown, pyplot, save_figure, write_csv, write_text_atomic
from zenflow.reports.intervals import columns, interval_cell, log_interval, ratio_cell, ratio_interval, row_interval
from zenflow.reports.scenario import check_one_placement, engine_rank, load_notes, runs_hardware_label, seeds_line
from zenflow.worker import reserved_cores

DEFAULT = ZenFlowConfig().pt_reserved_cores_perc  # DeepSpeed's default too (ZenFlowConfig: Field(0.5))
FRACTIONS = (0.25, 0.5, 0.75, 1.0)  # --cores-ablation without values
COLUMNS = ("engine", "pt_reserved_cores_perc", "split: compute + worker cores", "runs", "cycle mean ms",
           "95% interval", "speedup over 0.5 [95%]", "stall ms")


def planned_split(engine: str, fraction: float) -> str:
    """The split `engine` makes of this process's cores at `fraction`, as "c + w" or "shared (n)"."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if is_deepspeed(engine):
        import psutil  # DeepSpeed's own dependency: it binds physical cores only

        physical = [c for c in cores if c < (psutil.cpu_count(logical=False) or len(cores))]
        compute = math.ceil(fraction * len(physical))
        return f"{compute} + {len(physical) - compute}" if 0 < compute < len(physical) else f"shared ({len(physical)})"
    split = reserved_cores(fraction)
    return f"{len(split[1])} + {len(split[0])}" if split else f"shared ({len(cores)})"


def fraction_of(record: RunRecord) -> float:
    """The run's pt_reserved_cores_perc, from the ZenFlow block it ran with."""
    block = record.config.get("zero_optimization", {}).get("zenflow") or {}
    return float(block.get("pt_reserved_cores_perc", DEFAULT))


def cores_rows(records: list[RunRecord]) -> list[dict[str, Any]]:
    check_one_placement(records)
    groups: dict[tuple[str, float], list[RunRecord]] = {}
    for r in records:
        if r.status == "ok" and r.summary.get("cycle_mean_ms") and r.protocol.get("telemetry", True):
            groups.setdefault((r.engine, fraction_of(r)), []).append(r)
    by_repeat = {key: {int(r.protocol.get("repeat", 0)): r.summary["cycle_mean_ms"] for r in runs}
                 for key, runs in groups.items()}
    rows = []
    for (engine, fraction), runs in sorted(groups.items(), key=lambda kv: (engine_rank(kv[0][0]), kv[0][1])):
        cycle = log_interval([r.summary["cycle_mean_ms"] for r in runs])
        default = by_repeat.get((engine, DEFAULT))
        stalls = [r.summary["stall_ms"] for r in runs if r.summary.get("stall_ms") is not None]
        rows.append({"engine": engine, "fraction": fraction,
                     "split": " / ".join(sorted({str(r.protocol.get("split", "?")) for r in runs})),
                     "runs": len(runs), "cycle_mean_ms": statistics.median(r.summary["cycle_mean_ms"] for r in runs),
                     "cycle_mean_low": cycle.low, "cycle_mean_high": cycle.high,
                     "stall_ms": statistics.median(stalls) if stalls else None,
                     **columns("speedup", ratio_interval(default, by_repeat[(engine, fraction)]) if default else None)})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    body = [[r["engine"], f"{r['fraction']:g}", r["split"], r["runs"], fmt(r["cycle_mean_ms"], ".1f"),
             interval_cell(row_interval(r, "cycle_mean", "cycle_mean_ms")),
             "1.00× (default)" if r["fraction"] == DEFAULT else ratio_cell(row_interval(r, "speedup")),
             fmt(r["stall_ms"], ".1f")]
            for r in rows]
    return markdown(body, COLUMNS)


def figure(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for i, engine in enumerate(dict.fromkeys(r["engine"] for r in rows)):
        mine = [r for r in rows if r["engine"] == engine]
        x, y = [r["fraction"] for r in mine], [r["cycle_mean_ms"] for r in mine]
        err = [[max(0.0, v - (r["cycle_mean_low"] or v)) for v, r in zip(y, mine)],
               [max(0.0, (r["cycle_mean_high"] or v) - v) for v, r in zip(y, mine)]]
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, color=f"C{i % 10}", label=engine)
        for r in mine:
            ax.annotate(r["split"], (r["fraction"], r["cycle_mean_ms"]), textcoords="offset points", xytext=(4, 4),
                        fontsize=7, color="0.35")
    ax.set(xlabel="pt_reserved_cores_perc (share of the cores kept for PyTorch compute)",
           ylabel="step time, ms (cycle mean; 95% interval)", title=title)
    ax.set_ylim(bottom=0)
    ax.spines[["top", "right"]].set_visible(False)
    ax.legend(fontsize=8, frameon=False)
    save_figure(fig, path)


def cores_report(records: list[RunRecord], out: Path, env: dict[str, Any]) -> str:
    """cores.md/.csv and cores.png in `out`, from the ablation's records (`env`: this machine, for records that
    do not name theirs)."""
    rows = cores_rows(records)
    label = runs_hardware_label(records, env)
    text = [f"# The host worker's share of the cores — {label}", "",
            "Step time (cycle mean over whole update cycles; median of the runs, 95% interval of their geometric "
            "mean) at each `pt_reserved_cores_perc`: the share of each rank's cores kept for PyTorch compute, the "
            "rest running the host worker (ours: a thread; DeepSpeed's: its optimizer process). The split column "
            "is what the runs made of this machine's cores (\"shared\": nothing pinned, both sides on every core). "
            "Speedup: the same engine's step time at 0.5 over this one, paired by repeat (\"no difference\" where "
            "the interval includes 1). " + seeds_line(records),
            "", table(rows), ""]
    text += load_notes(records)
    write_text_atomic(out / "cores.md", "\n".join(text) + "\n")
    write_csv(rows, out / "cores.csv")
    if rows:
        figure(rows, out / "cores.png", f"ZenFlow's step time against the worker's share of the cores\n{label}")
    print("\n".join(text))
    return "\n".join(text)
