"""The paper's claims as data: one `Claim` each, with the files it reads, a headline, the rule that judges
it, stated before the numbers are read, and the detail shown under the table. Adding a claim: a result set with its
table (reproduce/), its numbers in claim_numbers.py, then one entry here.
"""

from __future__ import annotations

from typing import Any

from zenflow.reports.claim import (
    DOES_NOT_HOLD,
    HOLDS,
    NO_DIFFERENCE,
    NOT_MEASURED,
    PARTLY,
    PROJECTED_ONLY,
    Claim,
)
from zenflow.reports.claim_numbers import (
    CONVERGENCE,
    CONVERGENCE_DS,
    CORES,
    COST,
    EPYC,
    GLUE_CURVE,
    GLUE_CURVE_DS,
    GLUE_EPYC,
    GLUE_XEON,
    INTENDED,
    KNOBS,
    LLAMA_EPYC,
    LLAMA_XEON,
    SCALING,
    STUDY,
    XEON,
    ZF_RECORD,
    device_accumulation_numbers,
    glue_numbers,
    knobs_numbers,
    pcie_numbers,
    peers_numbers,
    same_frequency_numbers,
    selection_numbers,
    speedup_numbers,
    stall_numbers,
    step_trace_numbers,
    time_to_loss_numbers,
)

LLAMA_RUN = "`make reproduce-llama7b`"
TABLE_XEON = f"[table]({LLAMA_XEON}/table.md)"
WHERE = "{hw}, {day}"


def faster(low: float | None, high: float | None) -> str:
    """A speedup's verdict from its 95% interval: above 1 holds, below 1 does not, across 1 is no difference."""
    if low is None or high is None:
        return NOT_MEASURED  # one run: no interval to judge by
    return HOLDS if low > 1 else DOES_NOT_HOLD if high < 1 else NO_DIFFERENCE


def speedup_verdict(n: dict[str, Any]) -> str:
    judged = faster(n["zf_low"], n["zf_high"])
    return PARTLY if judged == HOLDS and n["zf_low"] < n["paper_low"] else judged


def stall_verdict(n: dict[str, Any]) -> str:
    return HOLDS if n["zf_red"] >= 85 else PARTLY if n["zf_red"] > 0 else DOES_NOT_HOLD


def pcie_verdict(n: dict[str, Any]) -> str:
    near = [abs(n["zf_bytes"] / n["paper_zf"] - 1) <= 0.05, abs(n["off_bytes"] / n["paper_off"] - 1) <= 0.05]
    return HOLDS if all(near) else PARTLY if n["zf_bytes"] < n["off_bytes"] else DOES_NOT_HOLD


def time_to_target_verdict(n: dict[str, Any]) -> str:
    return {2: HOLDS, 1: PARTLY, 0: DOES_NOT_HOLD}[n["llama_held"] + n["glue_held"]]


def selection_verdict(n: dict[str, Any]) -> str:
    return HOLDS if n["l7_ratio"] >= n["blog_ratio"] else PARTLY if n["l7_bf16"] >= n["blog_ratio"] else DOES_NOT_HOLD


def glue_verdict(n: dict[str, Any]) -> str:
    return HOLDS if n["parity"] == "holds" else DOES_NOT_HOLD


def hidden_verdict(n: dict[str, Any]) -> str:
    low, high = n["zf_hidden_low"], n["zf_hidden_high"]
    if low is None or high is None:
        return NOT_MEASURED
    return HOLDS if low >= 0.4 else PARTLY if low > 0 else DOES_NOT_HOLD


# a run record of each half of the study: where and when it ran, and what rerunning that half costs
LLAMA_KNOBS_RECORD = f"{KNOBS}/llama/ref-offload-s1234.json"
GLUE_KNOBS_RECORD = f"{KNOBS}/glue-sst2/ref-offload-s0.json"


def auto_verdict(n: dict[str, Any]) -> str:
    """The knobs report's verdicts (holds / fails / undecided) of the update interval's "auto" on both workloads."""
    said = [n["llama_verdict"], n["glue_verdict"]]
    if said.count("undecided") == len(said):
        return NOT_MEASURED
    return HOLDS if said.count("holds") == len(said) else PARTLY if "holds" in said else DOES_NOT_HOLD


CLAIMS = (
    Claim("C1", "up to 5× end-to-end speedup over ZeRO-Offload", "Fig. 1: A100 {a100_paper}, H100 {h100_paper}",
          (f"{LLAMA_XEON}/table.csv", f"{LLAMA_XEON}/ratios.csv", ZF_RECORD, f"{COST}/projection.csv",
           f"{COST}/projection-band.csv", f"{COST}/inverse.json", f"costmodel/{XEON}/validation.csv",
           f"{COST}/validation.csv", f"costmodel/{XEON}/validation.json", f"{COST}/validation.json"),
          speedup_numbers,
          "ref-zenflow {zf} over DeepSpeed ZeRO-Offload", "A100 {a100:.1f}×, H100 {h100:.1f}× (Llama-2-7B)",
          speedup_verdict,
          "holds if the 95% interval of ref-zenflow's speedup over DeepSpeed ZeRO-Offload lies above the paper's "
          "lowest ({paper_low:.1f}×); partly if above 1 but not that; no difference if it includes 1",
          ("Measured ({scenario}, {runs} runs, medians): ref-zenflow {zf_ms:.1f} vs DeepSpeed ZeRO-Offload "
           "{ds_ms:.1f} ms/step; DeepSpeed's ZenFlow {ds_zf}; ref-zenflow over ref-offload {ours} (" + TABLE_XEON
           + ").",
           "Projected by the cost model, never run on a GPU ([docs/cost-model.md](../docs/cost-model.md)): "
           "Llama-2-7B A100 {a100:.1f}×, H100 {h100:.1f}× ([projection](" + COST + "/projection.md)); over host "
           "assumptions A100 {a100_low:.1f}–{a100_high:.1f}×, H100 {h100_low:.1f}–{h100_high:.1f}× ([band](" + COST
           + "/projection-band.md)).",
           "The model against measured steps: within 15% at {xeon_in} of {xeon_n} points ([Xeon](costmodel/" + XEON
           + "/validation.md): {xeon_days}), {epyc_in} of {epyc_n} ([EPYC](" + COST + "/validation.md): "
           "{epyc_days}).",
           "Why below Fig. 1: the published step times imply ρ = offload time / compute = {rho_blog:.0f}, where the "
           "projection assumes {rho:.1f} ([inverse check](" + COST + "/inverse.md), [sensitivity](" + COST
           + "/sensitivity.png))."),
          WHERE, ((LLAMA_RUN, f"{LLAMA_XEON}/table.csv"), ("`make project`", ""))),
    Claim("C2", ">85% fewer GPU stalls", "Fig. 1: {a100_paper} (A100), {h100_paper} (H100)",
          (f"{LLAMA_XEON}/table.csv", ZF_RECORD, f"{COST}/projection.csv"), stall_numbers,
          "ref-zenflow −{zf_red:.1f}% against ref-offload ({zf_stall:.1f} vs {off_stall:.1f} ms/step)",
          "A100 −{a100_red:.0f}%, H100 −{h100_red:.0f}%", stall_verdict,
          "holds if ref-zenflow's stall per step is at least 85% below ref-offload's; partly if lower by less",
          ("DeepSpeed's ZenFlow against its ZeRO-Offload: −{ds_red:.1f}% (its stall includes its I/O) ("
           + TABLE_XEON + ").",
           "Projected: the host work is hidden at topk {topk}, update interval {interval:.0f}."),
          WHERE, ((LLAMA_RUN, f"{LLAMA_XEON}/table.csv"),)),
    Claim("C3", "≈2× less PCIe traffic", "\"{paper_zf}× model size vs {paper_off:.0f}×\"",
          (f"{LLAMA_XEON}/table.csv", ZF_RECORD), pcie_numbers,
          "counted per step: ref-zenflow {zf_bytes:.3f}×, ref-offload {off_bytes:.3f}× model bytes",
          "{zf_formula:.3f}× vs {off_formula:.3f}× (formula)", pcie_verdict,
          "holds if the counted bytes per step are within 5% of the paper's {paper_zf}× (ZenFlow) and "
          "{paper_off:.0f}× (ZeRO-Offload) model sizes; partly if only ZenFlow's are fewer",
          ("Counted by our byte counters (gradients down, parameters up); DeepSpeed: {ds_bytes} (no counters; NVML "
           "needs a GPU) (" + TABLE_XEON + ").",
           "The formula of [docs/design.md §2](../docs/design.md) at topk {topk}, update interval {interval:.0f}: "
           "{zf_formula:.3f}× against {off_formula:.3f}×, the same on any hardware."),
          WHERE, ((LLAMA_RUN, f"{LLAMA_XEON}/table.csv"),)),
    Claim("C4", "the speedup at the same update frequency", "— (ZenFlow updates on the host every U steps)",
          (f"{LLAMA_XEON}/table.csv", f"{LLAMA_XEON}/ratios.csv", f"{LLAMA_EPYC}/table.csv", ZF_RECORD),
          same_frequency_numbers,
          "ref-zenflow {over_gas} ref-offload-gas (ZeRO-Offload accumulating U steps)", "—",
          lambda n: faster(n["gas_low"], n["gas_high"]),
          "holds if ref-zenflow is faster than ref-offload-gas, which updates on the host as often, with a 95% "
          "interval above 1",
          ("{run:.0f} of {engines} engines run in one command, {runs} rounds, paired ratios with 95% intervals ("
           + TABLE_XEON + "): ref-zenflow {over_off} ref-offload ({zf_ms:.1f} vs {off_ms:.1f} ms/step), {over_gas} "
           "ref-offload-gas ({gas_ms:.1f}); ds-zenflow {ds_over} ds-zero-offload ({ds_zf_ms:.1f} vs {ds_ms:.1f}), "
           "{ds_over_gas} ds-zero-offload-gas ({ds_gas_ms:.1f}).",
           "Host optimizer / compute is {regime:.2f} here and {regime_epyc:.2f} on the EPYC: where the host costs "
           "less than compute, giving the worker one of two cores costs more than it hides.",
           "The control is not the same algorithm: it makes U× fewer updates with a U× larger batch, where ZenFlow "
           "updates the top-k columns every step."),
          WHERE, ((LLAMA_RUN, f"{LLAMA_XEON}/table.csv"),)),
    Claim("C5", "faster than ZeRO-Infinity, and the peers a user would pick",
          "ZeRO-Infinity is the paper's second baseline",
          (f"{LLAMA_XEON}/table.csv", f"{LLAMA_XEON}/ratios.csv", f"{CORES}/cores.csv", ZF_RECORD), peers_numbers,
          "ref-zenflow {inf} over DeepSpeed ZeRO-Infinity", "—", lambda n: faster(n["inf_low"], n["inf_high"]),
          "holds if ref-zenflow is faster than DeepSpeed ZeRO-Infinity with a 95% interval above 1",
          ("ref-zenflow over ds-zero-infinity {inf} ({inf_ms:.1f} ms/step), ds-twin-flow {twin} ({twin_ms:.1f}), "
           "the exact overlapped offload ref-offload-overlap {overlap} ({overlap_ms:.1f}), fsdp2-offload {fsdp} "
           "({fsdp_ms:.1f}), torchao's 8-bit AdamW without offload {ao8} ({ao8_ms:.1f}; final loss {ao8_loss:.3f} "
           "against no-offload's {bound_loss:.3f}) (" + TABLE_XEON + ").",
           "DeepSpeed's ZenFlow against the same: {ds_inf}, {ds_twin}, {ds_overlap}, {ds_fsdp}, {ds_ao8}.",
           "Not run here (why: under the table): {not_run}. Each peer computes what its baseline computes "
           "([docs/peers.md](../docs/peers.md)); at cpu-scale ZeRO-3's gathers and FSDP2's copies are memory "
           "copies, so these rows say which way the bookkeeping goes, not what the link costs.",
           "The worker's share of the cores against the default half ({cores_runs} rounds): ref-zenflow {cores_zf}; "
           "ds-zenflow {cores_ds} ([cores](" + CORES + "/cores.md))."),
          WHERE, ((LLAMA_RUN, f"{LLAMA_XEON}/table.csv"), (LLAMA_RUN + " `ARGS=--cores-ablation`",
                                                           f"{CORES}/cores.csv"))),
    Claim("C6", "the speedup survives to a loss or accuracy target", "— (the paper reports step time)",
          (f"{CONVERGENCE}/convergence.csv", f"{CONVERGENCE}/ref-zenflow-r0.json", f"{LLAMA_XEON}/table.csv",
           f"{GLUE_CURVE}/curve.csv", f"{CONVERGENCE_DS}/convergence.csv", f"{CONVERGENCE_DS}/{INTENDED}-r0.json",
           f"{GLUE_CURVE_DS}/curve.csv"), time_to_loss_numbers,
          "ref-zenflow to the baseline's loss: {llama_zf}; to its {glue_task} score: {glue_zf}", "—",
          time_to_target_verdict,
          "holds if ref-zenflow reaches DeepSpeed ZeRO-Offload's final Llama loss and its GLUE score in every round "
          "and seed, each with a speedup interval above 1; partly if one of the two",
          ("Step time over ds-zero-offload ({runs} runs, 95% intervals): {timed} (" + TABLE_XEON + ").",
           "Llama from random weights, {steps} steps, {conv_runs} rounds: step-time speedup → time to "
           "ds-zero-offload's final smoothed loss of the same round (median {target:.2f}, reached in {base_s:.0f} "
           "s): {engines} ([convergence](" + CONVERGENCE + "/convergence.md), [figure](" + CONVERGENCE
           + "/loss-vs-time.png)).",
           "GLUE {glue_task}, {glue_seeds} seeds: step-time speedup → time to ds-zero-offload's final dev score of "
           "the same seed (mean {glue_target:.1f}, reached in {glue_base_s:.0f} s): {glue} ([curve](" + GLUE_CURVE
           + "/curve.md), [figure](" + GLUE_CURVE + "/accuracy-vs-time.png)).",
           "DeepSpeed's ZenFlow as shipped (0.19.8, scrambled weights: divergence G) and as its authors intended ("
           + INTENDED + "), each interleaved with ds-zero-offload on {ds_hw}, {ds_day}: Llama, {ds_llama_runs} rounds "
           "(target {ds_llama_target:.2f}): {ds_llama} ([convergence](" + CONVERGENCE_DS + "/convergence.md)); GLUE "
           "SST-2, {ds_glue_seeds} seeds (target {ds_glue_target:.1f}): {ds_glue} ([curve](" + GLUE_CURVE_DS
           + "/curve.md)).",
           "Every speedup is paired by round or seed; an engine that misses the target once gets no interval."),
          WHERE, ((LLAMA_RUN + " `ARGS=--convergence`", f"{CONVERGENCE}/convergence.csv"),
                  ("`python reproduce/glue.py --tasks SST-2 --seeds 0 1 2 3 4 --eval-every 16 --out "
                   "results/glue/<hardware-id>/curve`", f"{GLUE_CURVE}/curve.csv"))),
    Claim("C7", "beyond the paper: the interval's sums on the device", "— (the paper sums on the host every step)",
          (f"{LLAMA_XEON}/table.csv", ZF_RECORD, f"{COST}/projection.csv", f"{COST}/inverse.json"),
          device_accumulation_numbers,
          "ref-zenflow-da moves {da_bytes:.3f}× model bytes per step, ref-zenflow {zf_bytes:.3f}×",
          "A100 {a100:.1f}×, H100 {h100:.1f}× over ZeRO-Offload", lambda n: PROJECTED_ONLY,
          "its GPU speedup can only be projected here: at cpu-scale the device is the CPU, so the sums land on the "
          "training thread",
          ("ref-zenflow-da {da_ms:.1f} ms/step against ref-zenflow {zf_ms:.1f} ({da_over_zf:.2f}×); counted "
           "{da_bytes:.3f}× model bytes per step against {zf_bytes:.3f}× (formula {da_formula:.3f}×) (" + TABLE_XEON
           + ").",
           "PROJECTED, never run on a GPU: Llama-2-7B A100 {a100:.1f}×, H100 {h100:.1f}× over ZeRO-Offload "
           "(ZenFlow {a100_zf:.1f}×, {h100_zf:.1f}×); at the blog's inputs {blog:.1f}× against {blog_zf:.1f}× "
           "([inverse check](" + COST + "/inverse.md))."),
          WHERE, ((LLAMA_RUN, f"{LLAMA_XEON}/table.csv"), ("`make project`", ""))),
    Claim("C8", "selection by column norms, not a gradient all-gather", "blog: \">{blog_ratio:,}× less "
          "communication\"", (f"{SCALING}/table.md", f"{LLAMA_EPYC}/nproc-2/ref-zenflow-r0.json"),
          selection_numbers,
          "{cpu_ratio:,.0f}× fewer bytes per selection here ({cpu_norms:.3f} vs {cpu_grads:.1f} MB per rank)",
          "Llama-2-7B {l7_ratio:,.0f}× (computed)", selection_verdict,
          "holds if one selection of Llama-2-7B as we send it (fp32 norms) is {blog_ratio:,}× smaller than the "
          "all-gather; partly if only with bf16 norms",
          ("Counted at the first step of a data-parallel run ({ranks} ranks, gloo): {cpu_norms:.3f} MB of fp32 "
           "column norms per rank where an all-gather of the bf16 gradients would send {cpu_grads:.1f} MB ([scaling]("
           + SCALING + "/table.md)).",
           "Computed for Llama-2-7B: {l7_norms:.2f} MB vs {l7_grads_gb:.1f} GB, {l7_ratio:,.0f}× ({l7_bf16:,.0f}× "
           "with bf16 norms); Llama-2-13B {l13_ratio:,.0f}×. One norm per column: the ratio is about a weight's "
           "rows / 2."),
          WHERE + ", {ranks} ranks",
          (("`make reproduce-llama7b NPROC=2`", f"{LLAMA_EPYC}/nproc-2/ref-zenflow-r0.json"),
           ("`python reproduce/scaling.py`", ""))),
    Claim("C9", "no accuracy loss on GLUE", "Fig. 1 right: 0.915 → 0.919 (Llama-2-7B)",
          (f"{GLUE_XEON}/table.csv", f"{GLUE_XEON}/parity.csv", f"{GLUE_EPYC}/table.csv", f"{GLUE_EPYC}/parity.csv",
           f"{STUDY}/table.csv", f"{GLUE_XEON}/SST-2-ref-zenflow-s0.json"), glue_numbers,
          "ref-zenflow {zf:.1f} ± {zf_sd:.1f} vs ref-offload {off:.1f} ± {off_sd:.1f} ({diff:+.1f} points)", "—",
          glue_verdict,
          "holds if ref-zenflow's mean is within twice the larger seed spread of ref-offload's (the GLUE table's "
          "parity rule)",
          ("{seeds:.0f} seeds, mean of SST-2 and MRPC, MiniLM-L6 fine-tuned in fp32 ([table](" + GLUE_XEON
           + "/table.md), [docs/glue.md](../docs/glue.md)).",
           "DeepSpeed's ZenFlow as shipped: {ds:.1f} ± {ds_sd:.1f} ({ds_diff:+.1f}, {ds_parity}): 0.19.8 fine-tunes "
           "from scrambled weights (divergence G). On " + EPYC + ", as shipped {ds_epyc:.1f} ± {ds_epyc_sd:.1f} "
           "({ds_epyc_diff:+.1f}, {ds_epyc_parity}); as its authors intended (" + INTENDED + ", the weight view of "
           "0.17.5–0.19.6), {int_seeds:.0f} seeds: {int:.1f} ± {int_sd:.1f} ({int_diff:+.1f}, {int_parity}) ([table]("
           + GLUE_EPYC + "/table.md)).",
           "Paired by seed, ZenFlow's deficit has a 95% interval of {d_low:+.1f}…{d_high:+.1f}; at 3 epochs "
           "{e3:+.1f} ({e3_low:+.1f}…{e3_high:+.1f}) ([study](" + STUDY + "/table.md)).",
           "Repeated on " + EPYC + ": {same} of {runs} runs identical, the rest within {max_diff:.1f} ([table]("
           + GLUE_EPYC + "/table.md))."),
          WHERE, (("`make reproduce-glue`", f"{GLUE_XEON}/table.csv"), ("`make reproduce-glue-study`", ""))),
    Claim("C10", "the update step's cost is half hidden in the accumulation steps",
          "example: update {ex_ratio:.1f}× an accumulate step, {ex_hidden:.2f} hidden",
          (f"{LLAMA_XEON}/step-trace.csv", ZF_RECORD), step_trace_numbers,
          "ref-zenflow: update {zf_ratio:.2f}× an accumulate step, {zf_hidden:.2f} [{zf_hidden_low:.2f}…"
          "{zf_hidden_high:.2f}] of the host update hidden", "—", hidden_verdict,
          "holds if the 95% interval of the share of the host update hidden in the accumulation steps, 1 − (update − "
          "accumulate) / (ZeRO-Offload − accumulate), lies at or above 0.4 (the example's \"half\"); partly if above 0",
          ("The example (DeepSpeedExamples' ZenFlow fine-tuning README): accumulation steps {ex_acc:.0f} ms, the "
           "update step {ex_up:.0f} ms, a full ZeRO-Offload update {ex_off:.0f} ms.",
           "Here ({trace_runs} runs, medians): ref-zenflow accumulates in {zf_acc:.1f} ms and updates in {zf_up:.1f} "
           "ms where ref-offload's step takes {zf_off:.1f}; DeepSpeed's ZenFlow {ds_acc:.1f} and {ds_up:.1f} ms "
           "against its ZeRO-Offload's {ds_off:.1f} ({ds_ratio:.2f}×, {ds_hidden:.2f} hidden) ([trace](" + LLAMA_XEON
           + "/step-trace.png), [table](" + LLAMA_XEON + "/step-trace.csv)).",
           "A share below 0 means the update step costs more than a whole ZeRO-Offload step: at cpu-scale the host "
           "worker and the training thread share two cores."),
          WHERE, ((LLAMA_RUN, f"{LLAMA_XEON}/step-trace.csv"),)),
    Claim("C11", "auto-tuned intervals need no tuning",
          "tutorial: \"auto\" intervals; blog: \"no manual parameter tuning\"",
          (f"{KNOBS}/verdict.json", f"{KNOBS}/knobs.csv", LLAMA_KNOBS_RECORD, GLUE_KNOBS_RECORD),
          knobs_numbers,
          "Llama: {llama_said}; SST-2: {glue_said}", "—", auto_verdict,
          "auto holds on a workload if its time to target (over ref-offload's, paired by seed) is within the 95% "
          "interval of the best fixed setting's, or below it (stated before the study ran); holds if on both, partly "
          "if on one; a workload where no fixed setting reached the target cannot decide",
          ("ref-zenflow at update interval 1, 2, 4, 8 and \"auto\", topk 0.05, 0.1, 0.2 and select interval fixed or "
           "\"auto\", beside ref-offload, seeds interleaved ([knobs](" + KNOBS + "/knobs.md), [frontier](" + KNOBS
           + "/frontier.png), [the intervals auto chose](" + KNOBS + "/auto-intervals.png)).",
           "Llama convergence workload, from random weights ({llama_seeds} seeds; target: ref-offload's final "
           "smoothed loss): update interval auto **{llama_verdict}** ({llama_why}); the best fixed setting "
           "{llama_best}; select interval auto {llama_select}.",
           "GLUE SST-2 ({glue_seeds} seeds; target: ref-offload's final dev accuracy): update interval auto "
           "**{glue_verdict}** ({glue_why}); the best fixed setting {glue_best}; select interval auto {glue_select}.",
           "At a target chosen after these could not decide (per seed the worst final result of ref-offload and "
           "the ref-zenflow settings, which each reaches; not the rule's verdict): Llama, auto {llama_common_auto} "
           "against the best fixed {llama_common_best}: {llama_common}; SST-2, auto {glue_common_auto} against "
           "{glue_common_best}: {glue_common}.",
           "Times to target are over ref-offload's with the same seed (below 1: faster), geometric means of the "
           "paired ratios with their 95% intervals.",
           "DeepSpeed's ZenFlow with \"auto\" as shipped (docs/design.md §7): Llama: {llama_ds}; SST-2: {glue_ds}."),
          WHERE, (("`make reproduce-knobs ARGS='--workloads llama' BUDGET=25`", LLAMA_KNOBS_RECORD),
                  ("`make reproduce-knobs ARGS='--workloads glue' BUDGET=35`", GLUE_KNOBS_RECORD))),
)
