"""The knobs study's report (zenflow/reports/knobs.py): the "auto" verdict rule on synthetic intervals, and time to
target paired by seed against ref-offload on synthetic GLUE records, through to knobs.csv and verdict.json."""

from __future__ import annotations

import json
import math
import statistics

import pytest
from scipy.stats import t as student_t

from zenflow.harness.configs import GLUE_BLOCK
from zenflow.harness.records import RunRecord
from zenflow.harness.tables import read_csv
from zenflow.reports.intervals import Interval
from zenflow.reports.knobs import auto_verdict, knobs_report, setting_of, setting_rows, times_to_target

BEST = Interval(0.80, 0.70, 0.90, 3)  # the best fixed setting: 0.80× ref-offload's time, [0.70–0.90]
WORSE = Interval(1.10, 1.00, 1.20, 3)


@pytest.mark.parametrize(("auto", "verdict"), [
    (Interval(0.85, 0.60, 1.10, 3), "holds"),   # inside the best fixed setting's interval
    (Interval(0.90, 0.85, 0.95, 3), "holds"),   # on its upper bound
    (Interval(0.60, 0.55, 0.65, 3), "holds"),   # below it: faster than the best fixed setting
    (Interval(0.95, 0.70, 1.20, 3), "fails"),   # above it, though the intervals overlap
    (Interval(1.05, 1.00, 1.10, 3), "fails"),   # within a worse fixed setting's: not enough
    (None, "fails"),                            # missed the target with some seed
], ids=["inside", "on-the-bound", "below", "above-overlapping", "inside-a-worse-one", "missed"])
def test_auto_holds_only_within_or_below_the_best_fixed_settings_interval(auto, verdict):
    judged = auto_verdict(auto, {"U=2": WORSE, "U=4": BEST, "U=8": None})
    assert judged["verdict"] == verdict, judged
    assert judged["best_fixed"] == "U=4" and judged["best_fixed_high"] == BEST.high


def test_no_verdict_without_a_fixed_setting_to_judge_against():
    assert auto_verdict(Interval(0.8, 0.7, 0.9, 3), {"U=4": None})["verdict"] == "undecided"
    one_seed = auto_verdict(Interval(0.8, None, None, 1), {"U=4": Interval(0.9, None, None, 1)})
    assert one_seed["verdict"] == "undecided" and "one seed" in one_seed["why"]


def _glue(engine: str, seed: int, update_interval: int | str, scores: list[float], step_s: float) -> RunRecord:
    """A GLUE run: dev scores every 16 steps of step_s seconds each, its block, steps naming host updates."""
    block = {"topk_ratio": 0.0, "update_interval": 1} if engine == "ref-offload" else {
        **GLUE_BLOCK, "update_interval": update_interval}
    curve = [{"step": 16 * (i + 1), "train_s": 16 * (i + 1) * step_s, "score": s} for i, s in enumerate(scores)]
    every = 3 if update_interval == "auto" else int(update_interval)
    steps = [{"step": i, "kind": "update", "period_ms": step_s * 1e3, "loss": 0.5,
              "decisions": {"host_update": 1} if i % every == every - 1 else None} for i in range(16 * len(scores))]
    return RunRecord(engine=engine, label="glue/SST-2", config={"zero_optimization": {"zenflow": block}},
                     workload={"kind": "glue", "task": "SST-2", "seed": seed}, steps=steps,
                     summary={"cycle_mean_ms": step_s * 1e3},
                     metrics={"task": "SST-2", "score": scores[-1], "curve": curve})


def test_report_pairs_time_to_target_by_seed_and_writes_the_verdict(tmp_path):
    base = [_glue("ref-offload", s, 1, [80, 85, 88, 90], 1.0 + 0.05 * s) for s in range(3)]  # 90 at step 64
    fixed = [_glue("ref-zenflow", s, 4, [86, 90 + s, 91, 92], 0.5) for s in range(3)]  # 90 at step 32
    slow = [_glue("ref-zenflow", s, 8, [80, 82, 84, 86], 0.4) for s in range(3)]  # never: no ratio
    auto = [_glue("ref-zenflow", s, "auto", [84, 88, 90, 91], 0.5 + 0.01 * s) for s in range(3)]  # 90 at step 48
    judged = knobs_report({"glue": [*base, *fixed, *slow, *auto]}, tmp_path, {})
    rows = {r["setting"]: r for r in read_csv(tmp_path / "knobs.csv") if r["target"] == "ref-offload"}
    fixed_row, auto_row = rows["ref-zenflow U=4 S=32 k=0.1"], rows["ref-zenflow U=auto S=32 k=0.1"]
    def paired(steps: int, step_s) -> tuple[float, float, float]:
        """The geometric mean of the ratios to ref-offload's, seed by seed, and Student's t 95% interval."""
        logs = [math.log(steps * step_s(s) / (64 * (1.0 + 0.05 * s))) for s in range(3)]
        half = student_t.ppf(0.975, 2) * statistics.stdev(logs) / math.sqrt(3)
        return tuple(math.exp(statistics.fmean(logs) + d) for d in (0, -half, half))

    assert fixed_row["relative_time"] == pytest.approx(paired(32, lambda s: 0.5)[0]) and fixed_row["reached"] == 3
    assert [auto_row[k] for k in ("relative_time", "relative_time_low", "relative_time_high")] == pytest.approx(
        paired(48, lambda s: 0.5 + 0.01 * s))
    assert rows["ref-zenflow U=8 S=32 k=0.1"]["relative_time"] is None
    assert rows["ref-zenflow U=8 S=32 k=0.1"]["reached"] == 0
    assert auto_row["interval_median"] == 3  # the intervals the steps' decisions name
    verdict = json.loads((tmp_path / "verdict.json").read_text())["workloads"]["glue"]
    assert verdict == json.loads(json.dumps(judged["glue"]))
    # auto took 1.5 times the fixed setting's steps at about its step time: above its interval
    assert verdict["ref-zenflow U=auto S=32 k=0.1"]["verdict"] == "fails" == auto_row["verdict"]
    assert {"knobs.md", "frontier.png", "auto-intervals.png"} <= {p.name for p in tmp_path.iterdir()}


def test_the_common_target_is_the_worst_final_result_and_every_setting_of_ours_reaches_it(tmp_path):
    """Per seed the common target is the worst final score of ref-offload and every ref-zenflow setting (here U=8's
    86), so the setting that missed ref-offload's own final score gets a time too; the rule judges "auto" there."""
    base = [_glue("ref-offload", s, 1, [80, 85, 88, 90], 1.0) for s in range(3)]  # 86 first reached at step 48
    fixed = [_glue("ref-zenflow", s, 4, [86 + 0.1 * s, 90, 91, 92], 0.5) for s in range(3)]  # at step 16
    slow = [_glue("ref-zenflow", s, 8, [80, 82, 84, 86], 0.4) for s in range(3)]  # at its last point, step 64
    auto = [_glue("ref-zenflow", s, "auto", [84, 88, 90, 91], 0.5 + 0.01 * s) for s in range(3)]  # at step 32
    ds = [_glue("ds-zenflow", s, "auto", [50, 50, 50, 50], 0.5) for s in range(3)]  # not ours: no say in the target
    knobs_report({"glue": [*base, *fixed, *slow, *auto, *ds]}, tmp_path, {})
    rows = {r["setting"]: r for r in read_csv(tmp_path / "knobs.csv") if r["target"] == "common"}
    assert rows["ref-zenflow U=8 S=32 k=0.1"]["reached"] == 3
    assert rows["ref-zenflow U=8 S=32 k=0.1"]["relative_time"] == pytest.approx(64 * 0.4 / 48)
    assert rows["ref-zenflow U=4 S=32 k=0.1"]["relative_time"] == pytest.approx(16 * 0.5 / 48)
    assert rows["ds-zenflow U=auto S=32 k=0.1"]["reached"] == 0  # 50 never gets to 86
    common = json.loads((tmp_path / "verdict.json").read_text())["common_target"]
    judged = common["workloads"]["glue"]["ref-zenflow U=auto S=32 k=0.1"]
    assert judged["verdict"] == "fails" and judged["best_fixed"] == "ref-zenflow U=4 S=32 k=0.1"
    assert "worst final result" in common["target"] and "At the common target" in (tmp_path / "knobs.md").read_text()


def _llama(engine: str, seed: int, update_interval: int, loss: float, steps: int = 20) -> RunRecord:
    """A Llama run of `steps` steps of 0.1 s at a constant loss (its smoothed loss is `loss` throughout)."""
    block = {"topk_ratio": 0.0, "update_interval": 1} if engine == "ref-offload" else {
        "topk_ratio": 0.1, "update_interval": update_interval, "select_interval": 64}
    return RunRecord(engine=engine, label="llama7b", config={"zero_optimization": {"zenflow": block}},
                     workload={"kind": "llama", "seed": seed}, summary={"cycle_mean_ms": 100.0},
                     steps=[{"step": i, "kind": "update", "period_ms": 100.0, "loss": loss} for i in range(steps)])


def test_llamas_common_target_is_the_highest_final_loss_of_ref_offload_and_ours():
    """COMMON on a loss: per seed the highest final smoothed loss among ref-offload and every ref-zenflow
    setting (the worst), which each of them reaches by its last step; DeepSpeed's runs have no say."""
    records = [_llama("ref-offload", 0, 1, 2.0), _llama("ref-zenflow", 0, 4, 2.5), _llama("ref-zenflow", 0, 8, 1.5),
               _llama("ds-zenflow", 0, 4, 9.0)]
    times, facts = times_to_target(records, common=True)
    assert facts["targets"] == {0: 2.5}
    assert all(times[setting_of(r)][0] is not None for r in records[:3])  # each of them reaches it
    assert times_to_target(records)[1]["targets"] == {0: 2.0}  # ref-offload's own final loss otherwise


def test_a_setting_that_misses_the_target_with_any_seed_has_no_time_to_target():
    """"A setting that misses the target with any seed gets no ratio", nor a time to target: not the
    median over the seeds that reached."""
    records = [_llama("ref-offload", s, 1, 2.0) for s in range(3)]
    records += [_llama("ref-zenflow", s, 4, 1.0 if s < 2 else 3.0) for s in range(3)]  # seed 2 never gets to 2.0
    records += [_llama("ref-zenflow", s, 8, 1.0) for s in range(3)]  # the control: every seed reaches
    rows, _ = setting_rows(records, "llama")
    by = {r["setting"]: r for r in rows}
    missed, every = by["ref-zenflow U=4 S=64 k=0.1"], by["ref-zenflow U=8 S=64 k=0.1"]
    assert (missed["reached"], missed["compared"]) == (2, 3)
    assert missed["time_to_target_s"] is None and missed["relative_time"] is None
    assert every["time_to_target_s"] is not None and every["reached"] == 3
