"""The cost model at the split placement (presets.split_inputs) and along the regime sweep (reports/regime_validation):
a sync engine's step is the 1-thread loop's parts one after the other, the overlap engines keep their inputs, a
calibration made before the split is refused, and the sweep's validation counts its points by the issue's bar."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import synthetic_calibration as calibration

from zenflow.costmodel.model import CostModelError, predict
from zenflow.costmodel.presets import INPUTS, cpu_scale_inputs, split_inputs
from zenflow.costmodel.validate import BLOCK, compare
from zenflow.reports import regime_validation as rv


def test_a_sync_step_at_the_split_is_the_one_thread_parts_in_turn_and_shared_is_the_two_thread_ones():
    cal = calibration()
    # the device's forward+backward and step on one core, then the host's copy down, sum, AdamW, copy up on the other
    assert predict(split_inputs(cal, 8), "zero-offload").cycle_ms == pytest.approx(40 + 4 + 6 + 10 + 30 + 5)
    assert predict(cpu_scale_inputs(cal, 8), "zero-offload").cycle_ms == pytest.approx(20 + (4 + 6 + 10 + 30 + 5) / 2)
    assert predict(split_inputs(cal, 32), "no-offload").cycle_ms == pytest.approx(60 + 16)
    assert predict(cpu_scale_inputs(cal, 32), "no-offload").cycle_ms == pytest.approx(30 + 8)
    # same-frequency control: three accumulation steps, then one with the host's AdamW and the copy up
    acc = 40 + 4 + 6 + 10
    assert predict(split_inputs(cal, 8), "zero-offload-gas", BLOCK).cycle_ms == pytest.approx((4 * acc + 35) / 4)
    assert INPUTS["split"] is split_inputs and INPUTS["shared"] is cpu_scale_inputs


def test_the_overlap_engines_keep_their_one_core_each_inputs_at_the_split():
    cal = calibration()
    assert predict(split_inputs(cal, 16), "zenflow-overlap", BLOCK) == predict(cpu_scale_inputs(cal, 16),
                                                                              "zenflow-overlap", BLOCK)
    # device accumulation ships its fp32 sum (4 B per unselected element) as a plain copy: one core's 6 ms per 2 MB
    # at the split, both cores' 3 ms shared
    split, shared = (predict(f(cal, 16), "zenflow-da-overlap", BLOCK) for f in (split_inputs, cpu_scale_inputs))
    ship_ms = 0.9 * 1_000_000 * 4 / 2_000_000
    assert split.io_ms - shared.io_ms == pytest.approx(ship_ms * (6 - 3) / 4)  # once per interval of 4


def test_a_calibration_from_before_the_split_is_refused_in_one_line():
    cal = calibration()
    del cal["loops"]["no_offload_1t"]
    with pytest.raises(CostModelError, match="no_offload_1t"):
        split_inputs(cal, 8)


def _measured(cycle: float) -> dict:
    return {"cycle_mean_ms": cycle, "accumulate_step_ms": None, "update_step_ms": cycle, "compute_ms": cycle,
            "io_ms": 0.0, "stall_ms": 0.0, "forward_backward_ms": cycle, "runs": 3, "neighbours": 0.0}


def test_the_sweeps_validation_predicts_at_the_split_and_counts_the_bar():
    cal = calibration()
    exact = predict(split_inputs(cal, 8), "zero-offload").cycle_ms
    sets = {8: {"ref-offload": _measured(exact), "no-offload": _measured(76.0 * 1.5)}}
    rows = compare(cal, sets, split_inputs, rv.ENGINES, fitted_at=8)
    by = {r["engine"]: r for r in rows}
    assert by["ref-offload"]["error_pct"] == pytest.approx(0.0)
    assert by["no-offload"]["predicted_cycle_ms"] == pytest.approx(40 + 16)
    assert rv.verdict(rows) == (1, 2, False)  # 1 of 2 within 15%: below the 80% bar
    assert rv.verdict([{"engine": "ref-zenflow", "error_pct": e} for e in (1, -14.9, 3, 15.0, 40)]) == (4, 5, True)
    assert rv.verdict([{"engine": "ds-zero-offload", "error_pct": 0.0}]) == (0, 0, False)  # ours only


def test_the_models_curve_rises_with_rho_as_tokens_shrink():
    curve = rv.model_curve(calibration(), (2, 8, 32, 128))
    rhos = [c["rho"] for c in curve]
    assert rhos == sorted(rhos, reverse=True) and all(c["speedup"] > 0 for c in curve)


def test_a_sweep_without_its_calibration_says_how_to_make_it(tmp_path: Path):
    lines, curve = rv.write(tmp_path, {}, "cpu-scale-test")
    assert curve == [] and "not validated" in lines[0] and "calibrate" in lines[0]
    (tmp_path / "costmodel").mkdir()
    (tmp_path / "costmodel" / "calibration.json").write_text(json.dumps(calibration("cpu-scale-elsewhere")))
    lines, _ = rv.write(tmp_path, {}, "cpu-scale-test")
    assert "not validated" in lines[0] and "cpu-scale-elsewhere" in lines[0]
