"""The falsifiable projection: the ρ axis and its bound, the same-frequency control, the inverse check's
solves landing on the published step times, placements on a curve, and the host-kernel measurement record."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from zenflow.costmodel import host_adam, inverse
from zenflow.costmodel import sensitivity as sens
from zenflow.costmodel.model import Block, predict, transfer_bytes
from zenflow.costmodel.presets import gpu_inputs, load_calibration

CAL = Path(__file__).resolve().parents[2] / "results" / "costmodel" / "cpu-scale-amd-epyc-2c" / "calibration.json"


@pytest.fixture(scope="module")
def cal() -> dict:
    return load_calibration(CAL, None)


@pytest.fixture(scope="module")
def a100(cal) -> object:
    from zenflow.costmodel.presets import host_rates_per_core

    return gpu_inputs("llama2-7b", "a100", *host_rates_per_core(cal))


def test_ideal_bound_peaks_at_one_plus_u_over_host_share():
    for u in sens.INTERVALS:
        peak_rho = u / 0.9  # host work (1 - topk)·ρ·compute just fits behind U steps
        assert sens.ideal_speedup(peak_rho, u) == pytest.approx(1 + u / 0.9)
        assert sens.ideal_speedup(peak_rho * 1.1, u) < sens.ideal_speedup(peak_rho, u)
        assert sens.ideal_speedup(peak_rho * 0.9, u) < sens.ideal_speedup(peak_rho, u)


def test_model_curve_never_beats_the_ideal_bound_and_longer_intervals_never_lose(a100):
    curves = {u: dict(sens.curve(a100, u)) for u in sens.INTERVALS}
    for u, points in curves.items():
        assert len(points) > 100
        assert all(s <= sens.ideal_speedup(rho, u) * 1.001 for rho, s in points.items()), u
    for rho, s in curves[8].items():  # same host rates, so the same ρ grid
        assert s >= curves[4][rho] - 1e-9 >= curves[1][rho] - 2e-9


def test_offload_ratio_of_the_model_is_what_zero_offload_adds_over_compute(a100):
    p = predict(a100, "zero-offload")
    assert sens.offload_ratio(p) * p.compute_ms == pytest.approx(p.cycle_ms - p.compute_ms)


def test_same_frequency_control_is_zero_offload_at_u1_and_copies_every_step(a100):
    one, off = predict(a100, "zero-offload-gas", Block(0.1, 1)), predict(a100, "zero-offload")
    assert one.cycle_ms == pytest.approx(off.cycle_ms)
    four = predict(a100, "zero-offload-gas", Block(0.1, 4))
    assert four.bytes_per_step == pytest.approx(transfer_bytes(a100.column_params, 2.0, 0.0, 4))
    assert off.cycle_ms > four.cycle_ms > predict(a100, "zenflow-overlap", Block(0.1, 4)).cycle_ms


def test_inverse_solves_land_on_the_published_step_times(cal):
    from zenflow.costmodel.presets import host_rates_per_core

    x, tokens = inverse.published_inputs(*host_rates_per_core(cal), 0.4)
    assert predict(x, "no-offload").cycle_ms == pytest.approx(inverse.BLOG["no_offload_ms"], rel=1e-4)
    assert x.tokens == pytest.approx(tokens)
    rate = inverse.host_rate_for(x, inverse.BLOG["zero_offload_ms"])
    assert predict(sens.with_host_rate(x, rate), "zero-offload").cycle_ms == pytest.approx(7000.0, rel=1e-4)
    assert inverse.solve(lambda v: v, 5.0, 1.0, 4.0) is None  # outside: no made-up number
    inv = inverse.inverse_check(cal, 0.9)
    assert inv["rho_blog"] == pytest.approx(13.0)
    for case in inv["forward"].values():
        assert case["speedup"] == pytest.approx(case["zero_offload_ms"] / case["zenflow_ms"])
    free, calibrated = inv["forward"]["accumulation free"], inv["forward"]["as calibrated"]
    assert free["speedup"] > calibrated["speedup"]  # the per-step host accumulation is what holds ZenFlow back
    assert inv["deepspeed_adam_per_core"] == pytest.approx(0.9 * inv["torch_adamw_per_core"])


def test_placed_finds_both_branches_and_nothing_above_the_peak():
    tent = [(r, 1 + min(r, 8 / r)) for r in (0.5, 1, 2, 2.5, 2.8, 3, 4, 8, 16, 32)]  # peak 3.8 at ρ 2.8
    got = sens.placed(tent, 2.9, 3.5)
    assert got["rho_ranges"] == [(2.0, 2.5), (4.0, 4.0)]  # 1 + 8/3 at ρ 3 is above the range
    assert sens.placed(tent, 4.0, 5.0)["rho_ranges"] == []


def test_band_spans_its_cases_and_names_its_ends(cal):
    rows = sens.band(cal, 0.8, implied_rate=0.36)
    assert len(rows) == 8
    for r in rows:
        assert r["low"] <= r["central"] <= r["high"] and r["rho_low"] <= r["central_rho"] <= r["rho_high"]
        assert r["same_frequency_low"] <= r["central_same_frequency"] <= r["same_frequency_high"]
        assert r["central_same_frequency"] < r["central"]  # the fair control keeps part of the claim only
    assert any("blog" in r["low_case"] + r["high_case"] for r in rows)


@pytest.mark.deepspeed
def test_host_adam_record_measures_both_kernels(tmp_path):
    out = tmp_path / "host-adam.json"
    assert host_adam.main(["--numel", "20000", "--rounds", "1", "--steps", "2", "--out", str(out)]) == 0
    record = host_adam.load_host_adam(out)
    assert record["numel"] == 20000 and [p.name for p in tmp_path.iterdir()] == [out.name]  # no temporary left
    torch_rate = record["kernels"]["torch-fused-adamw"]["1"]["gelem_s"]
    assert torch_rate > 0
    ds = record["kernels"]["deepspeed-cpu-adam"]
    if "unavailable" in ds:
        pytest.fail(f"DeepSpeed's CPU Adam should load where deepspeed is installed: {ds['unavailable']}")
    assert host_adam.per_core_ratio(record) == pytest.approx(ds["1"]["gelem_s"] / torch_rate)
    assert host_adam.load_host_adam(tmp_path / "missing.json") is None
    out.write_text(json.dumps({"schema": "other"}))
    with pytest.raises(ValueError, match="schema"):
        host_adam.load_host_adam(out)
    with pytest.raises(SystemExit):
        host_adam.main(["--numel", "0"])


def test_free_accumulation_keeps_everything_else(a100):
    free = inverse.free_accumulation(a100)
    assert replace(free, accum_gelem_s=a100.accum_gelem_s, accum_gelem_s_worker=a100.accum_gelem_s_worker) == a100
