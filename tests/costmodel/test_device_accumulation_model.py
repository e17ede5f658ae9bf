"""The cost model of ZenFlow with device accumulation (zenflow-da-*): bytes, its exact reductions to
host-accumulation ZenFlow, and the ceiling it lifts on the sensitivity axis (docs/cost-model.md)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import INF
from helpers import cost_inputs as inputs

from zenflow.costmodel import sensitivity as sens
from zenflow.costmodel.inverse import free_accumulation
from zenflow.costmodel.model import Block, Inputs, predict, transfer_bytes
from zenflow.costmodel.presets import cpu_scale_inputs, gpu_inputs, host_rates_per_core
from zenflow.costmodel.projection import projection

ROOT = Path(__file__).resolve().parents[2]
CALIBRATION = ROOT / "results/costmodel/cpu-scale-amd-epyc-2c/calibration.json"
FIELDS = ("update_ms", "cycle_ms", "compute_ms", "io_ms", "stall_ms")


def _free_transfers_and_accumulation(x: Inputs) -> Inputs:
    """Link and every accumulation free: host accumulation and device accumulation then do the same work."""
    return replace(x, d2h_gbps=INF, h2d_gbps=INF, gather_gbps=INF, scatter_gbps=INF, accum_gelem_s=INF,
                   accum_gelem_s_worker=INF, device_accum_gelem_s=INF, device_accum_gelem_s_overlap=INF)


@pytest.mark.parametrize("r,u", [(0.1, 4), (0.05, 8), (0.3, 2), (0.0, 1)])
def test_bytes_are_the_fp32_sum_down_and_the_params_up_once_per_interval(r: float, u: int) -> None:
    x = inputs()
    n, b = x.column_params, x.dtype_bytes
    for engine in ("zenflow-da-sync", "zenflow-da-overlap"):
        assert predict(x, engine, Block(r, u)).bytes_per_step == pytest.approx((1 - r) * n * (4 + b) / u)
    ratio = transfer_bytes(n, b, r, u, device_accumulation=True) / transfer_bytes(n, b, r, u)
    assert ratio == pytest.approx((4 + b) / (b * (u + 1)))
    assert predict(x, "zenflow-da-overlap", Block(1.0, 4)).bytes_per_step == 0  # nothing offloaded


def test_bf16_interval_4_moves_0675_model_bytes_against_1125() -> None:
    n = 7e9
    assert transfer_bytes(n, 2, 0.1, 4, device_accumulation=True) / (n * 2) == pytest.approx(0.675)
    assert transfer_bytes(n, 2, 0.1, 4) / (n * 2) == pytest.approx(1.125)


@pytest.mark.parametrize("mode", ["sync", "overlap"])
@pytest.mark.parametrize("block", [Block(0.1, 4), Block(0.2, 2), Block(0.05, 1)])
def test_with_link_and_accumulation_free_it_is_host_accumulation_zenflow(mode: str, block: Block) -> None:
    """Exact reduction: with nothing to copy or sum, both designs are device work + one host AdamW per interval."""
    x = _free_transfers_and_accumulation(inputs())
    a, b = predict(x, f"zenflow-da-{mode}", block), predict(x, f"zenflow-{mode}", block)
    for f in FIELDS:
        assert getattr(a, f) == pytest.approx(getattr(b, f), abs=1e-9), f


def test_device_accumulation_time_is_on_the_training_thread() -> None:
    """Negative control of the reduction above: a slow device accumulation costs every step, host-side ZenFlow not."""
    x = _free_transfers_and_accumulation(inputs())
    slow = replace(x, device_accum_gelem_s=0.5, device_accum_gelem_s_overlap=0.5)
    for mode in ("sync", "overlap"):
        fast, slowed = predict(x, f"zenflow-da-{mode}"), predict(slow, f"zenflow-da-{mode}")
        per_step = 0.9 * x.column_params / 0.5 / 1e6
        assert slowed.accumulate_ms - fast.accumulate_ms >= per_step * (1 - 1e-9)
        assert predict(slow, f"zenflow-{mode}").cycle_ms == pytest.approx(predict(x, f"zenflow-{mode}").cycle_ms)


def test_no_per_step_host_work_means_no_stall_when_adamw_fits_one_cycle() -> None:
    x = inputs(accum_gelem_s_worker=1e-3)  # host accumulation hopeless: ZenFlow stalls, device accumulation not
    assert predict(x, "zenflow-overlap").stall_ms > 1000
    assert predict(x, "zenflow-da-overlap").stall_ms == pytest.approx(0, abs=1e-9)


def test_sensitivity_curve_lifts_the_host_accumulation_ceiling() -> None:
    """On the projection's A100 Llama-2-7B inputs the device-accumulation curve peaks above the calibrated and the
    accumulation-free curves (docs/cost-model.md); with a device accumulation 1000x slower its projected speedup
    falls below host accumulation's (the negative control: the lift comes from the device's bandwidth)."""
    cal = json.loads(CALIBRATION.read_text())
    x = gpu_inputs("llama2-7b", "a100", *host_rates_per_core(cal))

    def peak(points: list[tuple[float, float]]) -> float:
        return max(s for _, s in points)

    da = peak(sens.curve(x, 4, engine="zenflow-da-overlap"))
    assert da > peak(sens.curve(free_accumulation(x), 4)) > peak(sens.curve(x, 4))
    crawl = replace(x, device_accum_gelem_s=x.device_accum_gelem_s / 1000,
                    device_accum_gelem_s_overlap=x.device_accum_gelem_s_overlap / 1000)
    at_projection = sens.forward(crawl)
    assert at_projection["speedup_da"] < at_projection["speedup"]
    assert sens.forward(x)["speedup_da"] > 0.95 * sens.forward(x)["speedup"]


def test_projection_and_band_carry_the_device_accumulation_speedup() -> None:
    cal = json.loads(CALIBRATION.read_text())
    for row in projection(cal):
        assert row["speedup_da"] == pytest.approx(row["zero_offload_ms"] / row["zenflow_da_ms"])
        assert row["speedup_da"] > 0
    f = sens.forward(gpu_inputs("llama2-7b", "h100", *host_rates_per_core(cal)))
    assert f["speedup_da"] == pytest.approx(f["zero_offload_ms"] / f["zenflow_da_ms"])


def test_cpu_scale_device_accumulation_runs_on_the_devices_cores() -> None:
    """At cpu-scale the device is the CPU: its gather + add rate is the host's copy and accumulation of that layout,
    so in overlap mode the device step grows by about what the worker no longer does."""
    x = cpu_scale_inputs(json.loads(CALIBRATION.read_text()), 16)
    per_element_ns = x.dtype_bytes / x.gather_gbps + 1 / x.accum_gelem_s_worker
    assert x.device_accum_gelem_s_overlap == pytest.approx(1 / per_element_ns)
    da, zen = predict(x, "zenflow-da-overlap"), predict(x, "zenflow-overlap")
    assert da.accumulate_ms > zen.accumulate_ms
