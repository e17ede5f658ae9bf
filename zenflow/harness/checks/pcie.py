"""The `pcie` check of `make gpu-check`: do the optimizer's own byte counters explain what NVML saw on the link?

NVML's PCIe counters (fields 197 TX / 198 RX) count every byte on the wire: each packet's header and framing, the
read requests a host-to-device copy sends the other way, doorbells. Payload counters like ours therefore never equal
them; the first H100 run (PCIe 5 x16, 2026-11-24) read 1.188x our bytes going out and 1.079x coming in. So the
check first measures the link itself: plain pinned copies of known size, one direction at a time, give NVML's bytes
per payload byte in each counter (a 2x2 "overhead" matrix). The optimizer's counts, through that matrix, predict
both NVML counters; the prediction must hold within `TOLERANCE`.

Two windows: ref-offload (every column both ways each step: symmetric) and ref-zenflow (overlap,
topk 0.1, U 4, one reselection inside the window: partial gathers, boundary uploads, moved master and moments,
indices; about 4x more down than up). A window is "not checked" when a 32-bit counter could have wrapped unseen
between two reads (`wrap_ambiguous`); the sampler reads only the counters during the check to keep those gaps short.

Negative controls (computed from the same counters, no extra GPU time): our bytes with one (direction, kind) left
uncounted, and with the directions swapped, must fail. A variant that moves the prediction by no more than
`RESOLUTION` (twice the tolerance) could pass on measurement error alone; it is reported as "below resolution" and
not run. So the controls say which counting errors a window can see; a window fails unless at least one uncounted
kind can be seen, and, on the asymmetric window, the swap too (ref-offload is symmetric: a swap is invisible there).
"""

from __future__ import annotations

import time
import traceback
from typing import Any

import torch

from zenflow import ZenFlowAdamW
from zenflow.harness.checks.differential import CASES, DIFF_HYPER, SmallNet, make_batches
from zenflow.harness.checks.verdict import NOT_RUN, blind_spots, check, control
from zenflow.hooks import LINK_DIRECTIONS
from zenflow.telemetry.nvml import NvmlSampler, torch_pci_bus_ids

COUNTERS = {"d2h": "tx_bytes", "h2d": "rx_bytes"}  # the GPU's end of the link: TX = device to host
TOLERANCE = 0.01  # first H100 run: 0.02-0.09% on plain copies
RESOLUTION = 2 * TOLERANCE
CALIBRATION_BYTES = 256 * 2**20
CALIBRATION_COPIES = 4
CALIBRATION_PAUSE_S = 0.05  # between calibration copies: one 256 MiB copy between counter reads, at most
COUNTER_INTERVAL_S = 0.01  # counter-only reads: a 32-bit counter needs ~68 ms at PCIe 5 x16 to wrap
ZENFLOW_WINDOW = {"topk_ratio": 0.1, "update_interval": 4, "full_warm_up_rounds": 1, "overlap_step": True,
                  "select_strategy": "step"}  # select_interval: set per window length (zenflow_window)


def zenflow_window(steps: int) -> dict[str, Any]:
    """ref-zenflow's window: warm-up at step 0 and the first selection at step 1 run before the window opens; the
    reselection at step 2 + steps // 2 falls inside it (the window is steps 2 .. steps + 1)."""
    select = max(ZENFLOW_WINDOW["update_interval"], steps // 2 + 1)
    return {"block": {**ZENFLOW_WINDOW, "select_interval": select}, "pre_steps": 2, "asymmetric": True}


WINDOWS = {"ref-offload": lambda steps: {"block": dict(CASES["ref-offload"][0]), "pre_steps": 0,
                                         "asymmetric": False},
           "ref-zenflow": zenflow_window}


# ---- measurement (CUDA) -------------------------------------------------------------------------------------------
def _sampler(bus: list[str | None]) -> Any:
    return NvmlSampler(bus_ids=bus, interval_s=COUNTER_INTERVAL_S, rates=False)  # counters only: short gaps


class NvmlUnavailable(RuntimeError):
    """NVML cannot read this GPU: the check is "not checked", not failed."""


def _device(res: dict[str, Any]) -> dict[str, Any]:
    if not res["available"] or not res["devices"]:
        raise NvmlUnavailable(f"NVML: {res.get('reason') or res.get('mapping_errors')}")
    return res["devices"][0]


def link_overhead(bus: list[str | None], nbytes: int = CALIBRATION_BYTES,
                  copies: int = CALIBRATION_COPIES) -> dict[str, Any]:
    """NVML bytes per payload byte, per copy direction and counter, from plain pinned copies on this GPU:
    {"d2h": {"tx_bytes": ~1.1, "rx_bytes": ~0.0x}, "h2d": {...}, "payload_bytes": n, "devices": [...]}"""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    device.random_(0, 256)  # what crosses is never all zeros (DEVELOPERS: never measure on zeros)
    moves = {"d2h": lambda: host.copy_(device, non_blocking=True), "h2d": lambda: device.copy_(host, non_blocking=True)}
    out: dict[str, Any] = {"payload_bytes": nbytes * copies, "devices": []}
    for direction, move in moves.items():
        torch.cuda.synchronize()
        with _sampler(bus) as sampler:
            for _ in range(copies):
                move()
                torch.cuda.synchronize()  # sync point: one copy at a time, then a pause
                time.sleep(CALIBRATION_PAUSE_S)
        dev = _device(sampler.result())
        out[direction] = {k: None if dev.get(k) is None else dev[k] / out["payload_bytes"] for k in COUNTERS.values()}
        out["devices"].append({k: dev.get(k) for k in ("counter_bits", "counter_max_gap_s", "wrap_ambiguous")})
    return out


def _step(model: torch.nn.Module, opt: ZenFlowAdamW, x: torch.Tensor, y: torch.Tensor) -> None:
    (model(x) - y).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def measure_window(spec: dict[str, Any], bus: list[str | None], widths: tuple[int, ...],
                   steps: int) -> dict[str, Any]:
    """Run `spec`'s pre-window steps, then `steps` steps and a drain inside an NVML window, then an idle window of
    the same length (at most 5 s). Our bytes are the optimizer's counts made inside the window, by (direction, kind)."""
    model = SmallNet(widths, seed=0).cuda()
    data = [(x.cuda(), y.cuda()) for x, y in make_batches(widths, spec["pre_steps"] + steps, 0, rows=8)]
    opt = ZenFlowAdamW(model.parameters(), zenflow=dict(spec["block"]), **DIFF_HYPER)
    try:
        for x, y in data[:spec["pre_steps"]]:
            _step(model, opt, x, y)
        opt.drain()  # the pre-window steps' host updates are uploaded before the window, not inside it
        torch.cuda.synchronize()  # sync point: every copy counted so far has crossed before the window opens
        before, t0 = opt.transfer_bytes, time.perf_counter()
        with _sampler(bus) as sampler:
            for x, y in data[spec["pre_steps"]:]:
                _step(model, opt, x, y)
            opt.drain()
            torch.cuda.synchronize()  # sync point: the window closes after the last copy
        window = time.perf_counter() - t0
        after = opt.transfer_bytes
    finally:
        opt.close()
    idle_s = min(window, 5.0)
    with _sampler(bus) as idle:
        time.sleep(idle_s)
    ours = {f"{d}/{k}": n - before.get((d, k), 0) for (d, k), n in sorted(after.items()) if n > before.get((d, k), 0)}
    idle_dev = (idle.result().get("devices") or [{}])[0]
    return {"ours_by_kind": ours, "dev": _device(sampler.result()), "idle_dev": idle_dev, "window_s": window,
            "idle_s": idle_s}


def pcie_check(cuda: bool, widths: tuple[int, ...] = (4096,) * 5, steps: int = 12) -> dict[str, Any]:
    """The link's overhead from plain copies, then each window on this process's GPU, each with its controls."""
    if not cuda:
        return check("pcie", "not checked", "no CUDA: no PCIe link to count",
                     controls=[control("uncounted kind / swapped directions", None, "needs CUDA and NVML")])
    bus = [(torch_pci_bus_ids() or [None])[torch.cuda.current_device()]]  # the run's own GPU
    specs = {name: make(steps) for name, make in WINDOWS.items()}
    try:
        overhead = link_overhead(bus)
    except NvmlUnavailable as exc:
        return check("pcie", "not checked", str(exc))
    windows = {}
    for name, spec in specs.items():  # one window that raises costs its own verdict only
        try:
            m = measure_window(spec, bus, widths, steps)
        except NvmlUnavailable as exc:
            return check("pcie", "not checked", str(exc))
        except Exception as exc:
            windows[name] = {"status": "fail", "reason": f"raised {type(exc).__name__}: {exc}", "controls": [],
                             "traceback": traceback.format_exc(), "zenflow": spec["block"]}
            continue
        windows[name] = window_verdict(m["ours_by_kind"], overhead, m["dev"], m["idle_dev"], m["window_s"],
                                       m["idle_s"], spec["asymmetric"]) | {"zenflow": spec["block"]}
    return pcie_verdict(windows, overhead)


# ---- verdict (pure: tested on the CPU with synthetic counters) ------------------------------------------------------
def per_direction(ours_by_kind: dict[str, int]) -> dict[str, int]:
    """{"d2h": bytes, "h2d": bytes} from {"d2h/grads": bytes, ...}."""
    return {d: sum(n for key, n in ours_by_kind.items() if key.split("/")[0] == d) for d in LINK_DIRECTIONS}


def predicted(ours: dict[str, int], overhead: dict[str, Any], counter: str) -> float | None:
    """NVML bytes the optimizer's transfers should show on `counter`: each direction's bytes times the link's
    measured bytes-per-payload-byte of a copy in that direction."""
    factors = [overhead[d][counter] for d in LINK_DIRECTIONS]
    return None if None in factors else sum(ours[d] * f for d, f in zip(LINK_DIRECTIONS, factors))


def within(nvml: int | None, expected: float | None, tolerance: float = TOLERANCE) -> bool | None:
    """Whether an NVML counter is within `tolerance` of a prediction; None when either is unknown."""
    if nvml is None or expected is None:
        return None
    return expected > 0 and abs(nvml / expected - 1) <= tolerance


def agreement(nvml: int | None, expected: float | None, ours: int, background: float | None,
              tolerance: float = TOLERANCE) -> tuple[str, str | None]:
    """(status, reason) for one counter: pass when NVML is within `tolerance` of what our bytes predict."""
    if nvml is None or expected is None:
        return "not checked", "NVML does not report this counter"
    if ours <= 0:
        return "not checked", "the optimizer moved no bytes in this direction"
    if within(nvml, expected, tolerance):
        return "pass", None
    idle = "unknown" if background is None else f"≈{background:.0f} B"
    return "fail", (f"NVML counted {nvml / expected:.3f}x what our bytes predict through the link's measured "
                    f"overhead ({nvml / ours:.3f}x our payload bytes; other traffic on this GPU's link when idle: "
                    f"{idle} over the same time): a transfer not counted, counted twice, or traffic that is not ours")


def wrap_problem(dev: dict[str, Any], overhead: dict[str, Any]) -> str | None:
    """Why the counter totals cannot be trusted to the byte: a 32-bit counter could have wrapped unseen between two
    reads, in this window or in a calibration window (or the link's speed is unknown, so nobody can tell)."""
    for where, d in [("window", dev)] + [("calibration", c) for c in overhead.get("devices") or []]:
        bits = [b for b in (d.get("counter_bits") or {}).values() if b]
        gap = d.get("counter_max_gap_s")
        if d.get("wrap_ambiguous") is True:
            return (f"{where}: a {min(bits, default='?')}-bit counter could have wrapped unseen between two reads "
                    f"(longest gap {gap:.3f} s)" if gap is not None else f"{where}: a counter could have wrapped")
        if d.get("wrap_ambiguous") is None and (not bits or min(bits) < 64):
            return f"{where}: cannot tell whether a counter wrapped between reads (link generation or width unknown)"
    return None


def compare_counters(ours: dict[str, int], overhead: dict[str, Any], dev: dict[str, Any], idle_dev: dict[str, Any],
                     window: float, idle_s: float, tolerance: float = TOLERANCE) -> dict[str, dict[str, Any]]:
    """Per direction: our payload bytes, NVML's counter, the counter predicted from our bytes and the overhead, and
    the idle window's bytes (scaled to the run's window: how much traffic is not ours)."""
    rows = {}
    for d in LINK_DIRECTIONS:
        key = COUNTERS[d]
        idle = idle_dev.get(key)
        background = None if idle is None or idle_s <= 0 else idle * window / idle_s
        expected = predicted(ours, overhead, key)
        status, reason = agreement(dev.get(key), expected, ours[d], background, tolerance)
        rows[d] = {"ours": ours[d], "nvml": dev.get(key), "predicted": expected,
                   "overhead": overhead.get(d, {}).get(key), "idle_nvml": idle, "idle_s": idle_s,
                   "status": status, "reason": reason}
    return rows


def variants(ours_by_kind: dict[str, int]) -> dict[str, dict[str, int]]:
    """The negative controls' byte counts: each (direction, kind) left uncounted, and the directions swapped."""
    out = {f"{key} left uncounted": per_direction({k: n for k, n in ours_by_kind.items() if k != key})
           for key in ours_by_kind}
    ours = per_direction(ours_by_kind)
    return out | {"directions swapped": {"d2h": ours["h2d"], "h2d": ours["d2h"]}}


def prediction_shift(ours: dict[str, int], variant: dict[str, int], overhead: dict[str, Any]) -> float:
    """How far a variant moves the prediction: the largest relative change over both counters."""
    shifts = []
    for counter in COUNTERS.values():
        base, other = predicted(ours, overhead, counter), predicted(variant, overhead, counter)
        if base:
            shifts.append(abs(other / base - 1))
    return max(shifts, default=0.0)


def negative_controls(ours_by_kind: dict[str, int], overhead: dict[str, Any], dev: dict[str, Any],
                      tolerance: float = TOLERANCE) -> list[dict[str, Any]]:
    """Each variant against the same NVML counters: one the counters can resolve must fail."""
    ours, out = per_direction(ours_by_kind), []
    for name, variant in variants(ours_by_kind).items():
        shift = prediction_shift(ours, variant, overhead)
        if shift <= RESOLUTION:
            out.append(control(name, None, f"below resolution: moves the prediction by {shift:.2%} "
                                           f"(<= {RESOLUTION:.0%})"))
            continue
        hits = [within(dev.get(c), predicted(variant, overhead, c), tolerance) for c in COUNTERS.values()]
        verdicts = ", ".join(f"{c} {'unknown' if h is None else 'within' if h else 'missed'}"
                             for c, h in zip(COUNTERS.values(), hits))
        failed = None if all(h is None for h in hits) else any(h is False for h in hits)
        out.append(control(name, failed, f"moves the prediction by {shift:.1%}; {verdicts}"))
    return out


def window_verdict(ours_by_kind: dict[str, int], overhead: dict[str, Any], dev: dict[str, Any],
                   idle_dev: dict[str, Any], window: float, idle_s: float, asymmetric: bool,
                   tolerance: float = TOLERANCE) -> dict[str, Any]:
    """One window: "not checked" if a counter could have wrapped (or is unsupported); "fail" if a counter misses the
    prediction, a negative control passes, or a control the window exists for cannot be resolved."""
    ours = per_direction(ours_by_kind)
    rows = compare_counters(ours, overhead, dev, idle_dev, window, idle_s, tolerance)
    keep = ("name", "pci_bus_id", "counter_bits", "counter_max_gap_s", "wrap_ambiguous", "counter_reads")
    out = {"ours_by_kind": ours_by_kind, "directions": rows, "window_s": window, "asymmetric": asymmetric,
           **{("gpu" if k == "name" else k): dev.get(k) for k in keep}}
    unrun = [control("uncounted kinds, swapped directions", None, "run only once the window's own comparison passes")]
    if dev.get("counters") != "nvml_fi":
        return out | {"status": "not checked", "reason": f"counters unsupported: {dev.get('counter_errors')}",
                      "controls": unrun}
    wrapped = wrap_problem(dev, overhead)
    if wrapped:  # the totals may be short by a wrap: no comparison is made with them
        rows = {d: r | {"status": "not checked", "reason": wrapped} for d, r in rows.items()}
        return out | {"directions": rows, "status": "not checked", "reason": wrapped, "controls": unrun}
    statuses = {r["status"] for r in rows.values()}
    problems = [f"{d}: {r['reason']}" for d, r in rows.items() if r["status"] == "fail"]
    if problems or statuses != {"pass"}:
        reasons = problems or [f"{d}: {r['reason']}" for d, r in rows.items() if r["reason"]]
        return out | {"status": "fail" if problems else "not checked", "reason": "; ".join(reasons),
                      "controls": unrun}
    controls = negative_controls(ours_by_kind, overhead, dev, tolerance)
    problems = [f"negative control passed: {name}" for name in blind_spots(controls)]
    resolved = {c["control"] for c in controls if c["outcome"] != NOT_RUN}
    if not any(name.endswith("left uncounted") for name in resolved):
        problems.append("no kind of transfer is large enough to be missed: the window cannot show an uncounted copy")
    if asymmetric and "directions swapped" not in resolved:
        problems.append(f"the traffic came out symmetric (d2h {ours['d2h']} B, h2d {ours['h2d']} B): a direction swap "
                        "cannot be seen")
    return out | {"status": "fail" if problems else "pass", "reason": "; ".join(problems) or None,
                  "controls": controls}


def pcie_verdict(windows: dict[str, dict[str, Any]], overhead: dict[str, Any]) -> dict[str, Any]:
    """The check: fail if any window fails, else not checked if any could not be checked, else pass."""
    statuses = {w["status"] for w in windows.values()}
    status = "fail" if "fail" in statuses else "pass" if statuses == {"pass"} else "not checked"
    reason = "; ".join(f"{name}: {w['reason']}" for name, w in windows.items() if w["reason"]) or None
    controls = [c | {"control": f"{name}: {c['control']}"} for name, w in windows.items() for c in w["controls"]]
    return check("pcie", status, reason, windows=windows, overhead=overhead, tolerance=TOLERANCE, controls=controls)
