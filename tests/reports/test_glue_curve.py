"""GLUE accuracy against training time (reports/glue_curve.py): the target is ZeRO-Offload's final score,
time to target is the first point at or above it, and an engine that never gets there says so."""

from __future__ import annotations

import pytest

from zenflow.harness.records import RunRecord
from zenflow.reports.glue_curve import curve_report, curve_rows


def run(engine: str, seed: int, points: list[tuple[float, float]]) -> RunRecord:
    curve = [{"step": 10 * (i + 1), "train_s": t, "score": s} for i, (t, s) in enumerate(points)]
    return RunRecord(engine=engine, status="ok", workload={"kind": "glue", "task": "MRPC", "seed": seed},
                     metrics={"task": "MRPC", "score": curve[-1]["score"], "curve": curve})


def test_time_to_the_baselines_final_score_and_not_reached(tmp_path) -> None:
    records = [run("ds-zero-offload", 0, [(10, 60), (20, 70), (30, 80)]),    # seed 0's target 80, at 30 s
               run("ds-zero-offload", 1, [(10, 62), (20, 72), (30, 84)]),    # seed 1's target 84, at 30 s
               run("ref-zenflow", 0, [(5, 70), (10, 83), (15, 84)]),         # 83 >= 80 at 10 s: 3x
               run("ref-zenflow", 1, [(5, 70), (10, 80), (15, 85)]),         # 85 >= 84 at 15 s: 2x
               run("ref-offload", 0, [(4, 50), (8, 60), (12, 79.9)])]        # just below: not reached
    rows = {r["engine"]: r for r in curve_rows(records)}
    assert rows["ds-zero-offload"]["target"] == pytest.approx(82.0) and rows["ds-zero-offload"]["seeds"] == 2
    assert rows["ds-zero-offload"]["time_to_target_s"] == pytest.approx(30.0)
    zen = rows["ref-zenflow"]
    assert zen["time_to_target_s"] == pytest.approx(12.5)  # the median of 10 and 15
    assert zen["time_to_accuracy_speedup"] == pytest.approx(6 ** 0.5)  # paired by seed: the geometric mean of 3, 2
    assert zen["time_to_accuracy_speedup_low"] < 2 < 3 < zen["time_to_accuracy_speedup_high"]  # 2 seeds: wide
    assert zen["step_time_speedup"] == pytest.approx(2.0) and zen["step_time_speedup_low"] == pytest.approx(2.0)
    assert rows["ref-offload"]["time_to_target_s"] is None and rows["ref-offload"]["time_to_accuracy_speedup"] is None
    text = "\n".join(curve_report(records, tmp_path, "test"))
    assert "not reached" in text and (tmp_path / "accuracy-vs-time.png").stat().st_size > 0
    assert "2.45× [" in text  # the interval is in the table


def test_each_seed_is_held_to_its_own_baseline() -> None:
    """The negative control on the pairing: seed 1's run ends at 83, above the seeds' mean target (82) but below
    its own seed's (84): not reached, so no speedup, though it would pass against the mean."""
    records = [run("ds-zero-offload", 0, [(10, 60), (20, 70), (30, 80)]),
               run("ds-zero-offload", 1, [(10, 62), (20, 72), (30, 84)]),
               run("ref-zenflow", 0, [(5, 70), (10, 83), (15, 84)]),
               run("ref-zenflow", 1, [(5, 70), (10, 80), (15, 83)])]
    zen = next(r for r in curve_rows(records) if r["engine"] == "ref-zenflow")
    assert (zen["reached"], zen["compared"]) == (1, 2)
    assert zen["time_to_accuracy_speedup"] is None and zen["time_to_target_s"] is None


def test_the_target_is_the_baselines_final_score_not_its_best() -> None:
    """A dev score that peaks and falls back (85 at 20 s, 80 at the end): the target is the final 80, which the
    baseline first reached at 20 s and ref-zenflow at 10 s (2x); against the best (85) it would never get there."""
    records = [run("ds-zero-offload", 0, [(10, 60), (20, 85), (30, 80)]),
               run("ref-zenflow", 0, [(5, 70), (10, 82), (15, 83)])]
    rows = {r["engine"]: r for r in curve_rows(records)}
    assert rows["ds-zero-offload"]["target"] == pytest.approx(80.0)
    assert rows["ds-zero-offload"]["time_to_target_s"] == pytest.approx(20.0)
    zen = rows["ref-zenflow"]
    assert zen["time_to_target_s"] == pytest.approx(10.0) and zen["time_to_accuracy_speedup"] == pytest.approx(2.0)


def test_records_without_curves_make_no_report(tmp_path) -> None:
    plain = RunRecord(engine="ref-zenflow", status="ok", metrics={"task": "MRPC", "score": 80.0})
    assert curve_report([plain], tmp_path, "test") == [] and not (tmp_path / "curve.md").exists()
