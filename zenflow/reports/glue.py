"""GLUE parity report from run records only: per-task score mean ± std per engine, ZenFlow − ZeRO-Offload, the
parity verdict, an average row, the measured speedup, and the figure (the paper's Figure 1 right panel style).

Parity (per task and for the average): ZenFlow's mean score is within max(1.0 point, 2 × the seed standard
deviation) of ZeRO-Offload's, where the standard deviation is the larger of the two engines' sample standard
deviations over seeds. It is checked for both families: DeepSpeed (ds-zenflow vs ds-zero-offload) and ours
(ref-zenflow vs ref-offload). Speedup: the median, over the (task, seed) runs both engines completed, of
ZeRO-Offload's timed training time over ZenFlow's (same steps, same batches; the median keeps one run slowed by a
neighbour's load from deciding it).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from zenflow.harness import tables
from zenflow.harness.configs import ENGINES, GLUE_BLOCK
from zenflow.harness.engines.registry import ENGINE_SPECS
from zenflow.harness.glue.data import get_task, metric_name
from zenflow.harness.records import RunRecord
from zenflow.reports.glue_curve import curve_report
from zenflow.reports.intervals import log_interval, ratio_cell
from zenflow.reports.scenario import check_one_placement, engine_rank, runs_hardware_label

LABELS = {"deepspeed": "DeepSpeed", "ours": "ours"}
# Per family, its ZenFlow engine and the offload engine it is held to (the registry's stall baseline), in table order:
# the core engines (the paper's design); a variant such as ref-zenflow-da is a column of its own, not a family.
FAMILIES = {LABELS[s.family]: (s.name, s.stall_baseline) for s in ENGINE_SPECS.values()
            if s.stall_baseline and s.group == "core"}
# DeepSpeed's ZenFlow as its authors intended (the registry's repair_weight_view engine) is held to the same baseline,
# as a family of its own in the tables whose folder has its runs: a folder made without it keeps its table as it was.
# Opt-in engines are often added to a folder later, not interleaved with it, so no speedup is computed for them here.
INTENDED = next(s for s in ENGINE_SPECS.values() if s.repair_weight_view)
OPT_IN_FAMILIES = {"DeepSpeed as intended": (INTENDED.name, INTENDED.stall_baseline)}
ALL_FAMILIES = {**FAMILIES, **OPT_IN_FAMILIES}
AVERAGE = "average"


def families(records: list[RunRecord]) -> dict[str, tuple[str, str]]:
    """The families a table shows: the core ones always, an opt-in one where its ZenFlow engine ran."""
    ran = {r.engine for r in records}
    return {f: pair for f, pair in ALL_FAMILIES.items() if f in FAMILIES or pair[0] in ran}


def _stats(scores: list[float]) -> dict[str, Any]:
    return {"mean": statistics.fmean(scores), "std": statistics.stdev(scores) if len(scores) > 1 else 0.0,
            "n": len(scores), "scores": scores}


def scores(records: list[RunRecord]) -> dict[str, dict[str, dict[int, float]]]:
    """task -> engine -> seed -> score (points), from the ok records."""
    out: dict[str, dict[str, dict[int, float]]] = {}
    for r in records:
        if r.status == "ok" and r.workload.get("kind") == "glue" and r.metrics.get("score") is not None:
            out.setdefault(r.metrics["task"], {}).setdefault(r.engine, {})[r.workload["seed"]] = r.metrics["score"]
    return out


def parity(zen: dict[str, Any] | None, off: dict[str, Any] | None) -> dict[str, Any] | None:
    if not zen or not off:
        return None
    diff = zen["mean"] - off["mean"]
    tolerance = max(1.0, 2.0 * max(zen["std"], off["std"]))
    return {"diff": diff, "tolerance": tolerance, "holds": abs(diff) <= tolerance, "seeds": min(zen["n"], off["n"])}


def summarize(records: list[RunRecord]) -> list[dict[str, Any]]:
    """One row per task (ordered as GLUE lists them) plus the average row (per seed: the mean over tasks of that
    seed's scores, for the seeds every task has for that engine)."""
    check_one_placement(records)
    by_task = scores(records)
    order = [t for t in ("CoLA", "SST-2", "MRPC", "QQP", "STS-B", "MNLI", "QNLI", "RTE", "WNLI") if t in by_task]
    rows = []
    for task in order:
        engines = {e: _stats([by_task[task][e][s] for s in sorted(by_task[task][e])]) for e in by_task[task]}
        base = [r.metrics["majority_score"] for r in records if r.status == "ok" and r.metrics.get("task") == task
                and r.metrics.get("majority_score") is not None]
        rows.append({"task": task, "metric": metric_name(get_task(task)), "engines": engines,
                     "majority": statistics.fmean(base) if base else None})
    if len(rows) > 1:
        average: dict[str, Any] = {}
        for engine in {e for row in rows for e in row["engines"]}:
            if all(engine in by_task[t] for t in order):
                seeds = set.intersection(*(set(by_task[t][engine]) for t in order))
                if seeds:
                    average[engine] = _stats([statistics.fmean(by_task[t][engine][s] for t in order)
                                              for s in sorted(seeds)])
        majority = [r["majority"] for r in rows]
        rows.append({"task": AVERAGE, "metric": "mean of task scores", "engines": average,
                     "majority": statistics.fmean(majority) if None not in majority else None})
    shown = families(records)
    for row in rows:
        row["parity"] = {f: parity(row["engines"].get(z), row["engines"].get(o)) for f, (z, o) in shown.items()}
    return rows


def speedups(records: list[RunRecord]) -> dict[str, dict[str, Any] | None]:
    check_one_placement(records)
    def train_ms(r: RunRecord) -> float:
        return sum(s["period_ms"] for s in r.steps if s["kind"] != "warmup" and s.get("period_ms") is not None)

    runs = {(r.engine, r.metrics.get("task"), r.workload.get("seed")): r for r in records if r.status == "ok"}
    out: dict[str, dict[str, Any] | None] = {}
    for family, (zen, off) in FAMILIES.items():
        pairs = [(runs[k], runs[(off, *k[1:])]) for k in runs if k[0] == zen and (off, *k[1:]) in runs]
        z, o = sum(train_ms(p[0]) for p in pairs), sum(train_ms(p[1]) for p in pairs)
        ratios = [train_ms(b) / train_ms(a) for a, b in pairs if train_ms(a) > 0]
        iv = log_interval(ratios) if ratios else None
        out[family] = {"speedup": iv.center, "interval": iv, "pairs": len(pairs), "zenflow_s": z / 1e3,
                       "offload_s": o / 1e3} if iv else None
    return out


def _cell(stats: dict[str, Any] | None) -> str:
    return tables.MISSING if not stats else f"{stats['mean']:.1f} ± {stats['std']:.1f}"


def _verdict(p: dict[str, Any] | None) -> str:
    if p is None:
        return tables.MISSING
    mark = "holds" if p["holds"] else "**does not hold**"
    return f"{mark} (|Δ| {abs(p['diff']):.1f} {'≤' if p['holds'] else '>'} {p['tolerance']:.1f})"


def markdown(rows: list[dict[str, Any]], speed: dict[str, Any], records: list[RunRecord] = ()) -> list[str]:
    engines = [e for e in ENGINES if any(e in r["engines"] for r in rows)]
    shown = list(rows[0]["parity"])
    headers = ["task", "metric", "majority class", *engines, *(f"ZenFlow − ZeRO-Offload ({f})" for f in shown),
               *(f"parity ({f})" for f in shown)]
    body = []
    for r in rows:
        diffs = [tables.fmt(None if r["parity"][f] is None else r["parity"][f]["diff"], "+.1f") for f in shown]
        name = "**average**" if r["task"] == AVERAGE else r["task"]
        body.append([name, r["metric"], tables.fmt(r.get("majority")), *(_cell(r["engines"].get(e)) for e in engines),
                     *diffs, *(_verdict(r["parity"][f]) for f in shown)])
    lines = [tables.markdown(body, headers), ""]
    for family, s in speed.items():
        zen, off = FAMILIES[family]
        lines.append(f"- Speedup of ZenFlow over ZeRO-Offload, {family} ({zen} vs {off}): " + (
            f"**{ratio_cell(s['interval'])}** (geometric mean over {s['pairs']} task × seed pairs of the timed "
            "training time ratio, 95% interval; "
            f"total timed training: ZeRO-Offload {s['offload_s']:.1f} s, ZenFlow {s['zenflow_s']:.1f} s)"
            if s else "not measured (no paired runs)"))
    lines += [f"- Speedup of ZenFlow over ZeRO-Offload, {f} ({z} vs {o}): not computed from this table (an opt-in "
              "engine's runs may have been added to the folder later, not interleaved with its baseline's)"
              for f, (z, o) in ALL_FAMILIES.items() if f in shown and f not in speed]
    return lines + verdict_lines(rows) + init_warning_lines(list(records))


def verdict_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The parity verdict in plain words, one line per task and family."""
    lines = []
    for r in rows:
        for family, p in r["parity"].items():
            if p is None:
                continue
            where = "the average" if r["task"] == AVERAGE else r["task"]
            side = "above" if p["diff"] >= 0 else "below"
            text = (f"ZenFlow is {abs(p['diff']):.2f} points {side} ZeRO-Offload (tolerance {p['tolerance']:.2f}, "
                    f"{p['seeds']} seeds)")
            engines, majority = r["engines"], r.get("majority")
            zen, off = (majority is not None and abs(engines[e]["mean"] - majority) < 0.5 for e in ALL_FAMILIES[family])
            lines.append(f"- Parity {'holds' if p['holds'] else 'DOES NOT HOLD'} on {where}, {family}: {text}"
                         + ("" if p["holds"] else " — ZenFlow did not match ZeRO-Offload here.")
                         + (". Both engines are at the majority-class score: they learned nothing at this budget, so "
                            "this says nothing about parity." if zen and off else "")
                         + (". But ZenFlow is at the majority-class score (it learned nothing) while ZeRO-Offload "
                            "learned: it is inside the tolerance only because the task's seed spread is wide, which "
                            "is not evidence of parity." if zen and not off and p["holds"] else ""))
    return lines


def init_warning_lines(records: list[RunRecord]) -> list[str]:
    """Engines whose construction changed the model's weights (records' `weights_changed_at_init`): one line each,
    since every score of theirs comes from other weights than the pretrained ones."""
    changed: dict[str, list[int]] = {}
    for r in records:
        if r.status == "ok" and r.protocol.get("weights_changed_at_init"):
            changed.setdefault(r.engine, []).append(r.protocol["weights_changed_at_init"])
    total = {e: sum(1 for r in records if r.status == "ok" and r.engine == e) for e in changed}
    return [f"- {e}: building the engine changed the values of {max(n)} parameters in {len(n)} of {total[e]} runs "
            "(recorded in each run's `protocol.weights_changed_at_init`): it fine-tuned other weights than the "
            "pretrained ones." + (" DeepSpeed 0.19.8's ZenFlow stage 1/2 re-views every weight untransposed "
                                  "(divergence G, docs/glue.md)." if e == FAMILIES["DeepSpeed"][0] else "")
            for e, n in sorted(changed.items())]


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    """One line per task and engine, engines in a stable order whatever the records' order."""
    table = [[r["task"], r["metric"], engine, f"{s['mean']:.4f}", f"{s['std']:.4f}", s["n"],
              " ".join(f"{x:.4f}" for x in s["scores"])]
             for r in rows for engine, s in sorted(r["engines"].items(), key=lambda e: engine_rank(e[0]))]
    tables.write_csv(table, path, header=["task", "metric", "engine", "mean", "std", "seeds", "scores"])


def write_parity_csv(rows: list[dict[str, Any]], path: Path) -> None:
    table = [[r["task"], family, f"{p['diff']:.4f}", f"{p['tolerance']:.4f}", p["seeds"], p["holds"]]
             for r in rows for family, p in r["parity"].items() if p is not None]
    tables.write_csv(table, path, header=["task", "family", "zenflow_minus_offload", "tolerance", "seeds", "holds"])


def figure(rows: list[dict[str, Any]], speed: dict[str, Any], path: Path, title: str, subtitle: str) -> None:
    """Average GLUE score (0–1, as the paper's "average accuracy") per engine, seed std as error bars, and the
    measured speedup of each ZenFlow over its ZeRO-Offload written on the ZenFlow bars."""
    plt = tables.pyplot()
    avg = rows[-1]["engines"]
    engines = [e for e in ENGINES if e in avg]
    if not engines:
        return
    means = [avg[e]["mean"] / 100 for e in engines]
    stds = [avg[e]["std"] / 100 for e in engines]
    colors = {"ds-zero-offload": "#8C8C8C", "ds-zenflow": "#4C72B0", "ds-zenflow-intended": "#8172B3",
              "ref-offload": "#BDBDBD",
              "ref-zenflow": "#55A868", "no-offload": "#DD8452"}
    fig, ax = plt.subplots(figsize=(1.3 * len(engines) + 2.5, 4.4))
    ax.bar(engines, means, yerr=stds, capsize=4, color=[colors.get(e, "#999999") for e in engines])
    low, high = min(m - s for m, s in zip(means, stds)), max(m + s for m, s in zip(means, stds))
    majority = rows[-1].get("majority")
    if majority is not None:
        ax.axhline(majority / 100, color="black", linestyle="--", linewidth=1, label="majority class (learned nothing)")
        ax.legend(fontsize=8, loc="upper right", frameon=False)
        low, high = min(low, majority / 100), max(high, majority / 100)
    pad = max(0.02, (high - low) * 0.5)
    for i, e in enumerate(engines):
        note = f"{means[i]:.3f}"
        family = next((f for f, (z, _) in FAMILIES.items() if z == e), None)
        if family and speed.get(family):
            note += f"\n{speed[family]['speedup']:.2f}× vs\n{FAMILIES[family][1]}"
        ax.text(i, means[i] + stds[i] + pad * 0.08, note, ha="center", va="bottom", fontsize=8, fontweight="bold")
    ax.set_ylim(max(0.0, low - pad), min(1.0, high + 1.6 * pad) if high + 1.6 * pad < 1.0 else high + 1.6 * pad)
    ax.set_ylabel("average GLUE score (dev), 0–1")
    ax.set_title(f"{title}\n{subtitle}", fontsize=10)
    ax.spines[["top", "right"]].set_visible(False)
    plt.xticks(fontsize=8)
    tables.save_figure(fig, path)


def describe_runs(ok: list[RunRecord]) -> tuple[list[str], str]:
    """The settings of the runs, read back from their records; and the model's display name."""
    if not ok:
        return [], "?"
    first, w = ok[0], ok[0].workload
    name = str(w.get("model_name") or w.get("model"))
    sizes = sorted({(r.metrics["task"], w2.get("train_size"), w2.get("train_of") or w2.get("train_size"),
                     ", ".join(f"{k} {v}" for k, v in (w2.get("eval_size") or {}).items()))
                    for r in ok for w2 in [r.workload]})
    ours = FAMILIES["ours"][0]
    block = next((r.config["zero_optimization"].get("zenflow") for r in ok if r.engine == ours), GLUE_BLOCK)
    return [f"Model: {name} ({first.model.get('parameters', 0) / 1e6:.1f}M params, {w.get('dtype')}), sequence "
            f"≤ {w.get('seq_len')} (dynamic padding), micro-batch {w.get('micro_batch')}, {w.get('epochs')} epoch(s), "
            f"AdamW lr {first.config['optimizer']['params']['lr']} (constant), weight decay "
            f"{first.config['optimizer']['params']['weight_decay']}, clipping {first.config['gradient_clipping']}.",
            "Training examples (fixed random subset, the same for every seed and engine) and dev examples: "
            + "; ".join(f"{t} {n} of {of}, {d}" for t, n, of, d in sizes) + ".",
            f"ZenFlow block: {block}. Scores in points (0–100): mean ± sample std over seeds "
            f"{sorted({r.workload.get('seed') for r in ok})}. Parity: |ZenFlow − ZeRO-Offload| ≤ max(1.0, 2 × the "
            "larger seed std).", ""], name


def parity_report(records: list[RunRecord], out: Path, env: dict[str, Any]) -> str:
    """The GLUE table.md/.csv, parity.csv and figure.png in `out`, from the records (reproduce/glue.py)."""
    ok = [r for r in records if r.status == "ok" and r.workload.get("kind") == "glue"]
    rows, speed = summarize(ok), speedups(ok)
    label = runs_hardware_label(ok, env)
    settings, model_name = describe_runs(ok)
    text = [f"# GLUE parity — {label}", "", *settings]
    text += markdown(rows, speed, ok) if rows else ["no successful runs"]
    failed = [f"{r.label} {r.engine} seed {r.workload.get('seed')}" for r in records if r.status != "ok"]
    if failed:
        text.append(f"- FAILED runs (see their records): {', '.join(failed)}")
    out.mkdir(parents=True, exist_ok=True)
    tables.write_text_atomic(out / "table.md", "\n".join(text) + "\n")
    curve_report(ok, out, label)  # accuracy against training time, when the runs evaluated along the way
    if rows:
        write_csv(rows, out / "table.csv")
        write_parity_csv(rows, out / "parity.csv")
        figure(rows, speed, out / "figure.png", "GLUE parity: ZenFlow vs ZeRO-Offload",
               f"{label}; {model_name.split(' (')[0]}, {', '.join(r['task'] for r in rows[:-1] or rows)}")
    print("\n".join(text))
    return "\n".join(text)
