"""The GPU projection: ZeRO-Offload vs ZenFlow step times for each GPU preset and model, beside the paper's
Figure 1. Everything here is PROJECTED (docs/cost-model.md); nothing is fitted to the paper."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zenflow.costmodel import host_adam, inverse
from zenflow.costmodel import sensitivity as sens
from zenflow.costmodel.model import predict
from zenflow.costmodel.presets import GPUS, MODELS, gpu_inputs, host_rates_per_core
from zenflow.costmodel.validate import BLOCK

# Paper Figure 1 (arXiv 2505.12242, Llama-2-7B): speedup over ZeRO-Offload and stall reduction, the ranges as
# quoted (docs/history.md, "The paper's numbers").
PAPER = {"a100": ("4.6–5.1×", "−88…−90%"), "h100": ("3.2–4.1×", "−82…−87%")}


def projection(cal: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (GPU, model): projected step times, speedup and stall reduction, and the paper's values."""
    adamw, accum = host_rates_per_core(cal)
    rows = []
    for gpu in GPUS:
        for model in MODELS:
            x = gpu_inputs(model, gpu, adamw, accum)
            off, zen = predict(x, "zero-offload"), predict(x, "zenflow-overlap", BLOCK)
            da = predict(x, "zenflow-da-overlap", BLOCK)  # device accumulation: never run on a GPU
            x1 = gpu_inputs(model, gpu, adamw, accum, micro_batch=1)  # sensitivity: 8x fewer tokens per step
            speedup_mb1 = predict(x1, "zero-offload").cycle_ms / predict(x1, "zenflow-overlap", BLOCK).cycle_ms
            rows.append({"gpu": gpu, "model": MODELS[model]["label"], "params_b": x.column_params / 1e9,
                         "fb_ms": x.fb_ms, "zero_offload_ms": off.cycle_ms, "zenflow_ms": zen.cycle_ms,
                         "speedup": off.cycle_ms / zen.cycle_ms, "stall_reduction": 1 - zen.stall_ms / off.stall_ms,
                         "speedup_micro_batch_1": speedup_mb1, "zenflow_da_ms": da.cycle_ms,
                         "speedup_da": off.cycle_ms / da.cycle_ms,
                         "paper_speedup": PAPER[gpu][0], "paper_stall": PAPER[gpu][1]})
    return rows


def falsifiable(cal: dict[str, Any], val: list[dict[str, Any]], host_adam_record: Path) -> dict[str, Any]:
    """What inverse.md/.json, projection-band.md/.csv and sensitivity.png show, from the calibration, a host-adam.json
    (read when it exists) and the validation rows: "inverse" (inverse.json), "band" (its rows), "deepspeed_per_core",
    "curves" (U -> (ρ, speedup)), "free" (U 4 with host accumulation free), "device_accumulation" (U 4 with the
    sums on the device: zenflow-da-overlap) and "measured" (our runs' points).
    Data only: zenflow/reports/costmodel.py writes it (reproduce/project.py calls both)."""
    record = host_adam.load_host_adam(host_adam_record)
    deepspeed_per_core = host_adam.per_core_ratio(record)
    inv = inverse.inverse_check(cal, deepspeed_per_core)
    x = gpu_inputs("llama2-7b", "a100", *host_rates_per_core(cal))
    curves = {u: sens.curve(x, u) for u in sens.INTERVALS}
    inv["placements"] = {"paper A100": sens.placed(curves[4], *inverse.PAPER_FIG1["a100"]),
                         "paper H100": sens.placed(curves[4], *inverse.PAPER_FIG1["h100"]),
                         "Intel Qwen2.5-3B": sens.placed(curves[4], *inverse.INTEL["speedup"])}
    return {"inverse": inv, "band": sens.band(cal, deepspeed_per_core, inv["host_adamw_gelem_s_per_gpu"]),
            "deepspeed_per_core": deepspeed_per_core, "curves": curves,
            "free": sens.curve(inverse.free_accumulation(x), 4),
            "device_accumulation": sens.curve(x, 4, engine="zenflow-da-overlap"), "measured": sens.measured_points(val)}
