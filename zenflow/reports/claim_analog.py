"""The regime claims judged a second time, in the GPU analog (issue 42): C1, C2, C4, C6 and C10 at the split placement
(the device's work on the device cores, the host's on the host cores, docs/design.md §3), read at the point of the
regime sweep (reproduce/regime.py) nearest the paper's ρ, beside their shared-core verdicts. The point is the
sweep's own rule, stated before the numbers are read: the point whose measured ρ is nearest, in log ρ, the middle of
the paper's H100 range as this machine's cost model places it (reports/regime.py, `nearest_point`; regime.csv marks
it). Every cell says "cpu-scale GPU analog, ρ = x": a measurement of a smaller machine, never a GPU number.
"""

from __future__ import annotations

from typing import Any

from zenflow.reports.claim import DOES_NOT_HOLD, Claim, ClaimError, Files
from zenflow.reports.claim_list import faster, hidden_verdict, speedup_verdict, stall_verdict
from zenflow.reports.claim_numbers import COST, EPYC, bounds, outcome, paper_range, ran
from zenflow.reports.intervals import ratio_cell, row_interval
from zenflow.reports.regime import analog_row

REGIME = f"regime/{EPYC}"
SWEEP, SWEEP_RECORD = f"{REGIME}/regime.csv", f"{REGIME}/t0002-ref-offload-r0.json"  # the record: where and when
CONVERGENCE = f"{REGIME}/convergence"  # Llama convergence at the analog point (make reproduce-regime-convergence)
POINT = ("read at the sweep point nearest the paper's ρ (nearest, in log ρ, the middle of the paper's H100 range as "
         "this machine's cost model places it: [regime](" + REGIME + "/regime.md)), {tokens:.0f} tokens per step, "
         "measured ρ {rho:.2f}")
ANALOG = "cpu-scale GPU analog, ρ = {rho:.2f}"
WHERE = "{hw}, {day}, split placement"
RERUN = (("`make reproduce-regime`", SWEEP_RECORD),)


def analog_point(f: Files) -> dict[str, Any]:
    """The sweep's row the analog verdicts are read at (regime.csv's `analog_point`)."""
    row = analog_row(f.csv(SWEEP))
    if row is None:
        raise ClaimError(f"{SWEEP}: no single row marked as the analog point (remake it: python reproduce/regime.py "
                         "--report-only)")
    return row


def point(f: Files) -> tuple[dict[str, Any], dict[str, Any]]:
    """The analog point's row, and what every analog claim names: its tokens per step and ρ, where and when."""
    row = analog_point(f)
    return row, {"tokens": row["tokens"], "rho": row["rho"], **ran(f, SWEEP_RECORD)}


def _ours(row: dict[str, Any]) -> str:
    return ratio_cell(row_interval(row, "ref-zenflow/ref-offload"))


def speedup_analog_numbers(f: Files) -> dict[str, Any]:
    row, n = point(f)
    proj = {(r["gpu"], r["model"]): r for r in f.csv(f"{COST}/projection.csv")}
    paper = paper_range(proj[("a100", "Llama-2-7B")]["paper_speedup"]) \
        + paper_range(proj[("h100", "Llama-2-7B")]["paper_speedup"])
    return {**n, "zf": ratio_cell(row_interval(row, "ref-zenflow/ds-zero-offload")), "paper_low": min(paper),
            "ours": _ours(row), "ideal": row["ideal"],
            "ds_zf": ratio_cell(row_interval(row, "ds-zenflow-intended/ds-zero-offload")),
            "da": ratio_cell(row_interval(row, "ref-zenflow-da/ref-offload")),
            **bounds(row, "ref-zenflow/ds-zero-offload", "zf")}


def stall_analog_numbers(f: Files) -> dict[str, Any]:
    row, n = point(f)
    return {**n, "zf_red": 100 * row["stall_reduction"]}


def same_frequency_analog_numbers(f: Files) -> dict[str, Any]:
    row, n = point(f)
    return {**n, "over_gas": ratio_cell(row_interval(row, "ref-zenflow/ref-offload-gas")), "ours": _ours(row),
            "ds_zf": ratio_cell(row_interval(row, "ds-zenflow-intended/ds-zero-offload")),
            **bounds(row, "ref-zenflow/ref-offload-gas", "gas")}


def step_trace_analog_numbers(f: Files) -> dict[str, Any]:
    row, n = point(f)
    return {**n, "zf_hidden": row["hidden_share"], **bounds(row, "hidden_share", "zf_hidden")}


def time_to_loss_analog_numbers(f: Files) -> dict[str, Any]:
    """The Llama convergence run at the analog point: ref-zenflow's time to ds-zero-offload's final loss."""
    _, n = point(f)
    record = f.json(f"{CONVERGENCE}/ref-zenflow-r0.json")
    tokens = record["workload"]["seq_len"] * record["workload"].get("micro_batch", 1)
    if tokens != n["tokens"] or record["protocol"].get("placement") != "split":
        raise ClaimError(f"{CONVERGENCE}: run at {tokens} tokens per step, placement "
                         f"{record['protocol'].get('placement')}; the analog point is {n['tokens']:.0f} tokens, split "
                         "(rerun it: make reproduce-regime-convergence)")
    rows = f.by(f"{CONVERGENCE}/convergence.csv", "engine")
    zf, base = rows["ref-zenflow"], rows["ds-zero-offload"]
    reached = zf["reached"] == zf["compared"]
    return {**n, "conv_runs": int(base["runs"]), "steps": len(record["steps"]), "target": base["final_smoothed_loss"],
            "zf_loss": zf["final_smoothed_loss"], "reached": zf["reached"], "compared": zf["compared"],
            "to_loss": outcome(zf, "time_to_loss_speedup", "rounds"),
            "step": ratio_cell(row_interval(zf, "step_time_speedup")),
            **(bounds(zf, "time_to_loss_speedup", "loss") if reached else {})}  # judged only when reached


def time_to_loss_verdict(n: dict[str, Any]) -> str:
    if n["reached"] < n["compared"]:
        return DOES_NOT_HOLD
    return faster(n["loss_low"], n["loss_high"])


CLAIMS = (
    Claim("C1-GA", "C1 in the GPU analog", "Fig. 1: up to 5× (A100, H100)",
          (SWEEP, SWEEP_RECORD, f"{COST}/projection.csv"), speedup_analog_numbers,
          ANALOG + ": ref-zenflow {zf} over DeepSpeed ZeRO-Offload", "—", speedup_verdict,
          "C1's rule, " + POINT + ": holds if the 95% interval of ref-zenflow's speedup over DeepSpeed ZeRO-Offload "
          "lies above the paper's lowest ({paper_low:.1f}×); partly if above 1 but not that; no difference if it "
          "includes 1",
          ("Over our own ZeRO-Offload (ref-offload) {ours}, where the ideal bound at this ρ is {ideal:.2f}×; "
           "ref-zenflow-da {da}; DeepSpeed's ZenFlow as its authors intended over its ZeRO-Offload {ds_zf}.",
           "At cpu-scale the device's floor (forward+backward writes every weight's gradient at any token count) "
           "caps ρ near {rho:.2f}, below the paper's; the sweep and the cost model along it: [regime](" + REGIME
           + "/regime.md)."),
          WHERE, RERUN),
    Claim("C2-GA", "C2 in the GPU analog", "Fig. 1: >85% fewer GPU stalls", (SWEEP, SWEEP_RECORD),
          stall_analog_numbers,
          ANALOG + ": ref-zenflow −{zf_red:.1f}% stall against ref-offload", "—", stall_verdict,
          "C2's rule, " + POINT + ": holds if ref-zenflow's stall per step is at least 85% below ref-offload's; "
          "partly if lower by less",
          ("The stall is the training thread's wait for the host, which at the split placement runs on its own "
           "core as a GPU's host does ([regime](" + REGIME + "/regime.md)).",),
          WHERE, RERUN),
    Claim("C4-GA", "C4 in the GPU analog", "— (ZenFlow updates on the host every U steps)", (SWEEP, SWEEP_RECORD),
          same_frequency_analog_numbers,
          ANALOG + ": ref-zenflow {over_gas} ref-offload-gas", "—", lambda n: faster(n["gas_low"], n["gas_high"]),
          "C4's rule, " + POINT + ": holds if ref-zenflow is faster than ref-offload-gas, which updates on the host "
          "as often, with a 95% interval above 1",
          ("Over every-step ZeRO-Offload (ref-offload) {ours}; DeepSpeed's ZenFlow (intended) over its ZeRO-Offload "
           "{ds_zf} ([regime](" + REGIME + "/regime.md)).",),
          WHERE, RERUN),
    Claim("C6-GA", "C6 in the GPU analog", "— (the paper reports step time)",
          (SWEEP, SWEEP_RECORD, f"{CONVERGENCE}/convergence.csv", f"{CONVERGENCE}/ref-zenflow-r0.json"),
          time_to_loss_analog_numbers,
          ANALOG + ": ref-zenflow to DeepSpeed ZeRO-Offload's Llama loss: {to_loss}", "—", time_to_loss_verdict,
          "C6's Llama half, " + POINT + ": holds if ref-zenflow reaches DeepSpeed ZeRO-Offload's final smoothed "
          "loss in every round with a time-to-loss speedup interval above 1; no difference if it reaches it in "
          "every round and the interval includes 1; does not hold if it misses it in any round",
          ("Llama from random weights at {tokens:.0f} tokens per step, {steps} steps, {conv_runs} rounds, every "
           "engine at the split placement: step-time speedup {step} → time to ds-zero-offload's final smoothed "
           "loss of the same round: {to_loss} (target median {target:.2f}; ref-zenflow's own final {zf_loss:.2f}) "
           "([convergence]("
           + CONVERGENCE + "/convergence.md)).",),
          WHERE, (("`make reproduce-regime-convergence`", f"{CONVERGENCE}/convergence.csv"),)),
    Claim("C10-GA", "C10 in the GPU analog", "example: the update half hidden", (SWEEP, SWEEP_RECORD),
          step_trace_analog_numbers,
          ANALOG + ": {zf_hidden:.2f} [{zf_hidden_low:.2f}…{zf_hidden_high:.2f}] of the host update hidden", "—",
          hidden_verdict,
          "C10's rule, " + POINT + ": holds if the 95% interval of the share of the host update hidden in the "
          "accumulation steps lies at or above 0.4; partly if above 0",
          ("The share: 1 − (update − accumulate) / (ZeRO-Offload − accumulate), ref-zenflow's steps against "
           "ref-offload's at the same point ([regime](" + REGIME + "/regime.md)).",),
          WHERE, RERUN),
)
PARENT = {c.key: c.key.removesuffix("-GA") for c in CLAIMS}  # the claim each judges again


def with_analogs(claims: tuple[Claim, ...]) -> tuple[Claim, ...]:
    """The claims in page order: each analog verdict right under the claim it judges again."""
    return tuple(c for parent in claims for c in (parent, *(a for a in CLAIMS if PARENT[a.key] == parent.key)))
