"""The claims' rules on cases the committed data does not hold today (zenflow/reports/claim_numbers.py): a speedup
held only with its interval above 1, validation points counted by |error|, a validation beyond its day bound said
so, and C11's headline read at ref-offload's target, not at the common one chosen afterwards."""

from __future__ import annotations

from zenflow.reports import claim_numbers
from zenflow.reports.claim_numbers import _days, _within, held, knobs_numbers


def test_a_time_to_target_speedup_is_held_only_with_its_interval_above_one():
    """`held`: reached in every seed *and* the interval's low above 1; a 1.30x point whose interval reaches 0.95 is
    not held (C6 must not read "holds" on a speedup whose interval includes 1)."""
    row = {"reached": 5, "compared": 5, "speedup": 1.30, "speedup_low": 0.95, "speedup_high": 1.7}
    assert not held(row, "speedup")
    assert held({**row, "speedup_low": 1.05}, "speedup")
    assert not held({**row, "speedup_low": 1.05, "reached": 4}, "speedup")


def test_validation_points_are_counted_within_the_bound_by_their_absolute_error():
    """`_within`: a point 30% under is as far off as one 30% over; DeepSpeed's fitted points are not counted."""
    assert _within([{"fitted_here": "False", "error_pct": -30.0}]) == (0, 1)
    rows = [{"fitted_here": "False", "error_pct": e} for e in (-30.0, 10.0, -10.0, 16.0)]
    assert _within(rows + [{"fitted_here": "True", "error_pct": 0.0}]) == (2, 4)


def test_a_validation_beyond_its_day_bound_says_so():
    """`_days`: how far the runs are from their calibration, and ", beyond the N h bound" when they are."""
    dating = {"runs_taken": ["2026-11-22T10:00:00", "2026-11-23T08:00:00"], "apart_h": 30.0, "bound_h": 12.0,
              "over_bound": True}
    assert _days(dating).endswith("≤ 30 h from the calibration, beyond the 12 h bound")
    assert _days({**dating, "apart_h": 6.0, "over_bound": False}).endswith("≤ 6 h from the calibration")


class KnobsFiles:
    """The two files knobs_numbers reads, in memory."""

    def __init__(self, rows, verdict):
        self.rows, self.verdict = rows, verdict

    def csv(self, name):
        return self.rows

    def json(self, name):
        return self.verdict


def knob_row(target, setting, engine, update_interval, relative, low, high):
    return {"workload": "llama", "target": target, "setting": setting, "engine": engine,
            "update_interval": update_interval, "select_interval": "64", "compared": 3, "reached": 3,
            "relative_time": relative, "relative_time_low": low, "relative_time_high": high, "note": None}


def test_the_knobs_headline_quotes_ref_offloads_target_not_the_common_one(monkeypatch):
    """C11's rule judges at ref-offload's final result; the common target is "not the rule's verdict": when the rule
    decides, the headline quotes the rows at ref-offload's target."""
    monkeypatch.setattr(claim_numbers, "ran", lambda f, name: {})
    rows = []
    for target, auto, fixed in (("ref-offload", (1.2, 1.1, 1.3), (1.5, 1.4, 1.6)),
                                ("common", (2.0, 1.9, 2.1), (3.0, 2.9, 3.1))):
        rows += [knob_row(target, "ref-offload", "ref-offload", "1", 1.0, 1.0, 1.0),
                 knob_row(target, "auto", "ref-zenflow", "auto", *auto),
                 knob_row(target, "fixed", "ref-zenflow", "4", *fixed)]
    said = {"auto": {"verdict": "holds", "why": "within", "best_fixed": "fixed"}}
    verdict = {"workloads": {"llama": said}, "common_target": {"workloads": {"llama": said}}}
    out = knobs_numbers(KnobsFiles(rows, verdict))
    assert out["llama_said"] == "auto 1.20× [1.10–1.30] vs best fixed 1.50× [1.40–1.60]"
    assert out["llama_common_auto"] == "2.00× [1.90–2.10]"  # the common target's numbers: a detail beside it
