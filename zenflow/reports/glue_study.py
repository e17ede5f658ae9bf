"""GLUE study: is ZenFlow's deficit ZenFlow's or the budget's? The deficit (ZenFlow − ZeRO-Offload, points) per
setting with a paired 95% interval over seeds, its change from the default setting, and a verdict per setting;
table.md/.csv and figure.png from the records only (reproduce/glue_study.py, docs/glue.md).

Paired by seed: the same seed gives both engines the same head initialisation and data order, so d_s = ZenFlow_s −
ZeRO-Offload_s removes what the seeds share; the interval is mean(d) ± t(0.975, n−1)·sd(d)/√n.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from zenflow.harness.records import RunRecord
from zenflow.harness.tables import MISSING, markdown, pyplot, save_figure, write_csv, write_text_atomic
from zenflow.reports.glue import AVERAGE, scores

# Each setting: the reproduce/glue.py arguments that make it (seeds 0 1 2 and the default data are glue.py's).
OURS = ["--engines", "ref-offload", "ref-zenflow"]
SETTINGS: dict[str, list[str]] = {
    "budget-3-epochs": [*OURS, "--epochs", "3"],
    "interval-1": ["--engines", "ref-zenflow", "--update-interval", "1"],
    "interval-2": ["--engines", "ref-zenflow", "--update-interval", "2"],
    "topk-0.05": ["--engines", "ref-zenflow", "--topk-ratio", "0.05"],
    "topk-0.2": ["--engines", "ref-zenflow", "--topk-ratio", "0.2"],
    "reproduce-default": [*OURS, "--seeds", "0"],
}
WHAT = {"default": "1 epoch, update interval 4, topk 0.1 (`make reproduce-glue`)",
        "budget-3-epochs": "3 epochs (3× the updates, same examples)", "interval-1": "update interval 1",
        "interval-2": "update interval 2", "topk-0.05": "topk 0.05", "topk-0.2": "topk 0.2"}
ZENFLOW, OFFLOAD = "ref-zenflow", "ref-offload"
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def t975(df: int) -> float:
    """Student's t, two-sided 95%; beyond the table, the Cornish-Fisher expansion (within 0.3% from df 11)."""
    if df in T975:
        return T975[df]
    z = 1.959964
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)


def paired(diffs: list[float]) -> dict[str, Any]:
    """Mean of paired differences with its 95% interval (None half-width with fewer than 2 pairs)."""
    mean = statistics.fmean(diffs)
    half = t975(len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else None
    return {"mean": mean, "n": len(diffs), "low": None if half is None else mean - half,
            "high": None if half is None else mean + half}


def _by_seed(table: dict[str, dict[str, dict[int, float]]], engine: str) -> dict[str, dict[int, float]]:
    """task -> seed -> score, and AVERAGE -> seed -> mean over tasks (seeds every task has)."""
    out = {task: dict(engines.get(engine, {})) for task, engines in sorted(table.items())}
    out = {t: s for t, s in out.items() if s}
    common = set.intersection(*(set(s) for s in out.values())) if out else set()
    if len(out) > 1:
        out[AVERAGE] = {seed: statistics.fmean(s[seed] for s in out.values()) for seed in sorted(common)}
    return out


def deficits(zen: dict[str, dict[int, float]], off: dict[str, dict[int, float]]) -> dict[str, dict[str, Any]]:
    """task -> paired deficit of ZenFlow against ZeRO-Offload, with both means and the per-seed differences."""
    out = {}
    for task, z in zen.items():
        seeds = sorted(set(z) & set(off.get(task, {})))
        if seeds:
            d = [z[s] - off[task][s] for s in seeds]
            out[task] = {**paired(d), "seeds": seeds, "diffs": d, "zenflow": statistics.fmean(z[s] for s in seeds),
                         "offload": statistics.fmean(off[task][s] for s in seeds)}
    return out


def verdict(deficit: dict[str, Any], change: dict[str, Any] | None, default: dict[str, Any] | None = None) -> str:
    """In words: is there a deficit (its interval below 0), and did the setting change it against the default?
    "Closes it" only where the default had a detected deficit and this setting has none."""
    if deficit["low"] is None:
        return "one seed: no interval"
    where = ("deficit" if deficit["high"] < 0 else "ZenFlow above" if deficit["low"] > 0 else
             "no deficit detected (interval contains 0)")
    if change is None or change["low"] is None:
        return where
    closed = default is not None and default["high"] is not None and default["high"] < 0 <= deficit["high"]
    moved = ("closes it" if change["low"] > 0 and closed else "smaller than the default's" if change["low"] > 0
             else "larger than the default's" if change["high"] < 0 else "no detectable change from the default")
    return f"{where}; {moved}"


def study_rows(default: list[RunRecord], settings: dict[str, list[RunRecord]]) -> list[dict[str, Any]]:
    """One row per (setting, task incl. the average): ZeRO-Offload from the setting itself when it ran one (the
    budget), else the default's (same budget); the change against the default's deficit, paired by seed."""
    base = scores(default)
    base_off, base_zen = _by_seed(base, OFFLOAD), _by_seed(base, ZENFLOW)
    base_def = deficits(base_zen, base_off)
    rows = []
    for name, records in [("default", default), *((k, v) for k, v in settings.items() if k in WHAT)]:
        table = scores(records)
        zen = _by_seed(table, ZENFLOW)
        own_off = _by_seed(table, OFFLOAD)
        off = own_off or (base_off if budget(records) == budget(default) else {})
        for task, d in deficits(zen, off).items():
            change = None
            if name != "default" and task in base_def:
                seeds = sorted(set(d["seeds"]) & set(base_def[task]["seeds"]))
                mine, theirs = dict(zip(d["seeds"], d["diffs"])), dict(zip(base_def[task]["seeds"],
                                                                          base_def[task]["diffs"]))
                change = paired([mine[s] - theirs[s] for s in seeds]) if seeds else None
            rows.append({"setting": name, "what": WHAT[name], "task": task, "seeds": len(d["seeds"]),
                         "offload": d["offload"], "zenflow": d["zenflow"], "deficit": d["mean"],
                         "deficit_low": d["low"], "deficit_high": d["high"],
                         "change": change["mean"] if change else None,
                         "change_low": change["low"] if change else None,
                         "change_high": change["high"] if change else None,
                         "offload_from": "this setting" if own_off else "default",
                         "verdict": verdict(d, change, base_def.get(task) if name != "default" else None)})
    return rows


def budget(records: list[RunRecord]) -> set[tuple]:
    """What must match for ZenFlow runs to borrow another set's ZeRO-Offload scores: data, epochs, batch, lr."""
    return {(r.metrics.get("task"), r.workload.get("train_size"), r.workload.get("epochs"), r.workload.get("seq_len"),
             r.workload.get("micro_batch"), r.workload.get("dtype"), r.config["optimizer"]["params"]["lr"])
            for r in records if r.status == "ok"}


def reproduced(default: list[RunRecord], again: list[RunRecord]) -> tuple[int, int, float]:
    """The reproduce-default setting against the committed default runs: identical scores, runs compared, and the
    largest difference in points."""
    base, new = scores(default), scores(again)
    pairs = [(base[t][e][s], v) for t, engines in new.items() for e, seeds in engines.items()
             for s, v in seeds.items() if s in base.get(t, {}).get(e, {})]
    return sum(a == b for a, b in pairs), len(pairs), max((abs(a - b) for a, b in pairs), default=0.0)


def _interval(mean: float | None, low: float | None, high: float | None) -> str:
    if mean is None:
        return MISSING
    return f"{mean:+.2f}" + ("" if low is None else f" [{low:+.2f}, {high:+.2f}]")


def study_report(default: list[RunRecord], settings: dict[str, list[RunRecord]], out: Path) -> str:
    """table.md/.csv and figure.png in `out`."""
    rows = study_rows(default, settings)
    body = [[r["setting"], r["what"], r["task"], r["seeds"], f"{r['offload']:.2f}", f"{r['zenflow']:.2f}",
             _interval(r["deficit"], r["deficit_low"], r["deficit_high"]),
             _interval(r["change"], r["change_low"], r["change_high"]), r["verdict"]] for r in rows]
    text = ["# GLUE study: is ZenFlow's deficit ZenFlow's or the budget's? (ours: ref-zenflow vs ref-offload)", "",
            "Scores in points (SST-2 accuracy, MRPC mean of F1 and accuracy; average: mean of the two), means over "
            "seeds. Deficit: ZenFlow − ZeRO-Offload, paired by seed, with its 95% interval (t, n − 1 degrees of "
            "freedom). Change: this setting's deficit − the default's, paired by seed. ZeRO-Offload's scores come "
            "from the setting itself where it ran (the budget) and from the default runs otherwise (same budget: "
            "the knobs change ZenFlow only). Everything else as `make reproduce-glue` (MiniLM-L6, fp32, the same "
            "training subsets).", "",
            markdown(body, ["setting", "what changes", "task", "seeds", "ZeRO-Offload", "ZenFlow", "deficit [95% CI]",
                            "change vs default [95% CI]", "verdict"]), ""]
    if "reproduce-default" in settings:
        same, n, worst = reproduced(default, settings["reproduce-default"])
        text.append(f"- The default runs reproduce: {same} of {n} reruns (seed 0, both engines, both tasks) gave "
                    f"the committed score exactly (largest difference {worst:.2f} points).")
    unmatched = [k for k in settings if k in WHAT and not any(r["setting"] == k for r in rows)]
    if unmatched:
        text.append(f"- Not compared: {', '.join(unmatched)} (no ZeRO-Offload runs of their own, and their budget "
                    "differs from the default runs').")
    changes = [r for r in rows if r["change_low"] is not None]
    if changes:
        text.append(f"- {len(changes)} change intervals at 95%: about {0.05 * len(changes):.1f} of them would exclude "
                    "0 by chance alone, so one \"smaller\" or \"larger\" among them is not a finding.")
    text.append("- What the data point to: docs/glue.md, \"Does the deficit close?\".")
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "table.md", "\n".join(text) + "\n")
    write_csv(rows, out / "table.csv")
    figure(rows, out / "figure.png")
    print("\n".join(text))
    return "\n".join(text)


def figure(rows: list[dict[str, Any]], path: Path) -> None:
    """The deficit with its 95% interval per setting, one panel per task."""
    plt = pyplot()
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    names = list(dict.fromkeys(r["setting"] for r in rows))
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 4.4), sharey=True, squeeze=False)
    for ax, task in zip(axes[0], tasks):
        mine = {r["setting"]: r for r in rows if r["task"] == task}
        for i, name in enumerate(names):
            r = mine.get(name)
            if not r:
                continue
            err = None if r["deficit_low"] is None else [[r["deficit"] - r["deficit_low"]],
                                                         [r["deficit_high"] - r["deficit"]]]
            ax.errorbar([i], [r["deficit"]], yerr=err, fmt="o", capsize=4,
                        color="black" if name == "default" else "C0" if name.startswith("budget") else "C1")
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
        ax.set_title(task, fontsize=10)
    axes[0][0].set_ylabel("ZenFlow − ZeRO-Offload, points (95% CI, paired by seed)")
    fig.suptitle("GLUE: ZenFlow's deficit by budget and staleness knobs (cpu-scale, MiniLM-L6, 3 seeds)",
                 fontsize=10)
    save_figure(fig, path)
