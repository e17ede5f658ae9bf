"""Where a ZenFlow speedup comes from: projected speedup over ZeRO-Offload against ρ, what offloading adds to a
ZeRO-Offload step over its device compute ((host stall + exposed transfers) / compute), for several update
intervals; published and measured points placed on the same axis; the projection as a band over host assumptions.
Everything here is PROJECTED except the cpu-scale points (measured). docs/cost-model.md, "Sensitivity".

Why ρ: ZeRO-Offload's step is compute·(1 + ρ). ZenFlow hides the host's (1 - topk) share behind U steps of compute,
so its step is at least max(compute, (1 - topk)·ρ·compute / U), and the speedup is at most
(1 + ρ) / max(1, (1 - topk)·ρ / U): it grows with ρ until the host work no longer fits behind U steps, then falls
towards U / (1 - topk). About U + 1 at its best, whatever the GPU.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from zenflow.costmodel.model import Block, Inputs, Prediction, predict
from zenflow.costmodel.presets import GPUS, MODELS, gpu_inputs, host_rates_per_core
from zenflow.costmodel.validate import BLOCK

INTERVALS = (1, 2, 4, 8)
RHO_RANGE = (0.05, 60.0)
# Band: cores per GPU for the host optimizer besides each GPU preset's DGX share. From 2 cores on, the DGX share's
# memory bandwidth caps host AdamW on this calibration, so the band's low end is the optimizer on 1 core per GPU.
HOST_CORES = (1, 2, 4)


def offload_ratio(p: Prediction) -> float:
    """ρ of a ZeRO-Offload prediction (or a measured summary's equivalents): (stall + exposed I/O) / compute."""
    return (p.stall_ms + p.io_ms) / p.compute_ms


def ideal_speedup(rho: float, interval: int, topk: float = BLOCK.topk_ratio) -> float:
    """The bound in this module's docstring: ZenFlow hides everything that fits behind U steps of compute."""
    return (1 + rho) / max(1.0, (1 - topk) * rho / interval)


def with_host_rate(x: Inputs, adamw_gelem_s: float) -> Inputs:
    """The same step with a host that runs AdamW at this rate (accumulation scaled alike)."""
    k = adamw_gelem_s / x.adamw_gelem_s
    return replace(x, adamw_gelem_s=adamw_gelem_s, adamw_gelem_s_worker=adamw_gelem_s,
                   accum_gelem_s=x.accum_gelem_s * k, accum_gelem_s_worker=x.accum_gelem_s_worker * k)


def forward(x: Inputs) -> dict[str, float]:
    """ZeRO-Offload, ZenFlow (the projection's block) and the same-frequency control on one set of inputs: ρ, step
    times, ZenFlow's speedup over every-step ZeRO-Offload and over ZeRO-Offload accumulating U steps."""
    off, zen = predict(x, "zero-offload"), predict(x, "zenflow-overlap", BLOCK)
    gas, da = predict(x, "zero-offload-gas", BLOCK), predict(x, "zenflow-da-overlap", BLOCK)
    return {"rho": offload_ratio(off), "zero_offload_ms": off.cycle_ms, "zenflow_ms": zen.cycle_ms,
            "zenflow_accumulate_ms": zen.accumulate_ms or zen.cycle_ms, "zenflow_update_ms": zen.update_ms,
            "speedup": off.cycle_ms / zen.cycle_ms, "same_frequency": gas.cycle_ms / zen.cycle_ms,
            "zenflow_da_ms": da.cycle_ms, "speedup_da": off.cycle_ms / da.cycle_ms}


def curve(x: Inputs, interval: int, points: int = 400, engine: str = "zenflow-overlap") -> list[tuple[float, float]]:
    """(ρ, projected speedup of `engine` over ZeRO-Offload) with the host rate swept over six decades; only ρ inside
    RHO_RANGE, ρ ascending."""
    out = []
    for i in range(points):
        rate = x.adamw_gelem_s * 10 ** (3 - 6 * i / (points - 1))
        xi = with_host_rate(x, rate)
        off = predict(xi, "zero-offload")
        rho = offload_ratio(off)
        if RHO_RANGE[0] <= rho <= RHO_RANGE[1]:
            zen = predict(xi, engine, Block(BLOCK.topk_ratio, interval))
            out.append((rho, off.cycle_ms / zen.cycle_ms))
    return sorted(out)


def placed(points: list[tuple[float, float]], low: float, high: float) -> dict[str, Any]:
    """A published speedup range placed on a curve: the ρ ranges where the curve lies inside [low, high] (often two:
    a rising branch and a falling one), none when the range is above the curve's peak."""
    ranges: list[tuple[float, float]] = []
    current: list[float] | None = None
    for rho, s in points:
        if low <= s <= high:
            current = [rho, rho] if current is None else [current[0], rho]
        elif current:
            ranges.append((current[0], current[1]))
            current = None
    if current:
        ranges.append((current[0], current[1]))
    return {"low": low, "high": high, "curve_peak": max(s for _, s in points), "rho_ranges": ranges}


def band(cal: dict[str, Any], deepspeed_per_core: float | None, implied_rate: float | None = None
         ) -> list[dict[str, Any]]:
    """Per (GPU, model): the projected speedup for every host assumption (cores per GPU x host AdamW kernel, and
    the host AdamW rate per GPU the blog's 7 s step implies: inverse.py), with the band's ends, and the
    same-frequency speedup (over ZeRO-Offload accumulating U steps) at each."""
    adamw, accum = host_rates_per_core(cal)
    kernels = {"torch fused AdamW": 1.0}
    if deepspeed_per_core:
        kernels["DeepSpeed CPU Adam"] = deepspeed_per_core
    rows = []
    for gpu, g in GPUS.items():
        for model in MODELS:
            cases = []
            for cores in sorted({*HOST_CORES, g["host_cores"]}):
                for kernel, k in kernels.items():
                    x = gpu_inputs(model, gpu, adamw * k, accum, host_cores=cores)
                    cases.append({"case": f"{cores} core{'s' if cores > 1 else ''}, {kernel}", **forward(x)})
            central = cases[-len(kernels)]  # the DGX share (the most cores), torch's kernel
            if implied_rate:
                x = gpu_inputs(model, gpu, adamw, accum)
                cases.append({"case": f"{implied_rate:.2f} G el/s per GPU (the blog's 7 s)",
                              **forward(with_host_rate(x, implied_rate))})
            lo, hi = min(cases, key=lambda c: c["speedup"]), max(cases, key=lambda c: c["speedup"])
            rows.append({"gpu": gpu, "model": MODELS[model]["label"], "central": central["speedup"],
                         "central_same_frequency": central["same_frequency"], "central_rho": central["rho"],
                         "low": lo["speedup"], "low_case": lo["case"], "high": hi["speedup"], "high_case": hi["case"],
                         "same_frequency_low": min(c["same_frequency"] for c in cases),
                         "same_frequency_high": max(c["same_frequency"] for c in cases),
                         "rho_low": min(c["rho"] for c in cases), "rho_high": max(c["rho"] for c in cases)})
    return rows


def measured_points(validation_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Our cpu-scale runs on the same axis: ρ of ref-offload as measured, speedup of ref-zenflow over it as measured
    and as predicted, one point per sequence length."""
    by_seq: dict[int, dict[str, dict[str, Any]]] = {}
    for r in validation_rows:
        by_seq.setdefault(r["seq"], {})[r["engine"]] = r
    out = []
    for seq, rows in sorted(by_seq.items()):
        off, zen = rows.get("ref-offload"), rows.get("ref-zenflow")
        if off and zen and off["opt_to_compute_measured"] is not None:
            out.append({"seq": seq, "rho": off["opt_to_compute_measured"],
                        "measured": off["measured_cycle_ms"] / zen["measured_cycle_ms"],
                        "predicted": off["predicted_cycle_ms"] / zen["predicted_cycle_ms"]})
    return out
