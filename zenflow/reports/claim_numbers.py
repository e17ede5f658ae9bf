"""The numbers of each claim (zenflow/reports/claim_list.py), taken from the committed files it declares.

Each function gets the claim's `Files` (only its declared files can be read) and returns the numbers its templates
and its verdict rule use: floats for rules, formatted cells where the tables already format them.
"""

from __future__ import annotations

from typing import Any

from zenflow.costmodel.model import transfer_bytes
from zenflow.harness.configs import CLAIM_CONVERGENCE_ENGINES, CLAIM_GLUE_ENGINES, CLAIM_TIMED_ENGINES
from zenflow.harness.records import RunRecord
from zenflow.harness.when import runs_day
from zenflow.reports.claim import Files
from zenflow.reports.intervals import ratio_cell, row_interval

XEON, EPYC = "cpu-scale-intel-xeon-2c", "cpu-scale-amd-epyc-2c"
LLAMA_XEON, LLAMA_EPYC, COST = f"llama7b/{XEON}", f"llama7b/{EPYC}", f"costmodel/{EPYC}"
CONVERGENCE = f"{LLAMA_XEON}/convergence"
CORES = f"{LLAMA_XEON}/cores"
GLUE_XEON, GLUE_EPYC = f"glue/{XEON}", f"glue/{EPYC}"
STUDY, SCALING = f"{GLUE_EPYC}/study", f"scaling/{EPYC}"
GLUE_CURVE = f"{GLUE_XEON}/curve"
# DeepSpeed's ZenFlow as shipped and as its authors intended (ds-zenflow-intended), interleaved with its ZeRO-Offload
CONVERGENCE_DS, GLUE_CURVE_DS = f"{LLAMA_EPYC}/convergence", f"{GLUE_EPYC}/curve"
SHIPPED, INTENDED = "ds-zenflow", "ds-zenflow-intended"
ZF_RECORD = f"{LLAMA_XEON}/ref-zenflow-r0.json"  # the record that says where, when and with which block


def ran(f: Files, name: str) -> dict[str, str]:
    """Where and when a claim's runs ran, from one of its run records: its hardware id and day (harness/when.py)."""
    path = f.path(name).resolve()
    record = RunRecord.read(path)
    return {"hw": record.environment["hardware_id"], "day": runs_day([record], path.parent)}


def bounds(row: dict[str, Any], key: str, prefix: str) -> dict[str, float | None]:
    """A row's interval as plain numbers for a verdict rule: {prefix}_low and {prefix}_high (None with one run)."""
    return {f"{prefix}_low": row.get(f"{key}_low"), f"{prefix}_high": row.get(f"{key}_high")}


def paper_range(cell: str) -> list[float]:
    """The numbers of a paper cell as the projection writes it: "3.2–4.1×" → [3.2, 4.1]."""
    return [float(x) for x in cell.rstrip("×%").replace("−", "-").split("–")]


def _number(cell: str) -> float:
    """A formatted table cell as a number: "2,938×" → 2938.0."""
    return float(cell.rstrip("×%").replace(",", ""))


def _speedup(row: dict[str, Any]) -> str:
    """A table row's speedup with its 95% interval, as the table writes it ("no difference" where it includes 1)."""
    return ratio_cell(row_interval(row, "speedup"))


def _then(row: dict[str, Any], step_key: str, target_key: str, short_of: str) -> str:
    """"engine 1.70× [1.6–1.8] → **1.96× [1.9–2.0]**": a step-time speedup and what survives of it to a target (each
    with its interval over the rounds), or "not reached"."""
    target = row_interval(row, target_key)
    after = f"**{ratio_cell(target)}**" if target else f"**not reached** ({short_of})"
    return f"{row['engine']} {ratio_cell(row_interval(row, step_key))} → {after}"


def _survived(row: dict[str, Any], target_key: str, over: str, final: str) -> str:
    """_then for a row of a time-to-target table: where the engine missed the target in some rounds or seeds (`over`),
    how often, then `final` (its final result)."""
    short = row["compared"] - row["reached"]
    missed = f"missed in {short:.0f} of {row['compared']:.0f} {over}; " if row["reached"] else ""
    return _then(row, "step_time_speedup", target_key, f"{missed}{final}")


def _block(record: dict[str, Any]) -> dict[str, Any]:
    return record["config"]["zero_optimization"]["zenflow"]


def _scenario(record: dict[str, Any]) -> str:
    w = record["workload"]
    return f"{record['model']['parameters'] / 1e6:.1f}M-param Llama, {w['dtype']}, seq {w['seq_len']}"


def _days(dating: dict[str, Any]) -> str:
    """When a validation's runs were taken, in days ("2026-11-24" or "2026-11-22 – 2026-11-24"), and how far from
    its calibration at most (a count is only as good as the day its runs and calibration share)."""
    first, last = (t[:10] for t in dating["runs_taken"])
    apart = f"≤ {dating['apart_h']:.0f} h" if dating["apart_h"] is not None else "an unknown time"
    over = f", beyond the {dating['bound_h']:.0f} h bound" if dating["over_bound"] else ""
    return f"runs of {first if first == last else f'{first} – {last}'}, {apart} from the calibration{over}"


def _within(rows: list[dict[str, Any]], pct: float = 15.0) -> tuple[int, int]:
    """Validation points (DeepSpeed's fitted ones excluded) whose |error| is within pct, and how many there are."""
    points = [r for r in rows if r["fitted_here"] != "True"]
    return sum(abs(r["error_pct"]) <= pct for r in points), len(points)


# ---- the numbers of each claim, from its files -----------------------------------------------------------------
def speedup_numbers(f: Files) -> dict[str, Any]:
    run = f.by(f"{LLAMA_XEON}/table.csv", "engine")
    proj = {(r["gpu"], r["model"]): r for r in f.csv(f"{COST}/projection.csv")}
    band = {(r["gpu"], r["model"]): r for r in f.csv(f"{COST}/projection-band.csv")}
    inv = f.json(f"{COST}/inverse.json")
    a100, h100 = proj[("a100", "Llama-2-7B")], proj[("h100", "Llama-2-7B")]
    xeon_in, xeon_n = _within(f.csv(f"costmodel/{XEON}/validation.csv"))
    epyc_in, epyc_n = _within(f.csv(f"{COST}/validation.csv"))
    xeon_days, epyc_days = _days(f.json(f"costmodel/{XEON}/validation.json")), _days(f.json(f"{COST}/validation.json"))
    record = f.json(f"{LLAMA_XEON}/ref-zenflow-r0.json")
    return {"zf": _speedup(run["ref-zenflow"]), "zf_ms": run["ref-zenflow"]["cycle_mean_ms"],
            "ds_ms": run["ds-zero-offload"]["cycle_mean_ms"], "ds_zf": _speedup(run["ds-zenflow"]),
            "runs": int(run["ref-zenflow"]["runs"]),
            "ours": _ratios(f)[("every-step", "ref-offload", "ref-zenflow")],
            "a100_paper": a100["paper_speedup"], "h100_paper": h100["paper_speedup"],
            "a100": a100["speedup"], "h100": h100["speedup"],
            "a100_low": band[("a100", "Llama-2-7B")]["low"], "a100_high": band[("a100", "Llama-2-7B")]["high"],
            "h100_low": band[("h100", "Llama-2-7B")]["low"], "h100_high": band[("h100", "Llama-2-7B")]["high"],
            "xeon_in": xeon_in, "xeon_n": xeon_n, "epyc_in": epyc_in, "epyc_n": epyc_n, "xeon_days": xeon_days,
            "epyc_days": epyc_days,
            "rho_blog": inv["rho_blog"], "rho": inv["projection_rho"], "scenario": _scenario(record),
            **bounds(run["ref-zenflow"], "speedup", "zf"),
            "paper_low": min(paper_range(a100["paper_speedup"]) + paper_range(h100["paper_speedup"])),
            **ran(f, ZF_RECORD)}


def stall_numbers(f: Files) -> dict[str, Any]:
    run = f.by(f"{LLAMA_XEON}/table.csv", "engine")
    proj = {(r["gpu"], r["model"]): r for r in f.csv(f"{COST}/projection.csv")}
    a100, h100 = proj[("a100", "Llama-2-7B")], proj[("h100", "Llama-2-7B")]
    block = _block(f.json(f"{LLAMA_XEON}/ref-zenflow-r0.json"))
    return {"zf_red": 100 * run["ref-zenflow"]["stall_reduction"], "zf_stall": run["ref-zenflow"]["stall_ms"],
            "off_stall": run["ref-offload"]["stall_ms"], "ds_red": 100 * run["ds-zenflow"]["stall_reduction"],
            "a100_paper": a100["paper_stall"], "h100_paper": h100["paper_stall"],
            "a100_red": 100 * a100["stall_reduction"], "h100_red": 100 * h100["stall_reduction"],
            "topk": block["topk_ratio"], "interval": block["update_interval"], **ran(f, ZF_RECORD)}


# The blog's bytes per step in model sizes: "1.13× model size vs 2×" (ZenFlow, ZeRO-Offload).
PAPER_BYTES = (1.13, 2.0)


def pcie_numbers(f: Files) -> dict[str, Any]:
    run = f.by(f"{LLAMA_XEON}/table.csv", "engine")
    block = _block(f.json(f"{LLAMA_XEON}/ref-zenflow-r0.json"))
    r, u, ds = block["topk_ratio"], block["update_interval"], run["ds-zenflow"]["bytes_ratio"]
    return {"zf_bytes": run["ref-zenflow"]["bytes_ratio"], "off_bytes": run["ref-offload"]["bytes_ratio"],
            "ds_bytes": "not measured" if ds is None else f"{ds:.3f}×",
            "zf_formula": transfer_bytes(1, 1, r, u), "off_formula": transfer_bytes(1, 1, 0.0, 1),
            "topk": r, "interval": u, "paper_zf": PAPER_BYTES[0], "paper_off": PAPER_BYTES[1], **ran(f, ZF_RECORD)}


def _ratios(f: Files) -> dict[tuple[str, str, str], str]:
    """The Xeon run's paired ratios (ratios.csv) as their table cells, by (kind, numerator, denominator)."""
    return {key: r["cell"] for key, r in _ratio_rows(f).items()}


def _ratio_rows(f: Files) -> dict[tuple[str, str, str], dict[str, Any]]:
    return {(r["kind"], r["numerator"], r["denominator"]): r for r in f.csv(f"{LLAMA_XEON}/ratios.csv")}


def same_frequency_numbers(f: Files) -> dict[str, Any]:
    rows = f.csv(f"{LLAMA_XEON}/table.csv")
    ms = {r["engine"]: r["cycle_mean_ms"] for r in rows}
    cell, gas = _ratios(f), _ratio_rows(f)[("same-frequency", "ref-offload-gas", "ref-zenflow")]
    epyc = next(r for r in f.csv(f"{LLAMA_EPYC}/table.csv") if r["engine"] == "ref-offload")
    xeon = next(r for r in rows if r["engine"] == "ref-offload")
    return {"engines": len(rows), "run": sum(r["runs"] > 0 for r in rows), "runs": int(xeon["runs"]),
            "zf_ms": ms["ref-zenflow"], "off_ms": ms["ref-offload"], "gas_ms": ms["ref-offload-gas"],
            "over_off": cell[("every-step", "ref-offload", "ref-zenflow")],
            "over_gas": cell[("same-frequency", "ref-offload-gas", "ref-zenflow")],
            "ds_zf_ms": ms["ds-zenflow"], "ds_ms": ms["ds-zero-offload"], "ds_gas_ms": ms["ds-zero-offload-gas"],
            "ds_over": cell[("every-step", "ds-zero-offload", "ds-zenflow")],
            "ds_over_gas": cell[("same-frequency", "ds-zero-offload-gas", "ds-zenflow")],
            "regime": xeon["stall_ms"] / xeon["compute_ms"], "regime_epyc": epyc["stall_ms"] / epyc["compute_ms"],
            "gas_low": gas["low"], "gas_high": gas["high"], **ran(f, ZF_RECORD)}


def device_accumulation_numbers(f: Files) -> dict[str, Any]:
    """ref-zenflow-da beside ref-zenflow in the Xeon run, and its PROJECTED GPU speedup."""
    run = f.by(f"{LLAMA_XEON}/table.csv", "engine")
    da, zf = run["ref-zenflow-da"], run["ref-zenflow"]
    block = _block(f.json(f"{LLAMA_XEON}/ref-zenflow-r0.json"))
    r, u = block["topk_ratio"], block["update_interval"]
    proj = {(p["gpu"], p["model"]): p for p in f.csv(f"{COST}/projection.csv")}
    a100, h100 = proj[("a100", "Llama-2-7B")], proj[("h100", "Llama-2-7B")]
    inv = f.json(f"{COST}/inverse.json")["forward"]["as calibrated"]
    return {"da_ms": da["cycle_mean_ms"], "zf_ms": zf["cycle_mean_ms"], "da_bytes": da["bytes_ratio"],
            "zf_bytes": zf["bytes_ratio"], "da_formula": transfer_bytes(1, 2, r, u, device_accumulation=True) / 2,
            "da_over_zf": zf["cycle_mean_ms"] / da["cycle_mean_ms"], "a100": a100["speedup_da"],
            "h100": h100["speedup_da"], "a100_zf": a100["speedup"], "h100_zf": h100["speedup"],
            "blog": inv["speedup_da"], "blog_zf": inv["speedup"], **ran(f, ZF_RECORD)}


def time_to_loss_numbers(f: Files) -> dict[str, Any]:
    """The convergence run (llama7b --convergence): step-time against time-to-loss speedup, per engine."""
    rows = f.by(f"{CONVERGENCE}/convergence.csv", "engine")
    record = f.json(f"{CONVERGENCE}/ref-zenflow-r0.json")

    def said(engine: str) -> str:
        r = rows[engine]
        return _survived(r, "time_to_loss_speedup", "rounds", f"smoothed loss {r['final_smoothed_loss']:.2f}")

    base = rows["ds-zero-offload"]
    timed = f.by(f"{LLAMA_XEON}/table.csv", "engine")
    return {"steps": len(record["steps"]), "target": base["final_smoothed_loss"], "base_s": base["time_to_target_s"],
            "conv_runs": int(base["runs"]),
            "timed": "; ".join(f"{e} {_speedup(timed[e])}" for e in CLAIM_TIMED_ENGINES),
            "runs": int(timed["ref-zenflow"]["runs"]),
            "engines": "; ".join(said(e) for e in CLAIM_CONVERGENCE_ENGINES if e in rows),
            "llama_zf": outcome(rows["ref-zenflow"], "time_to_loss_speedup", "rounds"),
            "llama_held": held(rows["ref-zenflow"], "time_to_loss_speedup"),
            **glue_curve_numbers(f), **ds_target_numbers(f), **ran(f, f"{CONVERGENCE}/ref-zenflow-r0.json")}


def ds_target_numbers(f: Files) -> dict[str, Any]:
    """DeepSpeed's ZenFlow as shipped and as intended against ds-zero-offload, run interleaved in one plan: time to
    the Llama loss and to the GLUE score (llama7b --convergence, glue.py --eval-every)."""
    llama = f.by(f"{CONVERGENCE_DS}/convergence.csv", "engine")
    glue = f.by(f"{GLUE_CURVE_DS}/curve.csv", "engine")

    when = ran(f, f"{CONVERGENCE_DS}/{INTENDED}-r0.json")
    return {"ds_llama": "; ".join(_survived(llama[e], "time_to_loss_speedup", "rounds",
                                            f"smoothed loss {llama[e]['final_smoothed_loss']:.2f}")
                                  for e in (SHIPPED, INTENDED)),
            "ds_llama_runs": int(llama[INTENDED]["runs"]),
            "ds_llama_target": llama["ds-zero-offload"]["final_smoothed_loss"],
            "ds_glue": "; ".join(_survived(glue[e], "time_to_accuracy_speedup", "seeds",
                                           f"final {glue[e]['final_score']:.1f}") for e in (SHIPPED, INTENDED)),
            "ds_glue_seeds": int(glue[INTENDED]["seeds"]), "ds_glue_target": glue["ds-zero-offload"]["target"],
            "ds_hw": when["hw"], "ds_day": when["day"]}


def outcome(row: dict[str, Any], key: str, over: str) -> str:
    """A time-to-target speedup in a few words: its cell, or in how many rounds/seeds the target was missed."""
    if row[key] is not None and row["reached"] == row["compared"]:
        return ratio_cell(row_interval(row, key))
    return f"missed in {row['compared'] - row['reached']:.0f} of {row['compared']:.0f} {over}"


def held(row: dict[str, Any], key: str) -> bool:
    """Reached in every round/seed, with the speedup's interval above 1."""
    return row["reached"] == row["compared"] and (row.get(f"{key}_low") or 0.0) > 1.0


def glue_curve_numbers(f: Files) -> dict[str, Any]:
    """The GLUE accuracy-against-time run (reproduce/glue.py --eval-every): step-time against time-to-accuracy."""
    rows = {r["engine"]: r for r in f.csv(f"{GLUE_CURVE}/curve.csv")}

    def said(engine: str) -> str:
        return _survived(rows[engine], "time_to_accuracy_speedup", "seeds", f"final {rows[engine]['final_score']:.1f}")

    base = rows["ds-zero-offload"]
    return {"glue_task": base["task"], "glue_seeds": int(base["seeds"]), "glue_target": base["target"],
            "glue_base_s": base["time_to_target_s"],
            "glue_zf": outcome(rows["ref-zenflow"], "time_to_accuracy_speedup", "seeds"),
            "glue_held": held(rows["ref-zenflow"], "time_to_accuracy_speedup"),
            "glue": "; ".join(said(e) for e in CLAIM_GLUE_ENGINES if e in rows)}


def peers_numbers(f: Files) -> dict[str, Any]:
    run = f.by(f"{LLAMA_XEON}/table.csv", "engine")
    cell = _ratios(f)
    out: dict[str, Any] = {}
    for key, engine in (("inf", "ds-zero-infinity"), ("twin", "ds-twin-flow"), ("overlap", "ref-offload-overlap"),
                        ("fsdp", "fsdp2-offload"), ("ao8", "torchao-adamw8bit")):
        out |= {f"{key}_ms": run[engine]["cycle_mean_ms"] or float("nan"),
                key: cell.get(("peer", engine, "ref-zenflow"), run[engine]["note"] or "not run"),
                f"ds_{key}": cell.get(("peer", engine, "ds-zenflow"), run[engine]["note"] or "not run")}
    out["ao8_loss"], out["bound_loss"] = run["torchao-adamw8bit"]["final_loss"], run["no-offload"]["final_loss"]
    out["not_run"] = ", ".join(e for e, row in run.items() if row["note"])  # why: the table's notes, docs/peers.md
    inf = _ratio_rows(f)[("peer", "ds-zero-infinity", "ref-zenflow")]
    return out | cores_numbers(f) | {"inf_low": inf["low"], "inf_high": inf["high"]} | ran(f, ZF_RECORD)


def cores_numbers(f: Files) -> dict[str, Any]:
    """The ablation of the worker's share of the cores (llama7b --cores-ablation): each setting against 0.5."""
    rows = f.csv(f"{CORES}/cores.csv")

    def said(engine: str) -> str:
        return "; ".join(f"{r['fraction']:g} ({r['split']}) {ratio_cell(row_interval(r, 'speedup'))}"
                         for r in rows if r["engine"] == engine and r["fraction"] != 0.5)

    return {"cores_runs": int(rows[0]["runs"]), "cores_zf": said("ref-zenflow"), "cores_ds": said("ds-zenflow")}


# The blog's ">4,000× less communication" for selection by column norms.
BLOG_SELECTION = 4000


def selection_numbers(f: Files) -> dict[str, Any]:
    per_rank = f.markdown_table(f"{SCALING}/table.md", 0)
    sel = {r["model"].split(" ")[0]: r for r in f.markdown_table(f"{SCALING}/table.md", 1)}
    norms, grads = "column norms MB (fp32)", "gradients MB (bf16 all-gather)"
    return {"ranks": max(int(r["ranks"]) for r in per_rank),
            "cpu_norms": _number(sel["cpu-scale"][norms]), "cpu_grads": _number(sel["cpu-scale"][grads]),
            "cpu_ratio": _number(sel["cpu-scale"]["ratio"]),
            "l7_norms": _number(sel["Llama-2-7B"][norms]), "l7_grads_gb": _number(sel["Llama-2-7B"][grads]) / 1e3,
            "l7_ratio": _number(sel["Llama-2-7B"]["ratio"]), "l7_bf16": 2 * _number(sel["Llama-2-7B"]["ratio"]),
            "l13_ratio": _number(sel["Llama-2-13B"]["ratio"]), "blog_ratio": BLOG_SELECTION,
            **ran(f, f"{LLAMA_EPYC}/nproc-2/ref-zenflow-r0.json")}


def _holds(row: dict[str, Any]) -> str:
    return "holds" if row["holds"] == "True" else "does not hold"


def glue_numbers(f: Files) -> dict[str, Any]:
    avg = {r["engine"]: r for r in f.csv(f"{GLUE_XEON}/table.csv") if r["task"] == "average"}
    parity = {r["family"]: r for r in f.csv(f"{GLUE_XEON}/parity.csv") if r["task"] == "average"}
    epyc_avg = {r["engine"]: r for r in f.csv(f"{GLUE_EPYC}/table.csv") if r["task"] == "average"}
    epyc_parity = {r["family"]: r for r in f.csv(f"{GLUE_EPYC}/parity.csv") if r["task"] == "average"}
    study = {r["setting"]: r for r in f.csv(f"{STUDY}/table.csv") if r["task"] == "average"}
    xeon, epyc = ({(r["task"], r["engine"]): str(r["scores"]).split() for r in f.csv(name) if r["task"] != "average"}
                  for name in (f"{GLUE_XEON}/table.csv", f"{GLUE_EPYC}/table.csv"))
    pairs = [(a, b) for key in xeon for a, b in zip(xeon[key], epyc[key])]
    default, epochs = study["default"], study["budget-3-epochs"]
    off, zf, ds = avg["ref-offload"], avg["ref-zenflow"], avg[SHIPPED]
    shipped, intended = epyc_avg[SHIPPED], epyc_avg[INTENDED]
    shipped_parity, intended_parity = epyc_parity["DeepSpeed"], epyc_parity["DeepSpeed as intended"]
    return {"seeds": zf["seeds"], "off": off["mean"], "off_sd": off["std"], "zf": zf["mean"], "zf_sd": zf["std"],
            "diff": parity["ours"]["zenflow_minus_offload"], "parity": _holds(parity["ours"]),
            "ds": ds["mean"], "ds_sd": ds["std"], "ds_diff": parity["DeepSpeed"]["zenflow_minus_offload"],
            "ds_parity": _holds(parity["DeepSpeed"]),
            "ds_epyc": shipped["mean"], "ds_epyc_sd": shipped["std"],
            "ds_epyc_diff": shipped_parity["zenflow_minus_offload"], "ds_epyc_parity": _holds(shipped_parity),
            "int": intended["mean"], "int_sd": intended["std"], "int_seeds": intended["seeds"],
            "int_diff": intended_parity["zenflow_minus_offload"], "int_parity": _holds(intended_parity),
            "d_low": default["deficit_low"], "d_high": default["deficit_high"],
            "e3": epochs["deficit"], "e3_low": epochs["deficit_low"], "e3_high": epochs["deficit_high"],
            "same": sum(a == b for a, b in pairs), "runs": len(pairs),
            "max_diff": max(abs(float(a) - float(b)) for a, b in pairs),
            **ran(f, f"{GLUE_XEON}/SST-2-ref-zenflow-s0.json")}


def step_trace_numbers(f: Files) -> dict[str, Any]:
    """The step trace (zenflow/reports/step_trace.py): update against accumulation step, and the share of the host
    update hidden in the accumulation steps, for ref-zenflow and DeepSpeed's ZenFlow beside the example's."""
    rows = f.by(f"{LLAMA_XEON}/step-trace.csv", "engine")
    zf, ds, ex = rows["ref-zenflow"], rows["ds-zenflow"], rows["deepspeedexamples-readme"]
    return {"zf_ratio": zf["update_over_accumulate"], "zf_acc": zf["accumulate_ms"], "zf_up": zf["update_ms"],
            "zf_off": zf["offload_ms"], "zf_hidden": zf["hidden_share"], **bounds(zf, "hidden_share", "zf_hidden"),
            "ds_ratio": ds["update_over_accumulate"], "ds_hidden": ds["hidden_share"], "ds_up": ds["update_ms"],
            "ds_acc": ds["accumulate_ms"], "ds_off": ds["offload_ms"], "trace_runs": int(zf["runs"]),
            "ex_ratio": ex["update_over_accumulate"], "ex_hidden": ex["hidden_share"], "ex_acc": ex["accumulate_ms"],
            "ex_up": ex["update_ms"], "ex_off": ex["offload_ms"], **ran(f, ZF_RECORD)}


KNOBS = f"knobs/{EPYC}"
KNOB_VERDICTS = ("holds", "fails", "undecided")  # zenflow/reports/knobs.py's


def _relative(row: dict[str, Any] | None) -> str:
    """A setting's time to target over ref-offload's, with its interval, or how often it missed."""
    if row is None:
        return "not run"
    if row["relative_time"] is None:
        return f"missed in {row['compared'] - row['reached']:.0f} of {row['compared']:.0f} seeds"
    return ratio_cell(row_interval(row, "relative_time"))


def _auto_setting(rows: list[dict[str, Any]], workload: str, knob: str) -> dict[str, Any] | None:
    """The knobs table's row of ref-zenflow with `knob` "auto" (the other knobs at their defaults) on `workload`."""
    return next((r for r in rows if r["workload"] == workload and r["engine"] == "ref-zenflow"
                 and r[knob] == "auto"), None)


def _common_target_numbers(rows: list[dict[str, Any]], judged: dict[str, Any], w: str) -> dict[str, str]:
    """"auto" against the best fixed setting at the target chosen afterwards (knobs.COMMON): a detail of C11, not the
    verdict of its rule."""
    auto = _auto_setting(rows, w, "update_interval")
    at = judged.get(auto["setting"] if auto else "", {"verdict": "undecided", "why": "not run"})
    best = next((r for r in rows if r["workload"] == w and r["setting"] == at.get("best_fixed")), None)
    return {f"{w}_common": at["verdict"], f"{w}_common_auto": _relative(auto),
            f"{w}_common_best": f"{best['setting']} {_relative(best)}" if best else "none"}


def knobs_numbers(f: Files) -> dict[str, Any]:
    """The knobs study (reproduce/knobs.py): "auto" against the best fixed setting, on both workloads (a workload
    not run yet is "undecided")."""
    verdict = f.json(f"{KNOBS}/verdict.json")
    judged, common = verdict["workloads"], verdict["common_target"]["workloads"]
    every = [{**r, "runs": r["compared"]} for r in f.csv(f"{KNOBS}/knobs.csv")]
    rows = [r for r in every if r["target"] == "ref-offload"]
    out: dict[str, Any] = {}
    at_common = [r for r in every if r["target"] == "common"]
    for w in ("llama", "glue"):
        out |= _common_target_numbers(at_common, common.get(w, {}), w)
        auto, select = _auto_setting(rows, w, "update_interval"), _auto_setting(rows, w, "select_interval")
        said = judged.get(w, {}).get(auto["setting"] if auto else "", {"verdict": "undecided", "why": "not run"})
        best = next((r for r in rows if r["workload"] == w and r["setting"] == said.get("best_fixed")), None)
        ds = next((r for r in rows if r["workload"] == w and r["engine"] == "ds-zenflow"), None)
        base = next((r for r in rows if r["workload"] == w and r["engine"] == "ref-offload"), None)
        headline = (f"auto {_relative(auto)} vs best fixed {_relative(best)}" if best
                    else f"{said['verdict']}, no fixed setting reached the target" if auto else "not run yet")
        out |= {f"{w}_verdict": said["verdict"], f"{w}_why": said["why"], f"{w}_said": headline,
                f"{w}_best": best["setting"] if best else "none",
                f"{w}_select": judged.get(w, {}).get(select["setting"] if select else "", {}).get("verdict", "not run"),
                f"{w}_seeds": int(base["compared"]) if base else 0,
                f"{w}_ds": (ds["note"] or "ran") if ds else "not run"}
    return out | ran(f, f"{KNOBS}/llama/ref-offload-s1234.json")
