"""GLUE accuracy against training time (reports/glue_curve.py, issue 24): the target is ZeRO-Offload's final score,
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
    records = [run("ds-zero-offload", 0, [(10, 60), (20, 70), (30, 80)]),
               run("ds-zero-offload", 1, [(10, 62), (20, 72), (30, 84)]),   # mean final 82, reached at 30 s
               run("ref-zenflow", 0, [(5, 70), (10, 83), (15, 84)]),        # 83 >= 82 at 10 s: 3x
               run("ref-offload", 0, [(4, 50), (8, 60), (12, 81.9)])]       # just below: not reached
    rows = {r["engine"]: r for r in curve_rows(records)}
    assert rows["ds-zero-offload"]["target"] == pytest.approx(82.0) and rows["ds-zero-offload"]["seeds"] == 2
    assert rows["ds-zero-offload"]["time_to_target_s"] == pytest.approx(30.0)
    zen = rows["ref-zenflow"]
    assert zen["time_to_target_s"] == 10 and zen["time_to_accuracy_speedup"] == pytest.approx(3.0)
    assert zen["step_time_speedup"] == pytest.approx(2.0)
    assert rows["ref-offload"]["time_to_target_s"] is None and rows["ref-offload"]["time_to_accuracy_speedup"] is None
    text = "\n".join(curve_report(records, tmp_path, "test"))
    assert "not reached" in text and (tmp_path / "accuracy-vs-time.png").stat().st_size > 0


def test_records_without_curves_make_no_report(tmp_path) -> None:
    plain = RunRecord(engine="ref-zenflow", status="ok", metrics={"task": "MRPC", "score": 80.0})
    assert curve_report([plain], tmp_path, "test") == [] and not (tmp_path / "curve.md").exists()
