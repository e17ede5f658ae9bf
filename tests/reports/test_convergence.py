"""Loss against wall time (reports/convergence.py, issue 24): time to the baseline's final smoothed loss, the loss
at equal time and the time-to-loss speedup, on records whose answers are worked out by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from zenflow.harness.records import RunRecord
from zenflow.reports.convergence import convergence_report, convergence_rows, curve, window_for


def run(engine: str, losses: list[float], period_ms: float) -> RunRecord:
    return RunRecord(engine=engine, status="ok", protocol={"telemetry": True},
                     steps=[{"step": i, "loss": v, "period_ms": period_ms} for i, v in enumerate(losses)])


LINE = [10.0 - 0.1 * i for i in range(40)]  # the baseline's losses: its final smoothed loss is the mean of the last 8
WINDOW = window_for(len(LINE))


def test_the_same_losses_in_half_the_time_is_a_2x_time_to_loss_speedup() -> None:
    rows, facts = convergence_rows([run("ds-zero-offload", LINE, 100.0), run("ref-zenflow", LINE, 50.0)],
                                   {"ds-zero-offload": 1.0, "ref-zenflow": 2.0})
    by = {r["engine"]: r for r in rows}
    assert facts["target"] == pytest.approx(sum(LINE[-WINDOW:]) / WINDOW)
    assert WINDOW == 8 and facts["window"] == 8  # a fifth of 40 steps
    assert by["ds-zero-offload"]["time_to_target_s"] == pytest.approx(4.0)  # its own last step: 40 x 100 ms
    assert by["ref-zenflow"]["time_to_target_s"] == pytest.approx(2.0)
    assert by["ref-zenflow"]["time_to_loss_speedup"] == pytest.approx(2.0)
    assert facts["equal_time_s"] == pytest.approx(2.0)  # the shorter run's whole time
    assert by["ds-zero-offload"]["loss_at_equal_time"] == pytest.approx(sum(LINE[12:20]) / WINDOW)  # step 19 at 2 s


def test_a_faster_step_that_learns_slower_does_not_reach_the_target() -> None:
    """The negative control: twice the step rate, half the progress per step: a 2x step-time speedup, and the
    target is not reached at all in the same number of steps."""
    slow = [10.0 - 0.05 * i for i in range(40)]
    rows, _ = convergence_rows([run("ds-zero-offload", LINE, 100.0), run("ref-zenflow", slow, 50.0)],
                               {"ref-zenflow": 2.0})
    zen = next(r for r in rows if r["engine"] == "ref-zenflow")
    assert zen["step_time_speedup"] == 2.0 and zen["time_to_target_s"] is None and zen["reached"] == "0 of 1"
    assert zen["time_to_loss_speedup"] is None


def test_smoothing_is_the_trailing_mean_over_a_fifth_of_the_run() -> None:
    points = curve(run("x", list(range(WINDOW + 2)), 10.0), WINDOW)
    assert len(points) == 3 and points[0] == pytest.approx((WINDOW * 0.01, (WINDOW - 1) / 2))
    assert (window_for(10), window_for(24), window_for(168), window_for(10_000)) == (4, 4, 32, 32)


def test_report_files_and_no_baseline_means_no_report(tmp_path: Path) -> None:
    records = [run("ref-offload", LINE, 100.0), run("ref-zenflow", LINE, 80.0)]  # ref-offload is the fallback
    text = convergence_report(records, {"ref-offload": {"speedup": None}, "ref-zenflow": {"speedup": 1.25}},
                              tmp_path, "test")
    assert "ref-offload's final smoothed loss" in text and "1.25×" in text
    assert {p.name for p in tmp_path.iterdir()} == {"convergence.md", "convergence.csv", "loss-vs-time.png"}
    empty = tmp_path / "none"
    empty.mkdir()
    assert convergence_report([run("ref-zenflow", LINE, 80.0)], {"ref-zenflow": {}}, empty, "test") is None
    assert not list(empty.iterdir())
