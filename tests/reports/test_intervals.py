"""95% intervals of step times and paired ratios (reports/intervals.py), and the scenario table's
use of them: a ratio whose interval includes 1 is "no difference", a clear one is a speedup with its interval."""

from __future__ import annotations

import math

import pytest

from zenflow.harness.records import RunRecord
from zenflow.reports.intervals import NO_DIFFERENCE, Interval, log_interval, mean_interval, ratio_cell, ratio_interval
from zenflow.reports.scenario import engine_rows, table


def test_mean_interval_is_students_t() -> None:
    """Textbook values: mean 3, s = sqrt(2.5), t(0.975, 4) = 2.776445 -> half-width 1.963243; n = 2: t = 12.7062."""
    iv = mean_interval([1, 2, 3, 4, 5])
    assert iv.center == 3 and iv.n == 5
    assert iv.high - iv.center == pytest.approx(2.776445 * math.sqrt(2.5) / math.sqrt(5), rel=1e-6)
    two = mean_interval([10, 12])
    assert (two.low, two.high) == pytest.approx((11 - 12.7062047, 11 + 12.7062047), rel=1e-6)
    one = mean_interval([7.0])
    assert (one.center, one.low, one.high) == (7.0, None, None)


def test_step_time_interval_is_geometric_and_positive() -> None:
    """Two runs far apart: the plain t interval reaches below zero (the negative control), the log one does not."""
    assert mean_interval([100.0, 300.0]).low < 0
    iv = log_interval([100.0, 300.0])
    assert iv.center == pytest.approx(math.sqrt(100 * 300)) and 0 < iv.low < 100 < 300 < iv.high
    assert iv.low * iv.high == pytest.approx(iv.center ** 2)
    with pytest.raises(ValueError, match="positive"):
        log_interval([1.0, 0.0])


def test_ratio_interval_pairs_by_repeat_and_is_symmetric() -> None:
    slow, fast = {0: 200.0, 1: 210.0, 2: 190.0, 9: 500.0}, {0: 100.0, 1: 100.0, 2: 100.0, 3: 1.0}
    iv = ratio_interval(slow, fast)  # repeats 0-2 only: 9 and 3 have no partner
    assert iv.n == 3 and iv.center == pytest.approx(math.exp((math.log(2) + math.log(2.1) + math.log(1.9)) / 3))
    back = ratio_interval(fast, slow)
    assert back.center == pytest.approx(1 / iv.center)
    assert (back.low, back.high) == pytest.approx((1 / iv.high, 1 / iv.low))
    assert ratio_interval({0: 1.0}, {1: 1.0}) is None  # nothing shared


def test_an_interval_including_one_is_no_difference_and_a_clear_one_is_not() -> None:
    """The negative control is the second case: the same spread around 2 is a speedup, not 'no difference'."""
    noisy = ratio_interval({0: 90.0, 1: 110.0, 2: 100.0}, {0: 100.0, 1: 100.0, 2: 100.0})
    assert noisy.includes_one and ratio_cell(noisy).startswith(NO_DIFFERENCE)
    clear = ratio_interval({0: 190.0, 1: 210.0, 2: 200.0}, {0: 100.0, 1: 100.0, 2: 100.0})
    assert not clear.includes_one and ratio_cell(clear).startswith("2.00× [")
    assert ratio_cell(ratio_interval({0: 2.0}, {0: 1.0})) == "2.00× (1 run)"


def test_an_interval_wholly_below_or_above_one_is_a_difference_and_only_one_across_one_is_not() -> None:
    """A clear slowdown is as much a difference as a clear speedup: docs/glue.md's "ours 0.64× [0.61–0.68]" must not
    read "no difference". An interval that touches 1 at an end does include it."""
    slower, faster = Interval(0.64, 0.56, 0.74, 5), Interval(1.56, 1.35, 1.79, 5)
    assert not slower.includes_one and ratio_cell(slower) == "0.64× [0.56–0.74]"
    assert not faster.includes_one and ratio_cell(faster) == "1.56× [1.35–1.79]"
    across, touching = Interval(0.98, 0.91, 1.05, 5), Interval(0.95, 0.90, 1.0, 5)
    assert across.includes_one and ratio_cell(across) == f"{NO_DIFFERENCE} (0.98× [0.91–1.05])"
    assert touching.includes_one
    slowdown = ratio_interval({0: 64.0, 1: 60.0, 2: 68.0}, {0: 100.0, 1: 100.0, 2: 100.0})  # the same, from runs
    assert slowdown.high < 1 and not ratio_cell(slowdown).startswith(NO_DIFFERENCE)


def _run(engine: str, repeat: int, cycle_ms: float) -> RunRecord:
    summary = {"cycle_mean_ms": cycle_ms, "step_ms": {"median": cycle_ms}}
    return RunRecord(engine=engine, status="ok", protocol={"repeat": repeat}, summary=summary,
                     workload={"seed": 1234 + repeat})


def test_the_scenario_table_says_no_difference_where_the_runs_do_not_separate() -> None:
    base = [_run("ds-zero-offload", r, ms) for r, ms in enumerate((400, 420, 410, 405, 415))]
    same = [_run("ds-zenflow", r, ms) for r, ms in enumerate((395, 430, 400, 420, 405))]  # within the noise
    fast = [_run("ref-zenflow", r, ms) for r, ms in enumerate((200, 212, 204, 199, 210))]  # clearly 2x
    rows = {r["engine"]: r for r in engine_rows(base + same + fast)}
    assert rows["ds-zenflow"]["speedup_low"] < 1 < rows["ds-zenflow"]["speedup_high"]
    assert rows["ref-zenflow"]["speedup_low"] > 1.9
    text = table(list(rows.values()))
    line = {row.split("|")[1].strip(): row for row in text.splitlines()[2:]}
    assert NO_DIFFERENCE in line["ds-zenflow"] and NO_DIFFERENCE not in line["ref-zenflow"]
    assert "1.00× (baseline)" in line["ds-zero-offload"]
    lo, hi = rows["ref-zenflow"]["cycle_mean_low"], rows["ref-zenflow"]["cycle_mean_high"]
    assert lo < 205 < hi and f"[{lo:.1f}–{hi:.1f}]" in line["ref-zenflow"]
