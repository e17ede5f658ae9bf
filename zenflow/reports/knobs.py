"""The knobs study (reproduce/knobs.py): ZenFlow at fixed and "auto" intervals, beside
ZeRO-Offload, on two workloads, from the records only.

Per workload and seed the target is ref-offload's final result with that seed (same weights and data order): on the
Llama convergence workload its final smoothed loss (convergence.py: the mean of the last steps' losses, the window a
fifth of its run), on GLUE SST-2 its final dev score (glue_curve.py: the runs evaluate every few steps). A setting's
time to target is the training time until it first gets there; it is compared with ref-offload's own time seed by
seed, as the geometric mean of the paired ratios with its 95% interval (intervals.py: below 1 is faster). A setting
that misses the target with any seed gets no ratio: "reached in k of n seeds" says how often it got there.

A second target, chosen after the first could not decide on either workload (no fixed setting reached ZeRO-Offload's
final result with every seed): the common target, per seed the worst final result among ref-offload and every
ref-zenflow setting, fixed or "auto" (COMMON). Every one of those runs reaches it by its last step, so every setting
gets a time to it; the same rule judges "auto" there, and the report says which target each verdict is at.

The verdict (RULE): an "auto" setting of ours holds when its time to target is within the interval of the best
fixed setting's (the fixed ref-zenflow setting with the lowest ratio among those that reached the target with every
seed), or below it. It is computed here and written to knobs.csv and verdict.json for the claims page.

What "auto" chose is read from each step's `decisions` (the host-update boundaries and selections the optimizer
reported through its observer API, session.step_row); DeepSpeed's engine counts its boundaries but does not record
them per step, so its "auto" runs show their outcome (NaN losses or a failed run, docs/design.md §7 A) and counts.

    knobs.md, knobs.csv, verdict.json   the table and the verdict, both workloads
    frontier.png                        time to target against step time, one point per setting
    auto-intervals.png                  the host-update intervals "auto" chose over training, selections marked
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from zenflow.harness.records import RunRecord
from zenflow.harness.tables import fmt, markdown, write_csv, write_json_atomic, write_text_atomic
from zenflow.reports.convergence import curve, window_for
from zenflow.reports.intervals import Interval, columns, interval_cell, log_interval, ratio_cell, ratio_interval
from zenflow.reports.knobs_figures import frontier_figure, intervals_figure
from zenflow.reports.scenario import runs_hardware_label

BASELINE, OURS = "ref-offload", "ref-zenflow"
KNOBS = ("update_interval", "select_interval", "topk_ratio")
SHORT = {"update_interval": "U", "select_interval": "S", "topk_ratio": "k"}
RULE = ("auto holds when its time to target (relative to ref-offload's, paired by seed) is within the 95% interval of "
        "the best fixed setting's, or below it; the best fixed setting is the fixed ref-zenflow setting with the "
        "lowest relative time among those that reached the target with every seed")
COMMON = ("per seed, the worst final result among ref-offload and every ref-zenflow setting (the "
          "highest final smoothed loss, the lowest final accuracy), which each of them reaches by its last step; "
          "chosen after ref-offload's own final result could not decide")
TARGETS = {"llama": "ref-offload's final smoothed loss with the same seed (the mean of its last {window} steps' "
                    "losses; every run's loss smoothed the same way); time: the sum of the step periods",
           "glue": "ref-offload's final SST-2 dev accuracy with the same seed; time: training seconds at the first "
                   "evaluation at or above it (evaluations cost none of it)"}


def block_of(record: RunRecord) -> dict[str, Any]:
    return (record.config.get("zero_optimization") or {}).get("zenflow") or {}


def setting_of(record: RunRecord) -> str:
    """The setting a record ran, from its own config: the baseline by name, a ZenFlow engine with its knobs."""
    block = block_of(record)
    if record.engine == BASELINE or not block:
        return record.engine
    return record.engine + " " + " ".join(f"{SHORT[k]}={block.get(k, '?')}" for k in KNOBS)


def is_auto(record: RunRecord) -> bool:
    return record.engine != BASELINE and any(block_of(record).get(k) == "auto" for k in KNOBS)


def kind_of(records: Sequence[RunRecord]) -> str:
    """"glue" (the records evaluate along the way) or "llama" (loss against wall time)."""
    return "glue" if any(r.workload.get("kind") == "glue" for r in records) else "llama"


def seed_of(record: RunRecord) -> int:
    return int(record.workload.get("seed", 0))


def times_to_target(records: Sequence[RunRecord], common: bool = False
                    ) -> tuple[dict[str, dict[int, float | None]], dict[str, Any]]:
    """setting -> seed -> time to the target with that seed (None: not reached): ref-offload's final result, or with
    `common` the worst final result of ref-offload and ref-zenflow (COMMON); and the facts (the kind of workload,
    the targets by seed, the smoothing window)."""
    ok = [r for r in records if r.status == "ok" and r.steps]
    kind, base = kind_of(records), {seed_of(r): r for r in ok if r.engine == BASELINE}
    window = window_for(min((len(r.steps) for r in base.values()), default=20))
    # (training seconds, result) after each evaluation or step; the worst of several results; when a run got there
    if kind == "glue":
        series = {id(r): [(p["train_s"], p["score"]) for p in r.metrics.get("curve") or []] for r in ok}
        worst, better = min, float.__ge__
    else:
        series = {id(r): curve(r, window) for r in ok}
        worst, better = max, float.__le__  # a loss: the highest is the worst
    targets = {s: series[id(r)][-1][1] for s, r in base.items() if series[id(r)]}
    if common:
        finals = [(seed_of(r), series[id(r)][-1][1]) for r in ok
                  if r.engine in (BASELINE, OURS) and series[id(r)] and math.isfinite(series[id(r)][-1][1])]
        targets = {s: worst(v for seed, v in finals if seed == s) for s in targets}
    reached = {id(r): next((t for t, v in series[id(r)] if better(float(v), targets[seed_of(r)])), None)
               for r in ok if seed_of(r) in targets}
    out: dict[str, dict[int, float | None]] = {}
    for r in ok:
        if id(r) in reached:
            out.setdefault(setting_of(r), {})[seed_of(r)] = reached[id(r)]
    return out, {"kind": kind, "targets": targets, "window": window}


def relative_time(times: dict[int, float | None], base: dict[int, float | None]) -> Interval | None:
    """The setting's time to target over ref-offload's, paired by seed (geometric mean, 95% interval); None when it
    or the baseline missed the target with any seed both ran."""
    shared = set(times) & set(base)
    if not shared or any(times[s] is None or base[s] is None for s in shared):
        return None
    return ratio_interval({s: times[s] for s in shared}, {s: base[s] for s in shared})  # type: ignore[misc]


def step_ms(record: RunRecord) -> float | None:
    """The record's step time: the mean over whole update cycles ("auto": over every timed step)."""
    return record.summary.get("cycle_mean_ms") or (record.summary.get("step_ms") or {}).get("mean")


def chosen_intervals(record: RunRecord) -> list[tuple[int, int]]:
    """(step, steps since the previous host update) at each host-update boundary the run's steps recorded."""
    out, last = [], -1
    for s in record.steps:
        if (s.get("decisions") or {}).get("host_update"):
            out.append((int(s["step"]), int(s["step"]) - last))
            last = int(s["step"])
    return out


def selections(record: RunRecord) -> list[int]:
    """The steps at which the run's step records name a top-k selection."""
    return [int(s["step"]) for s in record.steps if (s.get("decisions") or {}).get("selection")]


def what_happened(runs: Sequence[RunRecord]) -> str:
    """Failed runs and non-finite losses in words (DeepSpeed's "auto": docs/design.md §7 A), else ""."""
    failed = [r for r in runs if r.status != "ok"]
    if failed:
        last = (failed[0].error or "?").strip().splitlines()[-1]
        return f"failed with {len(failed)} of {len(runs)} seeds: {last[:160]}"
    bad = [next((s["step"] for s in r.steps if not math.isfinite(s.get("loss") or 0.0)), None) for r in runs]
    bad = [b for b in bad if b is not None]
    said = [f"loss not finite from step {min(bad)} with {len(bad)} of {len(runs)} seeds"] if bad else []
    if not any(s.get("decisions") for r in runs for s in r.steps):  # an engine that only counts (DeepSpeed's)
        facts = [r.metrics.get("zenflow") or {} for r in runs]
        if any("host_updates" in f for f in facts):
            said.append(f"host updates {'/'.join(str(f.get('host_updates')) for f in facts)} and selections "
                        f"{'/'.join(str(f.get('selections')) for f in facts)} in {len(runs[0].steps)} steps, "
                        f"counted by {facts[0].get('counted_by', '?')}")
    return "; ".join(said)


def setting_rows(records: Sequence[RunRecord], workload: str, common: bool = False
                 ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One row per setting (baseline first, then in the order the records were planned) at ref-offload's final
    result or, with `common`, at the common target (COMMON); and the facts."""
    times, facts = times_to_target(records, common)
    by_setting: dict[str, list[RunRecord]] = {}
    for r in records:
        by_setting.setdefault(setting_of(r), []).append(r)
    base_times = times.get(BASELINE, {})
    base_steps = {seed_of(r): step_ms(r) for r in by_setting.get(BASELINE, []) if r.status == "ok" and step_ms(r)}
    rows = []
    for setting in sorted(by_setting, key=lambda s: (s != BASELINE, list(by_setting).index(s))):
        runs = by_setting[setting]
        ok = [r for r in runs if r.status == "ok" and step_ms(r)]
        mine = times.get(setting, {})
        reached = [t for t in mine.values() if t is not None]
        zen = [r.metrics["zenflow"] for r in ok if r.metrics.get("zenflow")]  # what a ZenFlow engine decided
        intervals = [u for r in ok for _, u in chosen_intervals(r)]
        rows.append({
            "workload": workload, "target": "common" if common else BASELINE, "setting": setting,
            "engine": runs[0].engine,
            **{k: block_of(runs[0]).get(k) for k in KNOBS}, "auto": is_auto(runs[0]), "runs": len(runs),
            **columns("step_ms", log_interval([step_ms(r) for r in ok]) if ok else None),
            **columns("step_time_ratio", ratio_interval({seed_of(r): step_ms(r) for r in ok}, base_steps)),
            "time_to_target_s": statistics.median(reached) if mine and len(reached) == len(mine) else None,
            "reached": len(reached), "compared": len(mine),
            **columns("relative_time", relative_time(mine, base_times)),
            "resolved_select_interval": zen[0].get("select_interval") if zen else None,
            "host_updates": statistics.median(z["host_updates"] for z in zen) if zen else None,
            "interval_median": statistics.median(intervals) if intervals else None,
            "interval_min": min(intervals, default=None), "interval_max": max(intervals, default=None),
            "note": what_happened(runs)})
    return rows, facts


def row_iv(row: dict[str, Any], key: str) -> Interval | None:
    if row.get(key) is None:
        return None
    return Interval(row[key], row.get(f"{key}_low"), row.get(f"{key}_high"), int(row.get("compared") or 1))


def auto_verdict(auto: Interval | None, fixed: dict[str, Interval | None]) -> dict[str, Any]:
    """RULE on one "auto" setting's relative time to target and the fixed settings' (None: missed the target with
    some seed): "holds", "fails" or "undecided", with the numbers it was decided on."""
    reached = {s: iv for s, iv in fixed.items() if iv is not None}
    if not reached:
        return {"verdict": "undecided", "why": "no fixed setting reached the target with every seed"}
    best = min(reached, key=lambda s: reached[s].center)
    facts = {"best_fixed": best, "best_fixed_relative_time": reached[best].center,
             "best_fixed_low": reached[best].low, "best_fixed_high": reached[best].high,
             "auto_relative_time": auto and auto.center, "auto_low": auto and auto.low, "auto_high": auto and auto.high}
    if auto is None:
        return {"verdict": "fails", "why": "auto missed the target with some seed", **facts}
    if reached[best].high is None:
        return {"verdict": "undecided", "why": "one seed: the best fixed setting has no interval", **facts}
    holds = auto.center <= reached[best].high
    why = (f"{auto.center:.2f}× is {'within or below' if holds else 'above'} {best}'s "
           f"[{reached[best].low:.2f}–{reached[best].high:.2f}]")
    return {"verdict": "holds" if holds else "fails", "why": why, **facts}


def verdicts(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each "auto" setting of ours judged by RULE against the fixed ref-zenflow settings of the same workload."""
    ours = [r for r in rows if r["engine"] == OURS]
    fixed = {r["setting"]: row_iv(r, "relative_time") for r in ours if not r["auto"]}
    return {r["setting"]: auto_verdict(row_iv(r, "relative_time"), fixed) for r in ours if r["auto"]}


def table(rows: list[dict[str, Any]], judged: dict[str, dict[str, Any]]) -> str:
    body = []
    for r in rows:
        step = interval_cell(row_iv(r, "step_ms")).replace("1 run", "(1 run)")
        chose = (f"U {fmt(r['interval_median'], 'g')} ({fmt(r['interval_min'], 'g')}–{fmt(r['interval_max'], 'g')})"
                 if r["interval_median"] is not None else "—")
        body.append([r["setting"], "auto" if r["auto"] else "fixed", r["runs"],
                     f"{fmt(r['step_ms'], '.1f')} {step}" if r["step_ms"] is not None else "—",
                     fmt(r["time_to_target_s"], ".1f"),
                     "1.00× (baseline)" if r["setting"] == BASELINE else ratio_cell(row_iv(r, "relative_time")),
                     f"{r['reached']} of {r['compared']}", chose, fmt(r["resolved_select_interval"], "g"),
                     (judged.get(r["setting"]) or {}).get("verdict", ""), r["note"]])
    return markdown(body, ["setting", "kind", "runs", "step ms [95%]", "time to target s",
                           "time to target / ref-offload's", "reached (seeds)", "intervals chosen", "S resolved",
                           "verdict", "note"])


def auto_traces(records: Sequence[RunRecord]) -> dict[str, list[tuple[int, list[tuple[int, int]], list[int]]]]:
    """"auto" setting -> per ok run: its seed, the intervals it chose at each boundary, its selection steps."""
    traces: dict[str, list[tuple[int, list[tuple[int, int]], list[int]]]] = {}
    for r in records:
        if is_auto(r):
            traces.setdefault(setting_of(r), []).extend(
                [(seed_of(r), chosen_intervals(r), selections(r))] if r.status == "ok" else [])
    return traces


def knobs_report(by_workload: dict[str, list[RunRecord]], out: Path, env: dict[str, Any]) -> dict[str, Any]:
    """knobs.md/.csv, verdict.json, frontier.png and auto-intervals.png in `out` from each workload's records;
    returns the verdicts by workload."""
    out.mkdir(parents=True, exist_ok=True)
    every = [r for records in by_workload.values() for r in records]
    known = env or any(r.environment.get("cpu") for r in every)
    label = runs_hardware_label(every, env) if known else "hardware not recorded"
    text, all_rows, judged_all, traces = [f"# ZenFlow's knobs: fixed against \"auto\" — {label}", ""], [], {}, {}
    common_all: dict[str, Any] = {}
    for workload, records in by_workload.items():
        traces[workload] = auto_traces(records)
        seeds = sorted({seed_of(r) for r in records})
        text += [f"## {workload} ({len(records)} runs, seeds {', '.join(map(str, seeds))})", ""]
        for common, verdicts_at in ((False, judged_all), (True, common_all)):
            rows, facts = setting_rows(records, workload, common)
            judged = verdicts_at[workload] = verdicts(rows)
            all_rows += [{**r, "verdict": (judged.get(r["setting"]) or {}).get("verdict")} for r in rows]
            targets = ", ".join(f"seed {s} {v:.4g}" for s, v in sorted(facts["targets"].items()))
            said = COMMON if common else TARGETS[facts["kind"]].format(window=facts["window"])
            heading = "At the common target" if common else "At ref-offload's final result"
            text += [f"### {heading}", "",
                     f"Target: {said} ({targets}).", "", table(rows, judged), ""]
            text += [f"- {s}: **{v['verdict']}** ({v['why']})" for s, v in judged.items()] + [""]
    text += [f"Verdict rule: {RULE}.", "",
             "- Step time: the mean over whole update cycles (\"auto\": over every timed step), geometric mean over "
             "the seeds with its 95% interval. Intervals chosen: the steps between host updates the runs' step records "
             "name (median, range; a selection also forces one). S resolved: the select interval the optimizer "
             "used.",
             "- DeepSpeed's ZenFlow runs \"auto\" as shipped: its note says what it did (docs/design.md §7 A, B); its "
             "engine does not record its boundaries per step, so it has no intervals here.", ""]
    write_text_atomic(out / "knobs.md", "\n".join(text))
    write_csv(all_rows, out / "knobs.csv")
    write_json_atomic(out / "verdict.json", {"rule": RULE, "workloads": judged_all,
                                             "common_target": {"target": COMMON, "workloads": common_all}})
    frontier_figure(all_rows, out / "frontier.png", f"Time to target against step time — {label}")
    intervals_figure(traces, out / "auto-intervals.png", f"Intervals \"auto\" chose — {label}")
    print("\n".join(text))
    return judged_all

