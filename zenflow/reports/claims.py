"""The paper's claims as data: one entry per claim, the committed files it reads, the numbers it takes from them.

The claims table of results/README.md (between the `claims:begin` and `claims:end` markers) is generated from
CLAIMS: `python -m zenflow.reports.claims` rewrites it (`--check`: exit 1 when it differs), and
tests/reports/test_claims.py checks it byte for byte. Each entry names the files it reads under results/ (tables' CSV
and JSON, a Markdown table, a run record); its `numbers` function takes every number from them, and its cells are
templates over those numbers, so no number in the table is typed by hand. A missing file is an error, never a
skipped row. Adding a claim: a result set with its table (reproduce/), then one entry here.
"""

from __future__ import annotations

import argparse
import json
import string
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zenflow.costmodel.model import transfer_bytes
from zenflow.harness.tables import compact_markdown, read_csv, write_text_atomic
from zenflow.reports.gpu_claims import gpu_section
from zenflow.reports.intervals import ratio_cell, row_interval

RESULTS = Path(__file__).resolve().parents[2] / "results"
BEGIN = "<!-- claims:begin -->"
END = "<!-- claims:end -->"
HEADERS = ("claim (paper)", "paper", "measured here", "projected (cost model, not measured)", "measured on",
           "command to rerun")

XEON, EPYC = "cpu-scale-intel-xeon-2c", "cpu-scale-amd-epyc-2c"
LLAMA_XEON, LLAMA_EPYC, COST = f"llama7b/{XEON}", f"llama7b/{EPYC}", f"costmodel/{EPYC}"
CONVERGENCE = f"{LLAMA_XEON}/convergence"
CORES = f"{LLAMA_XEON}/cores"
GLUE_XEON, GLUE_EPYC = f"glue/{XEON}", f"glue/{EPYC}"
REPAIRED, STUDY, SCALING = f"{GLUE_EPYC}/ds-weight-view-repaired", f"{GLUE_EPYC}/study", f"scaling/{EPYC}"
GLUE_CURVE = f"{GLUE_XEON}/curve"


class ClaimError(RuntimeError):
    """A claim cannot be made from the committed files (one is missing, or not among the claim's files)."""


class Files:
    """The committed files of one claim: only those it declares can be read, and a missing one is an error."""

    def __init__(self, root: Path, names: tuple[str, ...]) -> None:
        self.root, self.names = root, names

    def path(self, name: str) -> Path:
        if name not in self.names:
            raise ClaimError(f"{name} is not among the claim's files {self.names}")
        path = self.root / name
        if not path.is_file():
            raise ClaimError(f"{path}: a committed file this claim reads is missing (rerun its command)")
        return path

    def csv(self, name: str) -> list[dict[str, Any]]:
        """Rows of a CSV table, numbers as floats, empty cells None."""
        return read_csv(self.path(name))

    def by(self, name: str, key: str) -> dict[Any, dict[str, Any]]:
        return {row[key]: row for row in self.csv(name)}

    def json(self, name: str) -> Any:
        return json.loads(self.path(name).read_text())

    def markdown_table(self, name: str, index: int) -> list[dict[str, str]]:
        """The `index`-th GitHub table of a Markdown file, as rows of header → cell text."""
        tables, current = [], []
        for line in self.path(name).read_text().splitlines() + [""]:
            if line.startswith("|"):
                current.append([c.strip() for c in line.strip().strip("|").split("|")])
            elif current:
                tables.append(current)
                current = []
        head, _, *body = tables[index]
        return [dict(zip(head, row)) for row in body]


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


def _block(record: dict[str, Any]) -> dict[str, Any]:
    return record["config"]["zero_optimization"]["zenflow"]


def _scenario(record: dict[str, Any]) -> str:
    w = record["workload"]
    return f"{record['model']['parameters'] / 1e6:.1f}M-param Llama, {w['dtype']}, seq {w['seq_len']}"


def _days(dating: dict[str, Any]) -> str:
    """When a validation's runs were taken, in days ("2026-11-24" or "2026-11-22 – 2026-11-24"), and how far from
    its calibration at most (issue 26: a count is only as good as the day its runs and calibration share)."""
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
            "rho_blog": inv["rho_blog"], "rho": inv["projection_rho"],
            "hw": record["environment"]["hardware_id"], "scenario": _scenario(record)}


def stall_numbers(f: Files) -> dict[str, Any]:
    run = f.by(f"{LLAMA_XEON}/table.csv", "engine")
    proj = {(r["gpu"], r["model"]): r for r in f.csv(f"{COST}/projection.csv")}
    a100, h100 = proj[("a100", "Llama-2-7B")], proj[("h100", "Llama-2-7B")]
    block = _block(f.json(f"{LLAMA_XEON}/ref-zenflow-r0.json"))
    return {"zf_red": 100 * run["ref-zenflow"]["stall_reduction"], "zf_stall": run["ref-zenflow"]["stall_ms"],
            "off_stall": run["ref-offload"]["stall_ms"], "ds_red": 100 * run["ds-zenflow"]["stall_reduction"],
            "a100_paper": a100["paper_stall"], "h100_paper": h100["paper_stall"],
            "a100_red": 100 * a100["stall_reduction"], "h100_red": 100 * h100["stall_reduction"],
            "topk": block["topk_ratio"], "interval": block["update_interval"]}


def pcie_numbers(f: Files) -> dict[str, Any]:
    run = f.by(f"{LLAMA_XEON}/table.csv", "engine")
    block = _block(f.json(f"{LLAMA_XEON}/ref-zenflow-r0.json"))
    r, u, ds = block["topk_ratio"], block["update_interval"], run["ds-zenflow"]["bytes_ratio"]
    return {"zf_bytes": run["ref-zenflow"]["bytes_ratio"], "off_bytes": run["ref-offload"]["bytes_ratio"],
            "ds_bytes": "not measured" if ds is None else f"{ds:.3f}×",
            "zf_formula": transfer_bytes(1, 1, r, u), "off_formula": transfer_bytes(1, 1, 0.0, 1),
            "topk": r, "interval": u}


def _ratios(f: Files) -> dict[tuple[str, str, str], str]:
    """The Xeon run's paired ratios (ratios.csv) as their table cells, by (kind, numerator, denominator)."""
    return {(r["kind"], r["numerator"], r["denominator"]): r["cell"] for r in f.csv(f"{LLAMA_XEON}/ratios.csv")}


def same_frequency_numbers(f: Files) -> dict[str, Any]:
    rows = f.csv(f"{LLAMA_XEON}/table.csv")
    ms = {r["engine"]: r["cycle_mean_ms"] for r in rows}
    cell = _ratios(f)
    epyc = next(r for r in f.csv(f"{LLAMA_EPYC}/table.csv") if r["engine"] == "ref-offload")
    xeon = next(r for r in rows if r["engine"] == "ref-offload")
    return {"engines": len(rows), "run": sum(r["runs"] > 0 for r in rows), "runs": int(xeon["runs"]),
            "zf_ms": ms["ref-zenflow"], "off_ms": ms["ref-offload"], "gas_ms": ms["ref-offload-gas"],
            "over_off": cell[("every-step", "ref-offload", "ref-zenflow")],
            "over_gas": cell[("same-frequency", "ref-offload-gas", "ref-zenflow")],
            "ds_zf_ms": ms["ds-zenflow"], "ds_ms": ms["ds-zero-offload"], "ds_gas_ms": ms["ds-zero-offload-gas"],
            "ds_over": cell[("every-step", "ds-zero-offload", "ds-zenflow")],
            "ds_over_gas": cell[("same-frequency", "ds-zero-offload-gas", "ds-zenflow")],
            "regime": xeon["stall_ms"] / xeon["compute_ms"], "regime_epyc": epyc["stall_ms"] / epyc["compute_ms"]}


def device_accumulation_numbers(f: Files) -> dict[str, Any]:
    """ref-zenflow-da (issue 25) beside ref-zenflow in the Xeon run, and its PROJECTED GPU speedup."""
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
            "blog": inv["speedup_da"], "blog_zf": inv["speedup"]}


def time_to_loss_numbers(f: Files) -> dict[str, Any]:
    """The convergence run (llama7b --convergence): step-time against time-to-loss speedup, per engine."""
    rows = f.by(f"{CONVERGENCE}/convergence.csv", "engine")
    record = f.json(f"{CONVERGENCE}/ref-zenflow-r0.json")

    def said(engine: str) -> str:
        r = rows[engine]
        missed = f"missed in {r['compared'] - r['reached']:.0f} of {r['compared']:.0f} rounds; " if r["reached"] else ""
        return _then(r, "step_time_speedup", "time_to_loss_speedup",
                     f"{missed}smoothed loss {r['final_smoothed_loss']:.2f}")

    base = rows["ds-zero-offload"]
    timed = f.by(f"{LLAMA_XEON}/table.csv", "engine")
    return {"steps": len(record["steps"]), "target": base["final_smoothed_loss"], "base_s": base["time_to_target_s"],
            "conv_runs": int(base["runs"]),
            "timed": "; ".join(f"{e} {_speedup(timed[e])}" for e in ("ref-zenflow", "ds-zenflow", "ref-offload",
                                                                      "ref-offload-gas", "ref-offload-overlap")),
            "runs": int(timed["ref-zenflow"]["runs"]),
            "engines": "; ".join(said(e) for e in ("ref-zenflow", "ds-zenflow", "ref-offload", "ref-offload-gas",
                                                    "ref-offload-overlap", "ref-zenflow-da") if e in rows),
            **glue_curve_numbers(f)}


def glue_curve_numbers(f: Files) -> dict[str, Any]:
    """The GLUE accuracy-against-time run (reproduce/glue.py --eval-every): step-time against time-to-accuracy."""
    rows = {r["engine"]: r for r in f.csv(f"{GLUE_CURVE}/curve.csv")}

    def said(engine: str) -> str:
        r = rows[engine]
        missed = (f"missed with {r['compared'] - r['reached']:.0f} of {r['compared']:.0f} seeds; " if r["reached"]
                  else "")
        return _then(r, "step_time_speedup", "time_to_accuracy_speedup", f"{missed}final {r['final_score']:.1f}")

    base = rows["ds-zero-offload"]
    return {"glue_task": base["task"], "glue_seeds": int(base["seeds"]), "glue_target": base["target"],
            "glue_base_s": base["time_to_target_s"],
            "glue": "; ".join(said(e) for e in ("ref-zenflow", "ds-zenflow", "ref-offload", "no-offload") if e in rows)}


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
    return out | cores_numbers(f)


def cores_numbers(f: Files) -> dict[str, Any]:
    """The ablation of the worker's share of the cores (llama7b --cores-ablation): each setting against 0.5."""
    rows = f.csv(f"{CORES}/cores.csv")

    def said(engine: str) -> str:
        return "; ".join(f"{r['fraction']:g} ({r['split']}) {ratio_cell(row_interval(r, 'speedup'))}"
                         for r in rows if r["engine"] == engine and r["fraction"] != 0.5)

    return {"cores_runs": int(rows[0]["runs"]), "cores_zf": said("ref-zenflow"), "cores_ds": said("ds-zenflow")}


def selection_numbers(f: Files) -> dict[str, Any]:
    per_rank = f.markdown_table(f"{SCALING}/table.md", 0)
    sel = {r["model"].split(" ")[0]: r for r in f.markdown_table(f"{SCALING}/table.md", 1)}
    norms, grads = "column norms MB (fp32)", "gradients MB (bf16 all-gather)"
    return {"ranks": max(int(r["ranks"]) for r in per_rank),
            "cpu_norms": _number(sel["cpu-scale"][norms]), "cpu_grads": _number(sel["cpu-scale"][grads]),
            "cpu_ratio": _number(sel["cpu-scale"]["ratio"]),
            "l7_norms": _number(sel["Llama-2-7B"][norms]), "l7_grads_gb": _number(sel["Llama-2-7B"][grads]) / 1e3,
            "l7_ratio": _number(sel["Llama-2-7B"]["ratio"]), "l7_bf16": 2 * _number(sel["Llama-2-7B"]["ratio"]),
            "l13_ratio": _number(sel["Llama-2-13B"]["ratio"])}


def _holds(row: dict[str, Any]) -> str:
    return "holds" if row["holds"] == "True" else "does not hold"


def glue_numbers(f: Files) -> dict[str, Any]:
    avg = {r["engine"]: r for r in f.csv(f"{GLUE_XEON}/table.csv") if r["task"] == "average"}
    parity = {r["family"]: r for r in f.csv(f"{GLUE_XEON}/parity.csv") if r["task"] == "average"}
    repaired = {r["engine"]: r for r in f.csv(f"{REPAIRED}/table.csv") if r["task"] == "average"}
    repaired_parity = next(r for r in f.csv(f"{REPAIRED}/parity.csv") if r["task"] == "average")
    study = {r["setting"]: r for r in f.csv(f"{STUDY}/table.csv") if r["task"] == "average"}
    xeon, epyc = ({(r["task"], r["engine"]): str(r["scores"]).split() for r in f.csv(name) if r["task"] != "average"}
                  for name in (f"{GLUE_XEON}/table.csv", f"{GLUE_EPYC}/table.csv"))
    pairs = [(a, b) for key in xeon for a, b in zip(xeon[key], epyc[key])]
    default, epochs = study["default"], study["budget-3-epochs"]
    off, zf, ds, rep = avg["ref-offload"], avg["ref-zenflow"], avg["ds-zenflow"], repaired["ds-zenflow"]
    return {"seeds": zf["seeds"], "off": off["mean"], "off_sd": off["std"], "zf": zf["mean"], "zf_sd": zf["std"],
            "diff": parity["ours"]["zenflow_minus_offload"], "parity": _holds(parity["ours"]),
            "ds": ds["mean"], "ds_sd": ds["std"], "ds_diff": parity["DeepSpeed"]["zenflow_minus_offload"],
            "ds_parity": _holds(parity["DeepSpeed"]), "rep": rep["mean"], "rep_sd": rep["std"],
            "rep_diff": repaired_parity["zenflow_minus_offload"], "rep_parity": _holds(repaired_parity),
            "d_low": default["deficit_low"], "d_high": default["deficit_high"],
            "e3": epochs["deficit"], "e3_low": epochs["deficit_low"], "e3_high": epochs["deficit_high"],
            "same": sum(a == b for a, b in pairs), "runs": len(pairs),
            "max_diff": max(abs(float(a) - float(b)) for a, b in pairs)}


@dataclass(frozen=True)
class Claim:
    """One row of the claims table: the paper's statement, the files it reads, and cell templates over the numbers
    `numbers` takes from them (str.format fields; links are relative to results/README.md)."""

    claim: str
    paper: str
    files: tuple[str, ...]
    numbers: Callable[[Files], dict[str, Any]]
    measured: str
    projected: str
    where: str
    command: str

    def templates(self) -> tuple[str, ...]:
        return self.claim, self.paper, self.measured, self.projected, self.where, self.command

    def cells(self, root: Path = RESULTS) -> list[str]:
        numbers = self.numbers(Files(root, self.files))
        return [t.format(**numbers) for t in self.templates()]

    def fields(self) -> set[str]:
        """The numbers the templates use."""
        return {name for t in self.templates() for _, name, _, _ in string.Formatter().parse(t) if name}


LLAMA_RUN = "`make reproduce-llama7b`"
TABLE_XEON = f"[table]({LLAMA_XEON}/table.md)"
CLAIMS = (
    Claim("up to 5× end-to-end speedup over ZeRO-Offload", "Fig. 1: A100 {a100_paper}, H100 {h100_paper} (Llama-2-7B)",
          (f"{LLAMA_XEON}/table.csv", f"{LLAMA_XEON}/ratios.csv", f"{LLAMA_XEON}/ref-zenflow-r0.json",
           f"{COST}/projection.csv", f"{COST}/projection-band.csv", f"{COST}/inverse.json",
           f"costmodel/{XEON}/validation.csv", f"{COST}/validation.csv", f"costmodel/{XEON}/validation.json",
           f"{COST}/validation.json"), speedup_numbers,
          "ref-zenflow **{zf}** DeepSpeed ZeRO-Offload ({zf_ms:.1f} vs {ds_ms:.1f} ms/step, median of {runs} runs, 95% "
          "interval); DeepSpeed's ZenFlow **{ds_zf}**; ref-zenflow over ref-offload {ours} (" + TABLE_XEON + ")",
          "Llama-2-7B: A100 **{a100:.1f}×**, H100 **{h100:.1f}×** ([projection](" + COST + "/projection.md)); over "
          "host assumptions A100 {a100_low:.1f}–{a100_high:.1f}×, H100 {h100_low:.1f}–{h100_high:.1f}× ([band]("
          + COST + "/projection-band.md)); within 15% of the measured step at {xeon_in} of {xeon_n} points "
          "([Xeon](costmodel/" + XEON + "/validation.md): {xeon_days}), {epyc_in} of {epyc_n} ([EPYC](" + COST
          + "/validation.md): {epyc_days})."
          " Below Fig. 1: the published step times imply ρ = {rho_blog:.0f}, we assume {rho:.1f} ([inverse check]("
          + COST + "/inverse.md))",
          "{hw}: {scenario}", LLAMA_RUN + "; `make project`"),
    Claim(">85% fewer GPU stalls", "Fig. 1: {a100_paper} (A100), {h100_paper} (H100)",
          (f"{LLAMA_XEON}/table.csv", f"{LLAMA_XEON}/ref-zenflow-r0.json", f"{COST}/projection.csv"), stall_numbers,
          "ref-zenflow vs ref-offload **−{zf_red:.1f}%** ({zf_stall:.1f} vs {off_stall:.1f} ms/step); DeepSpeed's "
          "ZenFlow vs ZeRO-Offload −{ds_red:.1f}% (its stall includes its I/O) (" + TABLE_XEON + ")",
          "A100 −{a100_red:.0f}%, H100 −{h100_red:.0f}% (host work hidden at topk {topk}, U {interval:.0f})",
          "same", LLAMA_RUN + "; `make project`"),
    Claim("≈2× less PCIe traffic", "\"1.13× model size vs 2×\"",
          (f"{LLAMA_XEON}/table.csv", f"{LLAMA_XEON}/ref-zenflow-r0.json"), pcie_numbers,
          "counted: ref-zenflow **{zf_bytes:.3f}×** model bytes per step, ref-offload **{off_bytes:.3f}×** "
          "(gradients + parameters); DeepSpeed: {ds_bytes} (no counters; NVML needs a GPU) (" + TABLE_XEON + ")",
          "{zf_formula:.3f}× vs {off_formula:.3f}× model bytes ([docs/design.md §2](../docs/design.md)'s formula at "
          "topk {topk}, U {interval:.0f}; hardware-independent)", "same", LLAMA_RUN),
    Claim("the speedup at the same update frequency", "ZenFlow (host update every U steps) against ZeRO-Offload "
          "updating every step", (f"{LLAMA_XEON}/table.csv", f"{LLAMA_XEON}/ratios.csv", f"{LLAMA_EPYC}/table.csv"),
          same_frequency_numbers,
          "{run:.0f} of {engines} engines run here, in one command, {runs} rounds, paired ratios with their 95% "
          "interval (" + TABLE_XEON + "): ref-zenflow **{over_off}** ref-offload ({zf_ms:.1f} vs {off_ms:.1f} "
          "ms/step), **{over_gas}** ref-offload-gas ({gas_ms:.1f}); ds-zenflow **{ds_over}** ds-zero-offload "
          "({ds_zf_ms:.1f} vs {ds_ms:.1f}), **{ds_over_gas}** ds-zero-offload-gas ({ds_gas_ms:.1f}). Host optimizer "
          "/ compute: {regime:.2f} here, {regime_epyc:.2f} on the EPYC", "—", "same", LLAMA_RUN),
    Claim("ZenFlow against ZeRO-Infinity and the peers a user would pick instead ([docs/peers.md](../docs/peers.md))",
          "the paper's second baseline is ZeRO-Infinity", (f"{LLAMA_XEON}/table.csv", f"{LLAMA_XEON}/ratios.csv",
                                                           f"{CORES}/cores.csv"),
          peers_numbers,
          "ref-zenflow over ds-zero-infinity **{inf}** ({inf_ms:.1f} ms/step), ds-twin-flow **{twin}** "
          "({twin_ms:.1f}), the exact overlapped offload ref-offload-overlap **{overlap}** ({overlap_ms:.1f}), "
          "fsdp2-offload with its fused host AdamW **{fsdp}** ({fsdp_ms:.1f}), torchao's 8-bit AdamW without offload "
          "**{ao8}** ({ao8_ms:.1f}; "
          "final loss {ao8_loss:.3f} against no-offload's {bound_loss:.3f}); DeepSpeed's ZenFlow {ds_inf}, {ds_twin}, "
          "{ds_overlap}, {ds_fsdp}, {ds_ao8}. Not run here (why: under the table): {not_run} (" + TABLE_XEON + "). "
          "The worker's share of the cores (`pt_reserved_cores_perc`, step time against the default 0.5, split: "
          "compute + worker cores, {cores_runs} rounds): ref-zenflow {cores_zf}; ds-zenflow {cores_ds} ([cores]("
          + CORES + "/cores.md))", "—", XEON, LLAMA_RUN + "; `ARGS=--cores-ablation`"),
    Claim("the speedup counted in loss reached per wall time (issue 24)", "— (the paper reports step time, and "
          "GLUE accuracy after a fixed number of steps)",
          (f"{CONVERGENCE}/convergence.csv", f"{CONVERGENCE}/ref-zenflow-r0.json", f"{LLAMA_XEON}/table.csv",
           f"{GLUE_CURVE}/curve.csv"), time_to_loss_numbers,
          "step time over ds-zero-offload, {runs} runs each with its 95% interval: {timed} (" + TABLE_XEON + "). "
          "Counted in loss, {steps} steps from random weights, {conv_runs} rounds of one seed each: step-time speedup "
          "→ time to ds-zero-offload's final smoothed loss in the same round (median {target:.2f}, reached in "
          "{base_s:.0f} s): {engines} ([convergence](" + CONVERGENCE + "/convergence.md), [figure](" + CONVERGENCE
          + "/loss-vs-time.png)). GLUE {glue_task} ({glue_seeds} seeds): step-time speedup → time to "
          "ds-zero-offload's final dev score with the same seed (mean {glue_target:.1f}, reached in {glue_base_s:.0f} "
          "s of training): {glue} ([curve](" + GLUE_CURVE + "/curve.md), [figure](" + GLUE_CURVE
          + "/accuracy-vs-time.png)). Every speedup is paired by round or seed, with its 95% interval; an engine that "
          "misses the target in any round or seed gets none", "—", "same",
          LLAMA_RUN + " `ARGS=--convergence`; `python reproduce/glue.py --tasks SST-2 --seeds 0 1 2 3 4 "
          "--eval-every 16 --out results/glue/<hardware-id>/curve`"),
    Claim("beyond the paper: ZenFlow with the interval's sums on the device (ref-zenflow-da, issue 25)",
          "— (the paper sums on the host every step)",
          (f"{LLAMA_XEON}/table.csv", f"{LLAMA_XEON}/ref-zenflow-r0.json", f"{COST}/projection.csv",
           f"{COST}/inverse.json"), device_accumulation_numbers,
          "ref-zenflow-da **{da_ms:.1f}** ms/step against ref-zenflow {zf_ms:.1f} ({da_over_zf:.2f}×: here the "
          "device is the same CPU, so the sums land on the training thread); counted **{da_bytes:.3f}×** model bytes "
          "per step against {zf_bytes:.3f}× (formula {da_formula:.3f}×) (" + TABLE_XEON + ")",
          "PROJECTED, never run on a GPU: Llama-2-7B A100 **{a100:.1f}×**, H100 **{h100:.1f}×** over ZeRO-Offload "
          "(ZenFlow {a100_zf:.1f}×, {h100_zf:.1f}×); at the blog's inputs {blog:.1f}× against {blog_zf:.1f}× "
          "([inverse check](" + COST + "/inverse.md))", "same", LLAMA_RUN + "; `make project`"),
    Claim("selection by per-column norms instead of a gradient all-gather", "blog: \">4,000× less communication\"",
          (f"{SCALING}/table.md",), selection_numbers,
          "one selection sends **{cpu_norms:.3f} MB** of fp32 column norms per rank where an all-gather of the bf16 "
          "gradients would send {cpu_grads:.1f} MB: **{cpu_ratio:,.0f}×** ([scaling](" + SCALING + "/table.md))",
          "**computed** for Llama-2-7B: {l7_norms:.2f} MB vs {l7_grads_gb:.1f} GB, **{l7_ratio:,.0f}×** "
          "({l7_bf16:,.0f}× with bf16 norms); Llama-2-13B {l13_ratio:,.0f}×", EPYC + ", {ranks} ranks (gloo)",
          "`make reproduce-llama7b NPROC=2`; `python reproduce/scaling.py`"),
    Claim("no accuracy loss on GLUE", "Fig. 1 right: 0.915 → 0.919 (Llama-2-7B)",
          (f"{GLUE_XEON}/table.csv", f"{GLUE_XEON}/parity.csv", f"{GLUE_EPYC}/table.csv", f"{REPAIRED}/table.csv",
           f"{REPAIRED}/parity.csv", f"{STUDY}/table.csv"), glue_numbers,
          "{seeds:.0f} seeds, mean of SST-2 and MRPC: ref-offload **{off:.1f} ± {off_sd:.1f}**, ref-zenflow "
          "**{zf:.1f} ± {zf_sd:.1f}** ({diff:+.1f}, parity {parity}); DeepSpeed's ZenFlow **{ds:.1f} ± {ds_sd:.1f}** "
          "({ds_diff:+.1f}, {ds_parity}: divergence G; {rep:.1f} ± {rep_sd:.1f}, {rep_diff:+.1f}, {rep_parity} with "
          "that view repaired, [diagnosis](" + REPAIRED + "/table.md)) ([table](" + GLUE_XEON + "/table.md)). "
          "Paired by seed, ZenFlow's deficit has a 95% interval of {d_low:+.1f}…{d_high:+.1f}; at 3 epochs "
          "{e3:+.1f} ({e3_low:+.1f}…{e3_high:+.1f}) ([study](" + STUDY + "/table.md))",
          "— (the cost model predicts time, not accuracy)",
          XEON + "; repeated on " + EPYC + ": {same} of {runs} runs identical, the rest within {max_diff:.1f} "
          "([table](" + GLUE_EPYC + "/table.md))", "`make reproduce-glue`; `make reproduce-glue-study`"),
)


def table(root: Path = RESULTS) -> str:
    """The claims table, every number read from the committed files under `root`."""
    return compact_markdown([claim.cells(root) for claim in CLAIMS], HEADERS)


def block(root: Path = RESULTS) -> str:
    return "\n".join([BEGIN, "<!-- generated by `python -m zenflow.reports.claims` from "
                      "zenflow/reports/claims.py: edit there, not here -->", table(root), "", gpu_section(root), END])


def replace_block(readme: str, new: str) -> str:
    """`readme` with the text between (and including) the markers replaced by `new`."""
    start, end = readme.find(BEGIN), readme.find(END)
    if start < 0 or end < start:
        raise ClaimError(f"results/README.md has no {BEGIN} ... {END} block")
    return readme[:start] + new + readme[end + len(END):]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write the claims table of results/README.md from the committed "
                                     "result files (zenflow/reports/claims.py).")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when the table differs")
    args = parser.parse_args(argv)
    readme = RESULTS / "README.md"
    text = readme.read_text()
    new = replace_block(text, block())
    if args.check:
        if new != text:
            print(f"{readme}: the claims table differs from the committed files; run python -m "
                  "zenflow.reports.claims", file=sys.stderr)
            return 1
        return 0
    write_text_atomic(readme, new)
    print(f"{readme}: claims table written ({len(CLAIMS)} claims)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
