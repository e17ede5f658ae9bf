"""Loss against wall time (reports/convergence.py): time to the baseline's final smoothed loss, the loss
at equal time and the time-to-loss speedup, on records whose answers are worked out by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from zenflow.harness.records import RunRecord
from zenflow.reports.convergence import convergence_report, convergence_rows, curve, window_for
from zenflow.reports.intervals import Interval


def run(engine: str, losses: list[float], period_ms: float, repeat: int = 0) -> RunRecord:
    return RunRecord(engine=engine, status="ok", protocol={"telemetry": True, "repeat": repeat},
                     steps=[{"step": i, "loss": v, "period_ms": period_ms} for i, v in enumerate(losses)])


def one_run(value: float) -> Interval:
    return Interval(value, None, None, 1)


LINE = [10.0 - 0.1 * i for i in range(40)]  # the baseline's losses: its final smoothed loss is the mean of the last 8
WINDOW = window_for(len(LINE))


def test_the_same_losses_in_half_the_time_is_a_2x_time_to_loss_speedup() -> None:
    rows, facts = convergence_rows([run("ds-zero-offload", LINE, 100.0), run("ref-zenflow", LINE, 50.0)],
                                   {"ds-zero-offload": one_run(1.0), "ref-zenflow": one_run(2.0)})
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
                               {"ref-zenflow": one_run(2.0)})
    zen = next(r for r in rows if r["engine"] == "ref-zenflow")
    assert zen["step_time_speedup"] == 2.0 and zen["time_to_target_s"] is None
    assert (zen["reached"], zen["compared"]) == (0, 1) and zen["time_to_loss_speedup"] is None


def shifted(losses: list[float], by: float) -> list[float]:
    return [v + by for v in losses]


def test_rounds_are_paired_each_against_its_own_baseline() -> None:
    """Three rounds (seeds) whose loss levels differ by a unit: in each, the engine follows its own round's baseline
    loss for loss at 0.5x, 0.48x and 0.52x its step time. Paired by round, the time-to-loss speedup is ~2 with a
    tight interval; against the median round's target instead, the low round would reach it at once and the high
    round never (the negative control on the pairing)."""
    periods = {0: 50.0, 1: 48.0, 2: 52.0}
    records = [run("ds-zero-offload", shifted(LINE, rep - 1.0), 100.0, rep) for rep in periods]
    records += [run("ref-zenflow", shifted(LINE, rep - 1.0), ms, rep) for rep, ms in periods.items()]
    rows, facts = convergence_rows(records, {"ref-zenflow": Interval(2.0, 1.9, 2.1, 3)})
    zen = next(r for r in rows if r["engine"] == "ref-zenflow")
    assert facts["targets"][0] == pytest.approx(facts["target"] - 1.0)  # each round its own target
    assert (zen["reached"], zen["compared"], zen["runs"]) == (3, 3, 3)
    expected = (100 / 50 * 100 / 48 * 100 / 52) ** (1 / 3)  # the geometric mean of the paired ratios
    assert zen["time_to_loss_speedup"] == pytest.approx(expected)
    assert 1.75 < zen["time_to_loss_speedup_low"] < expected < zen["time_to_loss_speedup_high"] < 2.3  # t(2) = 4.3
    assert zen["step_time_speedup_low"] == 1.9
    median_target = facts["target"]
    high_round = curve(records[5], facts["window"])  # round 2: a unit above round 1's target at its end
    assert all(loss > median_target for _, loss in high_round)


def test_a_round_that_misses_the_target_takes_the_speedup_away() -> None:
    """Two rounds reach the target twice as fast; in the third the engine learns half as fast and misses it: no
    speedup (a median over the rounds that made it would say 2x), and the cell says how many rounds reached it."""
    slow = [10.0 - 0.05 * i for i in range(40)]
    records = [run("ds-zero-offload", LINE, 100.0, rep) for rep in range(3)]
    records += [run("ref-zenflow", LINE, 50.0, 0), run("ref-zenflow", LINE, 50.0, 1), run("ref-zenflow", slow, 50.0, 2)]
    rows, _ = convergence_rows(records, {})
    zen = next(r for r in rows if r["engine"] == "ref-zenflow")
    assert (zen["reached"], zen["compared"]) == (2, 3)
    assert zen["time_to_loss_speedup"] is None and zen["time_to_target_s"] is None
    base = next(r for r in rows if r["engine"] == "ds-zero-offload")
    assert base["time_to_loss_speedup"] == pytest.approx(1.0) and base["time_to_loss_speedup_low"] == pytest.approx(1)


def test_with_both_baselines_the_target_comes_from_ds_zero_offload() -> None:
    """ds-zero-offload, else ref-offload: ref-offload's losses are a unit higher here, and ref-zenflow follows them
    loss for loss, so it would reach ref-offload's target; ds-zero-offload's, a unit lower, it never reaches."""
    rows, facts = convergence_rows([run("ref-offload", shifted(LINE, 1.0), 100.0), run("ds-zero-offload", LINE, 100.0),
                                    run("ref-zenflow", shifted(LINE, 1.0), 50.0)], {})
    assert facts["baseline"] == "ds-zero-offload"
    assert facts["target"] == pytest.approx(sum(LINE[-WINDOW:]) / WINDOW)
    zen = next(r for r in rows if r["engine"] == "ref-zenflow")
    assert (zen["reached"], zen["compared"]) == (0, 1) and zen["time_to_target_s"] is None


def run_with_warmup(engine: str, losses: list[float], period_ms: float, warmup_ms: float,
                    warmup: int = 4) -> RunRecord:
    """A record as the harness writes it: the first `warmup` steps are "warmup", then accumulate/update (U = 4)."""
    steps = [{"step": i, "loss": v, "kind": "warmup" if i < warmup else "update" if i % 4 == 3 else "accumulate",
              "period_ms": warmup_ms if i < warmup else period_ms} for i, v in enumerate(losses)]
    return RunRecord(engine=engine, status="ok", protocol={"telemetry": True, "repeat": 0}, steps=steps)


def test_the_time_to_target_counts_the_warmup_steps() -> None:
    """Training wall time includes the warm-up: the baseline's 40 steps of 100 ms take 4.0 s, not 3.6; the
    engine's 4 warm-up steps of 200 ms (its first steps are slow) and 36 of 50 ms take 2.6 s, not 1.8."""
    rows, facts = convergence_rows([run_with_warmup("ds-zero-offload", LINE, 100.0, 100.0),
                                    run_with_warmup("ref-zenflow", LINE, 50.0, 200.0)], {})
    by = {r["engine"]: r for r in rows}
    assert by["ds-zero-offload"]["time_to_target_s"] == pytest.approx(4.0)
    assert by["ref-zenflow"]["time_to_target_s"] == pytest.approx(2.6)
    assert by["ref-zenflow"]["time_to_loss_speedup"] == pytest.approx(4.0 / 2.6)
    assert facts["equal_time_s"] == pytest.approx(2.6)


def test_smoothing_is_the_trailing_mean_over_a_fifth_of_the_run() -> None:
    points = curve(run("x", list(range(WINDOW + 2)), 10.0), WINDOW)
    assert len(points) == 3 and points[0] == pytest.approx((WINDOW * 0.01, (WINDOW - 1) / 2))
    assert (window_for(10), window_for(24), window_for(168), window_for(10_000)) == (4, 4, 32, 32)


def test_report_files_and_no_baseline_means_no_report(tmp_path: Path) -> None:
    records = [run("ref-offload", LINE, 100.0), run("ref-zenflow", LINE, 80.0)]  # ref-offload is the fallback
    text = convergence_report(records, {"ref-offload": {"speedup": None}, "ref-zenflow": {"speedup": 1.25, "runs": 1}},
                              tmp_path, "test")
    assert "ref-offload's final smoothed loss" in text and "1.25× (1 run)" in text
    assert {p.name for p in tmp_path.iterdir()} == {"convergence.md", "convergence.csv", "loss-vs-time.png"}
    empty = tmp_path / "none"
    empty.mkdir()
    assert convergence_report([run("ref-zenflow", LINE, 80.0)], {"ref-zenflow": {}}, empty, "test") is None
    assert not list(empty.iterdir())
