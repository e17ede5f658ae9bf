"""The Llama scenario's engine table (Markdown and CSV) and figure, made from run records only; written with the
shared helpers of zenflow/harness/tables.py."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from zenflow.costmodel import host_ceiling
from zenflow.harness.configs import DEEPSPEED_EXAMPLES_BLOCK, OVERHEAD_ENGINE, PEER_ENGINES
from zenflow.harness.deadline import OUT_OF_TIME
from zenflow.harness.engines.registry import ASKED, ENGINE_SPECS, engine_names, zenflow_engines
from zenflow.harness.memory_plan import NEEDS
from zenflow.harness.records import RunRecord, skip_reason
from zenflow.harness.tables import MISSING, fmt, markdown, write_csv, write_text_atomic
from zenflow.reports.convergence import convergence_report
from zenflow.reports.headline_figure import BASELINE, headline_figure  # BASELINE: every engine's speedup
from zenflow.reports.intervals import (
    Interval,
    columns,
    interval_cell,
    log_interval,
    ratio_cell,
    ratio_interval,
    row_interval,
)
from zenflow.reports.step_trace import step_trace_report
from zenflow.telemetry.environment import hardware_label
from zenflow.telemetry.machine_load import BUSY_BOUND
from zenflow.telemetry.machine_load import busy as machine_busy

COLUMNS = ("engine", "runs", "median step ms", "cycle mean ms", "95% interval", "accumulate step ms",
           "update step ms", "compute ms", "I/O ms", "stall ms", "speedup vs ds-zero-offload [95%]", "stall reduction",
           "bytes/step ÷ model bytes", "final loss")


def engine_rank(engine: str) -> tuple[int, str]:
    """Sort key: the registered engines in table order, then any other by name."""
    names = engine_names()
    return (names.index(engine) if engine in names else len(names), engine)


def runs_hardware_label(records: Sequence[RunRecord], fallback_env: dict[str, Any]) -> str:
    """The hardware the runs were made on (from their records), not the machine remaking the report; at cpu-scale
    with the runs' placement (harness/placement.py): every title says which, as two placements never share one."""
    env = next((r.environment for r in records if r.environment.get("cpu")), fallback_env)
    label = hardware_label(env)
    if not label.startswith("cpu-scale"):
        return label  # a GPU is the device: there is no placement to name
    names = sorted({run_placement(r) for r in records}) or ["shared"]
    return f"{label}, placement {' + '.join(PLACEMENT_LABELS.get(n, n) for n in names)}"


PLACEMENT_LABELS = {"shared": "shared", "split": "split (GPU analog)"}


class MixedPlacementError(ValueError):
    """Records of runs at different placements: one table would compare the GPU analog with shared cores."""


def run_placement(record: RunRecord) -> str:
    """Where the run's phases ran (harness/placement.py); records from before it was recorded ran shared."""
    return str(record.protocol.get("placement", "shared"))


def check_one_placement(records: Sequence[RunRecord]) -> None:
    """Refuse to tabulate (or compare) runs of different placements together."""
    _check_one(records, run_placement, "placement", MixedPlacementError(
        "records of different placements in one table ({found}): a split run (the GPU analog) is not comparable "
        "with a shared one; tabulate each placement separately"))


def _check_one(records: Sequence[RunRecord], key: Any, what: str, error: ValueError, ok_only: bool = False) -> None:
    """Raise `error` (its message's {found}: each value of `key` with its engines) when the records hold more
    than one value of `key` (of the ok ones only, `ok_only`)."""
    found: dict[Any, set[str]] = {}
    for r in records:
        if r.status == "ok" or not ok_only:
            found.setdefault(key(r), set()).add(r.engine)
    if len(found) > 1:
        listed = "; ".join(f"{what} {value}: {', '.join(sorted(engines, key=engine_rank))}"
                           for value, engines in sorted(found.items()))
        raise type(error)(str(error.args[0]).format(found=listed))


class MixedWorldSizeError(ValueError):
    """Records of runs on different numbers of GPUs: one table would compare N-way sharded with single-GPU runs."""


def run_world_size(record: RunRecord) -> int:
    """Processes (GPUs) the run trained on; records from before it was recorded ran on one."""
    return int(record.protocol.get("world_size", record.protocol.get("num_gpus", 1)))


def check_one_world_size(records: Sequence[RunRecord]) -> None:
    """Refuse to tabulate runs of different world sizes together."""
    _check_one(records, run_world_size, "world size", MixedWorldSizeError(
        "records of different world sizes in one table ({found}): a multi-GPU DeepSpeed run is not comparable with "
        "single-GPU runs; tabulate each world size separately"), ok_only=True)


def cycles_by_repeat(records: Sequence[RunRecord]) -> dict[str, dict[int, float]]:
    """Each engine's cycle-mean step time per repeat (the key that pairs runs across engines: run r of every engine
    shares its seed and its stretch of machine time, engines interleaved). Mixed placements are refused."""
    check_one_placement(records)
    out: dict[str, dict[int, float]] = {}
    for r in records:
        if r.status == "ok" and r.summary.get("cycle_mean_ms"):
            out.setdefault(r.engine, {})[int(r.protocol.get("repeat", 0))] = r.summary["cycle_mean_ms"]
    return out


def speedup(by_repeat: dict[str, dict[int, float]], slow: str, fast: str) -> Interval | None:
    """slow's step time / fast's, paired by repeat, with its 95% interval (intervals.ratio_interval)."""
    if slow not in by_repeat or fast not in by_repeat:
        return None
    return ratio_interval(by_repeat[slow], by_repeat[fast])


def engine_rows(records: Sequence[RunRecord]) -> list[dict[str, Any]]:
    """One row per engine: medians over its repeated runs of each run's summary value, the 95% interval of its
    cycle-mean step time, and its speedup over BASELINE paired by repeat with its interval. An engine whose runs
    were all skipped (DeepSpeed not installed) gets an empty row that says so. Mixed world sizes and placements are
    refused."""
    check_one_world_size(records)
    check_one_placement(records)
    by_engine: dict[str, list[RunRecord]] = {}
    skipped: dict[str, str] = {}
    for r in records:
        if r.status == "ok":
            by_engine.setdefault(r.engine, []).append(r)
        elif r.status == "skipped":
            skipped[r.engine] = skipped_cell(r.error)
    rows = []
    for engine in sorted(set(by_engine) | set(skipped), key=engine_rank):
        if engine not in by_engine:
            rows.append(_empty_row(engine, skipped[engine]))
            continue
        runs = by_engine[engine]

        def med(key: str, runs: list[RunRecord] = runs) -> float | None:
            vals = [r.summary.get(key) for r in runs if r.summary.get(key) is not None]
            return statistics.median(vals) if vals else None

        cycle = log_interval([r.summary["cycle_mean_ms"] for r in runs])
        rows.append({"engine": engine, "runs": len(runs),
                     "median_step_ms": statistics.median(r.summary["step_ms"]["median"] for r in runs),
                     "cycle_mean_ms": med("cycle_mean_ms"), "cycle_mean_low": cycle.low,
                     "cycle_mean_high": cycle.high, "accumulate_step_ms": med("accumulate_step_ms"),
                     "update_step_ms": med("update_step_ms"), "compute_ms": med("compute_ms"),
                     "io_ms": med("io_ms"), "stall_ms": med("stall_ms"),
                     "bytes_ratio": med("grad_param_bytes_per_step_over_model_bytes"),
                     "final_loss": med("final_loss"),
                     "stall_includes_io": any(r.protocol.get("stall_includes_io") for r in runs),
                     "world_size": run_world_size(runs[0]), "note": None})
    index = {row["engine"]: row for row in rows}
    pairs = cycles_by_repeat(records)
    for row in rows:
        row |= columns("speedup", speedup(pairs, BASELINE, row["engine"]))
        spec = ENGINE_SPECS.get(row["engine"])
        ref = index.get(spec.stall_baseline) if spec and spec.stall_baseline else None
        row["stall_reduction"] = (1 - row["stall_ms"] / ref["stall_ms"]
                                  if ref and ref["stall_ms"] and row["stall_ms"] is not None else None)
    return rows


def skipped_cell(error: str | None) -> str:
    """A skipped engine's table cell: not installed, does not fit this host (the memory plan), or not run here."""
    error = error or ""
    if "not installed" in error:
        return "not installed"
    if error.startswith(NEEDS):
        return "does not fit: " + error.split(",")[0]  # "needs ~X GiB host (...)": the rest is in the notes
    if error.startswith(OUT_OF_TIME):  # the command's deadline came first (deadline.py): the time is in the notes
        return "skipped: out of time"
    return "not run here"


def _empty_row(engine: str, note: str) -> dict[str, Any]:
    keys = ("median_step_ms", "cycle_mean_ms", "cycle_mean_low", "cycle_mean_high", "accumulate_step_ms",
            "update_step_ms", "compute_ms", "io_ms", "stall_ms", "bytes_ratio", "final_loss")  # a measured row's order
    return {"engine": engine, "runs": 0, **dict.fromkeys(keys), "stall_includes_io": False, "world_size": None,
            "note": note}


def table(rows: list[dict[str, Any]], tablefmt: str = "github") -> str:
    """The engine table (COLUMNS) of engine_rows' rows."""
    body = [[r["engine"] + (f" ({r['note']})" if r.get("note") else ""), r["runs"],
             fmt(r["median_step_ms"]), fmt(r["cycle_mean_ms"]), _interval(r, "cycle_mean"),
             fmt(r["accumulate_step_ms"]), fmt(r["update_step_ms"]), fmt(r["compute_ms"]),
             "(in stall)" if r["stall_includes_io"] else fmt(r["io_ms"]), fmt(r["stall_ms"]),
             "1.00× (baseline)" if r["engine"] == BASELINE and r["runs"] else ratio_cell(row_interval(r, "speedup")),
             fmt(r["stall_reduction"] and 100 * r["stall_reduction"], ".1f") + ("%" if r["stall_reduction"] else ""),
             fmt(r["bytes_ratio"], ".3f", missing=MISSING if r.get("note") else "not measured"),
             fmt(r["final_loss"], ".3f")]
            for r in rows]
    return markdown(body, COLUMNS, tablefmt=tablefmt)


def seeds_line(records: Sequence[RunRecord]) -> str:
    """The seeds the runs used, per repeat (workload.seed: model init and data order)."""
    seeds = sorted({(int(r.protocol.get("repeat", 0)), r.workload.get("seed")) for r in records if r.status == "ok"})
    if not seeds:
        return ""
    return "Seeds by repeat: " + ", ".join(f"{rep}: {seed}" for rep, seed in seeds) + "."


def _interval(row: dict[str, Any], key: str) -> str:
    return interval_cell(row_interval(row, key, f"{key}_ms")) if row["runs"] else MISSING


RANKS = "ranks per run, each on its shard of every batch: torchrun for ours, the DeepSpeed launcher for ds-*"


def scenario_report(records: list[RunRecord], out: Path, env: dict[str, Any]) -> str:
    """The Llama scenario's table.md/.csv and figure.png in `out`, from its records (reproduce/llama7b.py)."""
    timed = [r for r in records if r.protocol.get("telemetry", True)]
    rows = engine_rows(timed)  # refuses records of different world sizes
    label = runs_hardware_label(records, env)
    first = next((r for r in records if r.status == "ok"), records[0])  # a skipped record has no model facts
    w, params = first.workload, first.model.get("parameters", 0) / 1e6
    gpus = max((r["world_size"] or 1 for r in rows), default=1)
    block = next((r.config["zero_optimization"]["zenflow"] for r in records if r.status == "ok"
                  and r.engine in ENGINE_SPECS and ENGINE_SPECS[r.engine].zenflow_block == ASKED),
                 DEEPSPEED_EXAMPLES_BLOCK)  # the records' own block: a ZenFlow engine's
    text = [f"# Llama-2-7B scenario — {label}", "",
            f"Model: {w.get('model')} ({params:.1f}M params, {w.get('dtype')}), sequence {w.get('seq_len')}, "
            f"micro-batch {w.get('micro_batch')}, data: {w.get('data_source')}. World size {gpus} "
            f"({RANKS if gpus > 1 else 'every engine on one device'}).",
            f"ZenFlow block: {block}. Step times are means over whole update cycles; medians of the runs, "
            "with the 95% interval of their geometric mean (Student's t on the logs). Speedups and ratios: "
            "geometric mean of the ratios paired by repeat (run r of every engine: one seed, engines interleaved), "
            f"95% interval; \"no difference\" where it includes 1. {seeds_line(timed)}",
            "", table(rows), ""]
    ratios = ratio_rows(cycles_by_repeat(timed))
    text += regime_notes(rows, records, ratios)
    ceiling = host_ceiling_note(rows, first, block, out)
    text += [ceiling] if ceiling else []
    write_text_atomic(out / "table.md", "\n".join(text) + "\n")
    write_csv(rows, out / "table.csv")
    write_csv(ratios, out / "ratios.csv")
    convergence_report(timed, {r["engine"]: r for r in rows}, out, label)  # loss against wall time
    step_trace_report(timed, out, label)  # each step's time by kind, ZenFlow against ZeRO-Offload
    if any(r["cycle_mean_ms"] for r in rows):  # the paper's comparison, then the rest on their own scale
        headline_figure(rows, timed, out / "figure.png", "ZenFlow vs ZeRO-Offload, Llama scenario",
                        f"{label}; {params:.0f}M params, {w.get('dtype')}, seq {w.get('seq_len')}, world size {gpus}")
    print("\n".join(text))
    return "\n".join(text)


def host_ceiling_note(rows: list[dict[str, Any]], first: RunRecord, block: dict[str, Any],
                      out: Path) -> str | None:
    """The speedup ref-zenflow / ref-offload beside the ceiling the host's measured rates allow (host_ceiling.py),
    when the sequence measured them into this folder (or the result set above a `.partial/`)."""
    rates = host_ceiling.load(out) or host_ceiling.load(out.parent)
    index = {r["engine"]: r for r in rows}
    ours = next(spec for spec in zenflow_engines() if spec.family == "ours")  # the rates are our host worker's
    base, zen = (index.get(e, {}).get("cycle_mean_ms") for e in (ours.stall_baseline, ours.name))
    interval = block.get("update_interval") if isinstance(block.get("update_interval"), int) else 1
    return host_ceiling.ceiling_note(rates, first.model.get("column_parameters", 0), block.get("topk_ratio", 0.0),
                                     interval, base, base / zen if base and zen else None)


def ratio_rows(pairs: dict[str, dict[int, float]]) -> list[dict[str, Any]]:
    """Every step-time ratio the notes state, paired by repeat with its 95% interval (ratios.csv): each ZenFlow
    engine against its every-step offload engine and its same-frequency control, against every peer, and
    ref-zenflow's two targets. `numerator`'s step time / `denominator`'s: above 1, the denominator is faster."""
    wanted = [("every-step", spec.stall_baseline, spec.name) for spec in zenflow_engines()]
    wanted += [("same-frequency", spec.control, spec.name) for spec in zenflow_engines()]
    wanted += [("peer", peer, spec.name) for spec in zenflow_engines() for peer in PEER_ENGINES]
    wanted += [("target ≤ 1.5", "ref-zenflow", "no-offload"), ("target ≤ 0.5", "ref-zenflow", "ds-zenflow")]
    rows = []
    for kind, numerator, denominator in wanted:
        iv = speedup(pairs, numerator, denominator)  # None when either engine has no timed run
        if iv is not None:
            rows.append({"kind": kind, "numerator": numerator, "denominator": denominator, "ratio": iv.center,
                         "low": iv.low, "high": iv.high, "runs": iv.n, "cell": ratio_cell(iv)})
    return rows


def _cell(ratios: list[dict[str, Any]], kind: str, numerator: str, denominator: str) -> str | None:
    return next((r["cell"] for r in ratios if (r["kind"], r["numerator"], r["denominator"])
                 == (kind, numerator, denominator)), None)


def peer_notes(index: dict[str, dict[str, Any]], ratios: list[dict[str, Any]]) -> list[str]:
    """ZenFlow (ours and DeepSpeed's) against the systems a user would pick instead (configs.PEER_ENGINES)."""
    peers = [p for p in PEER_ENGINES if p in index]
    notes = []
    for zen in (spec.name for spec in zenflow_engines()):
        if not index.get(zen, {}).get("cycle_mean_ms") or not peers:
            continue
        said = [f"{p} {_cell(ratios, 'peer', p, zen) or 'not run'}" for p in peers]
        notes.append(f"- {zen} speedup over the peers (step time ratio, 95% interval): {', '.join(said)}")
    return notes


def same_frequency_notes(ratios: list[dict[str, Any]]) -> list[str]:
    """ZenFlow's gain over ZeRO-Offload at every-step updates and at the same update frequency (the -gas controls:
    gradient accumulation = the update interval), each family against its own offload engine."""
    notes = []
    for zen, every, same in ((spec.name, spec.stall_baseline, spec.control) for spec in zenflow_engines()):
        over_every, over_same = _cell(ratios, "every-step", every, zen), _cell(ratios, "same-frequency", same, zen)
        if over_every and over_same:
            notes.append(f"- {zen} speedup over {every} (host optimizer every step): {over_every}; over {same} "
                         f"(host optimizer as often as ZenFlow's, gradient accumulation): {over_same}")
    return notes


def regime_notes(rows: list[dict[str, Any]], records: list[RunRecord],
                 ratios: list[dict[str, Any]] | None = None) -> list[str]:
    """Which regime this is (host optimizer vs compute) and the telemetry overhead, in plain words. `ratios`:
    ratio_rows of the timed records (computed here when not given)."""
    notes = []
    index = {r["engine"]: r for r in rows}
    if ratios is None:
        ratios = ratio_rows(cycles_by_repeat([r for r in records if r.protocol.get("telemetry", True)]))
    offload = index.get("ref-offload")
    if offload and offload["compute_ms"]:
        ratio = offload["stall_ms"] / offload["compute_ms"]
        notes.append("- Regime: host optimizer (ref-offload stall: host accumulation + CPU AdamW of every column) / "
                     f"compute = {ratio:.2f}" + (" — the host optimizer costs as much as compute or more." if ratio >= 1
                                       else " — the host optimizer costs about as much as compute." if ratio >= 0.9
                                       else " — compute dominates."))
    notes += same_frequency_notes(ratios) + peer_notes(index, ratios)
    notes += [f"- ref-zenflow / {r['denominator']} = {r['cell'].replace('×', '')} ({r['kind']})" for r in ratios
              if r["kind"].startswith("target")]
    own = [r.summary["telemetry_ms"] / r.summary["cycle_mean_ms"] for r in records if r.status == "ok"
           and r.engine == OVERHEAD_ENGINE and r.summary.get("telemetry_ms") is not None and r.summary["cycle_mean_ms"]]
    if own:
        notes.append(f"- Telemetry overhead, measured directly (time inside the timeline's callbacks / step time, "
                     f"{OVERHEAD_ENGINE}): {100 * statistics.median(own):.4f}% (target ≤ 1%)")
    checked = [r for r in records if r.status == "ok" and r.engine == OVERHEAD_ENGINE]
    with_t = [r.summary["cycle_mean_ms"] for r in checked if r.protocol.get("telemetry", True)]
    without = [r.summary["cycle_mean_ms"] for r in checked if not r.protocol.get("telemetry", True)]
    if with_t and without:
        overhead = statistics.median(with_t) / statistics.median(without) - 1
        notes.append(f"- Same run with vs without the optimizer observer ({OVERHEAD_ENGINE}, median of runs): "
                     f"{100 * overhead:+.1f}% (separate runs: this includes the run-to-run noise of a shared "
                     "machine; the direct measurement above isolates the telemetry itself)")
    notes += host_state_notes(records)
    notes += load_notes(records)
    failed = [f"{r.engine}" for r in records if r.status not in ("ok", "skipped")]
    if failed:
        notes.append(f"- FAILED runs (see their records): {', '.join(failed)}")
    skipped = {r.engine: skip_reason(r.error).strip() for r in records  # a cell's runs, not the overhead check's
               if r.status == "skipped" and r.protocol.get("telemetry", True)}
    for engine in sorted(skipped, key=engine_rank):
        notes.append(f"- Not run: {engine}: {skipped[engine]}")
    return notes


def host_state_notes(records: list[RunRecord]) -> list[str]:
    """With several ranks: each engine's host memory per rank (the optimizer's host state where it counts it, and the
    process's peak resident set), medians of rank 0's records. One process: none (the memory table has them)."""
    ranks = [r for r in records if r.status == "ok" and run_world_size(r) > 1]
    by_engine: dict[str, list[RunRecord]] = {}
    for r in sorted(ranks, key=lambda r: engine_rank(r.engine)):
        by_engine.setdefault(r.engine, []).append(r)
    if not by_engine:
        return []
    cells = []
    for engine, runs in by_engine.items():
        held = [r.metrics["host_state_bytes"] for r in runs if r.metrics.get("host_state_bytes")]
        rss = [r.metrics["peak_rss_bytes"] for r in runs if r.metrics.get("peak_rss_bytes")]
        state = f"host state {statistics.median(held) / 1e6:.0f} MB" if held else "host state not counted"
        cells.append(f"{engine} {state}" + (f", peak RSS {statistics.median(rss) / 1e6:.0f} MB" if rss else ""))
    return [f"- Host memory per rank (rank 0's records, medians): {'; '.join(cells)}"]


def load_notes(records: list[RunRecord]) -> list[str]:
    """The rest of the machine's share of the CPU during each run's timed steps (kernel counters, machine_load.py):
    the median and worst run, and every run above the bound by name, whose row is then not comparable."""
    loads = [(r, r.protocol.get("machine_load")) for r in records if r.status == "ok"]
    measured = [(r, load) for r, load in loads if load and load.get("measured")]
    if not measured:
        return []
    share = sorted((load["outside_cpu_fraction"] + load["steal_fraction"], r.engine) for r, load in measured)
    notes = [f"- Machine load during the timed steps (other processes + hypervisor steal, from the kernel's "
             f"counters): median {100 * statistics.median(s for s, _ in share):.1f}% of the CPU, worst "
             f"{100 * share[-1][0]:.1f}% ({share[-1][1]}); {len(measured)} of {len(loads)} runs measured"]
    busy = [f"{r.engine} ({100 * load['outside_cpu_fraction']:.0f}% other processes, "
            f"{100 * load['steal_fraction']:.0f}% steal)" for r, load in measured if machine_busy(load)]
    if busy:
        notes.append(f"- BUSY MACHINE (over {100 * BUSY_BOUND:.0f}% of the CPU elsewhere): {', '.join(busy)}: these "
                     "rows are not comparable with the others; rerun on a quiet machine")
    return notes
