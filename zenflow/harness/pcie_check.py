"""The `pcie` check of `make gpu-check`: do the optimizer's own byte counters explain what NVML saw on the link?

NVML's PCIe counters (fields 197 TX / 198 RX) count every byte on the wire: each packet's header and framing, the
read requests a host-to-device copy sends the other way, doorbells. Payload counters like ours therefore never equal
them; the first H100 run (PCIe 5 x16, 2026-11-24) read 1.188x our bytes going out and 1.079x coming in. So the
check first measures the link itself: plain pinned copies of known size, one direction at a time, give NVML's bytes
per payload byte in each counter (a 2x2 "overhead" matrix: a device-to-host copy adds write headers to TX; a
host-to-device copy adds completion headers to RX and read requests to TX). The optimizer's counts, through that
matrix, predict both NVML counters; the prediction must hold within `TOLERANCE`. A transfer the optimizer moved but
did not count, or counted twice, misses by its whole size (ref-offload moves two equal halves, so ~50%).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from zenflow import ZenFlowAdamW
from zenflow.harness.gpu_check import CASES, DIFF_HYPER, SmallNet, check, make_batches

DIRECTIONS = ("d2h", "h2d")
COUNTERS = {"d2h": "tx_bytes", "h2d": "rx_bytes"}  # the GPU's end of the link: TX = device to host
TOLERANCE = 0.05
CALIBRATION_BYTES = 256 * 2**20
CALIBRATION_COPIES = 4
# Between two calibration copies: longer than the sampler's longest gap between counter reads (~0.1 s with its rate
# queries), so a 32-bit counter (4 GiB) never sees more than one 256 MiB copy between reads and cannot wrap unseen.
CALIBRATION_PAUSE_S = 0.15


def link_overhead(bus: list[str | None], nbytes: int = CALIBRATION_BYTES,
                  copies: int = CALIBRATION_COPIES) -> dict[str, Any]:
    """NVML bytes per payload byte, per copy direction and counter, from plain pinned copies on this GPU:
    {"d2h": {"tx_bytes": ~1.1, "rx_bytes": ~0.0x}, "h2d": {...}, "payload_bytes": n, "devices": [...]}"""
    from zenflow.telemetry.nvml import NvmlSampler

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    device.random_(0, 256)  # what crosses is never all zeros (DEVELOPERS: never measure on zeros)
    moves = {"d2h": lambda: host.copy_(device, non_blocking=True), "h2d": lambda: device.copy_(host, non_blocking=True)}
    out: dict[str, Any] = {"payload_bytes": nbytes * copies}
    for direction, move in moves.items():
        torch.cuda.synchronize()
        with NvmlSampler(bus_ids=bus, interval_s=0.05) as sampler:
            for _ in range(copies):
                move()
                torch.cuda.synchronize()  # sync point: one copy at a time, then a pause (see CALIBRATION_PAUSE_S)
                time.sleep(CALIBRATION_PAUSE_S)
        res = sampler.result()
        if not res["available"] or not res["devices"]:
            raise RuntimeError(f"NVML: {res.get('reason') or res.get('mapping_errors')}")
        dev = res["devices"][0]
        out[direction] = {k: None if dev.get(k) is None else dev[k] / out["payload_bytes"] for k in COUNTERS.values()}
        out.setdefault("devices", []).append({k: dev.get(k) for k in ("counter_bits", "counter_max_gap_s",
                                                                       "wrap_ambiguous")})
    return out


def predicted(ours: dict[str, int], overhead: dict[str, Any], counter: str) -> float | None:
    """NVML bytes the optimizer's transfers should show on `counter`: each direction's bytes times the link's
    measured bytes-per-payload-byte of a copy in that direction."""
    factors = [overhead[d][counter] for d in DIRECTIONS]
    return None if None in factors else sum(ours[d] * f for d, f in zip(DIRECTIONS, factors))


def agreement(nvml: int | None, expected: float | None, ours: int, background: float | None,
              tolerance: float = TOLERANCE) -> tuple[str, str | None]:
    """(status, reason) for one counter: pass when NVML is within `tolerance` of what our bytes predict."""
    if nvml is None or expected is None:
        return "not checked", "NVML does not report this counter"
    if ours <= 0:
        return "not checked", "the optimizer moved no bytes in this direction"
    ratio = nvml / expected
    if abs(ratio - 1) <= tolerance:
        return "pass", None
    idle = "unknown" if background is None else f"≈{background:.0f} B"
    return "fail", (f"NVML counted {ratio:.3f}x what our bytes predict through the link's measured overhead "
                    f"({nvml / ours:.3f}x our payload bytes; other traffic on this GPU's link when idle: {idle} over "
                    "the same time): a transfer not counted, counted twice, or traffic that is not ours")


def verdict(ours: dict[str, int], overhead: dict[str, Any], dev: dict[str, Any], idle_dev: dict[str, Any],
            window: float, idle_s: float) -> dict[str, Any]:
    """Per direction: the optimizer's payload bytes, NVML's counter, and the counter predicted from our bytes and
    the link's overhead; the idle window's bytes, scaled to the run's window, say how much traffic is not ours."""
    rows = {}
    for d in DIRECTIONS:
        key = COUNTERS[d]
        idle = idle_dev.get(key)
        background = None if idle is None or idle_s <= 0 else idle * window / idle_s
        expected = predicted(ours, overhead, key)
        status, reason = agreement(dev.get(key), expected, ours[d], background)
        rows[d] = {"ours": ours[d], "nvml": dev.get(key), "predicted": expected,
                   "overhead": overhead.get(d, {}).get(key), "idle_nvml": idle, "idle_s": idle_s,
                   "status": status, "reason": reason}
    statuses = {r["status"] for r in rows.values()}
    status = "fail" if "fail" in statuses else "pass" if statuses == {"pass"} else "not checked"
    reasons = [f"{d}: {r['reason']}" for d, r in rows.items() if r["reason"]]
    if dev.get("counters") != "nvml_fi":
        reasons.insert(0, f"counters unsupported: {dev.get('counter_errors')}")
    keep = ("name", "pci_bus_id", "counter_bits", "counter_max_gap_s", "wrap_ambiguous")
    return check("pcie", status, "; ".join(reasons) or None, directions=rows, window_s=window, overhead=overhead,
                 tolerance=TOLERANCE, **{("gpu" if k == "name" else k): dev.get(k) for k in keep})


def pcie_check(cuda: bool, widths: tuple[int, ...] = (4096,) * 5, steps: int = 12) -> dict[str, Any]:
    """The link's overhead from plain copies, then ref-offload (every column crosses both ways each step) inside
    an NVML window on this process's GPU, then an idle window of the same length."""
    if not cuda:
        return check("pcie", "not checked", "no CUDA: no PCIe link to count")
    from zenflow.telemetry.nvml import NvmlSampler, torch_pci_bus_ids

    bus = [(torch_pci_bus_ids() or [None])[torch.cuda.current_device()]]  # the run's own GPU (audit item 13)
    overhead = link_overhead(bus)
    model = SmallNet(widths, seed=0).cuda()
    data = [(x.cuda(), y.cuda()) for x, y in make_batches(widths, steps, 0, rows=8)]  # uploaded before the window
    opt = ZenFlowAdamW(model.parameters(), zenflow=dict(CASES["ref-offload"][0]), **DIFF_HYPER)
    torch.cuda.synchronize()
    before = opt.transfer_bytes
    t0 = time.perf_counter()
    try:
        with NvmlSampler(bus_ids=bus, interval_s=0.05) as sampler:
            for x, y in data:
                (model(x) - y).pow(2).mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            opt.drain()
            torch.cuda.synchronize()  # sync point: the window closes after the last copy
    finally:
        opt.close()
    window = time.perf_counter() - t0
    idle_s = min(window, 5.0)
    with NvmlSampler(bus_ids=bus, interval_s=0.05) as idle:
        time.sleep(idle_s)
    res, quiet = sampler.result(), idle.result()
    if not res["available"] or not res["devices"]:
        return check("pcie", "not checked", f"NVML: {res.get('reason') or res.get('mapping_errors')}")
    after = opt.transfer_bytes
    ours = {d: sum(n - before.get(k, 0) for k, n in after.items() if k[0] == d) for d in DIRECTIONS}
    return verdict(ours, overhead, res["devices"][0], (quiet.get("devices") or [{}])[0], window, idle_s)
