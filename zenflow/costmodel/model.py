"""Cost model: step time, compute / I/O / stall split and bytes of no-offload, ZeRO-Offload and ZenFlow.

Every formula is explained in docs/cost-model.md. Inputs are rates measured by `zenflow.costmodel.calibrate` (the
cpu-scale machine) or stated hardware facts (`zenflow.costmodel.presets`, GPU projections, labelled "projected").

    python -m zenflow.costmodel.whatif --help            # what-if: your numbers -> speedup, best topk/update_interval
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

ENGINES = ("no-offload", "zero-offload", "zero-offload-dpu", "zero-offload-gas", "zenflow-sync", "zenflow-overlap",
           "zenflow-da-sync", "zenflow-da-overlap")
ACCUMULATOR_BYTES = 4.0  # device accumulation ships an fp32 sum (device_accumulation.py)


class CostModelError(ValueError):
    """Inputs the model cannot use (missing, non-positive, unknown preset, foreign calibration record)."""


OPTIONAL = ("fb_ms_no_offload", "device_accum_gelem_s", "device_accum_gelem_s_overlap")


@dataclass(frozen=True)
class Inputs:
    """One rank's view of one training step. Times in ms, bandwidths in GB/s (1e9 B/s), rates in G elements/s."""
    column_params: float        # N: elements of the >= 2-D params (what ZenFlow splits by columns)
    dense_params: float         # biases, norms: always on the device
    tokens: float               # tokens per step per rank (micro-batch x sequence)
    dtype_bytes: float          # b: bytes per element of params and grads on the link
    fb_ms: float                # forward + backward on the device, all device resources
    fb_ms_overlap: float        # the same while the host worker runs (cpu-scale: the device keeps 1 of 2 cores)
    device_opt_ms: float        # no-offload: clipping + AdamW of every param on the device
    device_base_ms: float       # offload engines, nothing selected: global grad norm + dense params (sync layout)
    device_base_ms_overlap: float  # the same with the overlap layout
    device_col_ns: float        # device update per selected column element: gather, fp32 AdamW, scatter (ns)
    d2h_gbps: float             # contiguous copies (all columns)
    h2d_gbps: float
    gather_gbps: float          # column-subset copies (the unselected columns), device -> host
    scatter_gbps: float         # ... and host -> device
    accum_gelem_s: float        # host fp32 accumulation of gradients, sync layout (host cores it may use)
    adamw_gelem_s: float        # host AdamW (+ cast into the upload buffer), sync layout
    accum_gelem_s_worker: float  # the same on the overlap worker's cores
    adamw_gelem_s_worker: float
    compute_slowdown: float = 1.0  # device work slowed by a busy host worker (shared memory bandwidth); 1 = none
    host_slowdown: float = 1.0     # host work slowed by busy device work
    grad_copy_hidden: bool = False  # the gradient copy overlaps backward (GPU: DeepSpeed copies buckets early)
    fb_ms_no_offload: float | None = None  # forward+backward in the no-offload loop when it differs (cpu-scale)
    device_accum_gelem_s: float | None = None  # device accumulation: gather + fp32 add of the unselected columns on
    #                                            the device, sync layout (None: the host's rate `accum_gelem_s`)
    device_accum_gelem_s_overlap: float | None = None  # the same with the overlap layout (None: `accum_gelem_s_worker`)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool):
                continue
            if value is None and f.name in OPTIONAL:
                continue
            if value is None or not isinstance(value, (int, float)) or math.isnan(value):
                raise CostModelError(f"{f.name} = {value!r}: a number is required")
            allowed_zero = f.name in ("dense_params", "device_base_ms", "device_base_ms_overlap", "device_col_ns")
            if value < 0 or (value == 0 and not allowed_zero):
                raise CostModelError(f"{f.name} = {value!r}: must be > 0" + (" (or 0)" if allowed_zero else ""))


@dataclass(frozen=True)
class Block:
    """The ZenFlow block (DeepSpeed's names); ZeRO-Offload is topk_ratio 0, update_interval 1."""
    topk_ratio: float = 0.1
    update_interval: int = 4
    overlap_step: bool = True
    full_warm_up_rounds: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.topk_ratio <= 1:
            raise CostModelError(f"topk_ratio = {self.topk_ratio!r}: expected 0 <= topk_ratio <= 1")
        if not isinstance(self.update_interval, int) or self.update_interval < 1:
            raise CostModelError(f"update_interval = {self.update_interval!r}: expected an int >= 1")


@dataclass
class Prediction:
    engine: str
    accumulate_ms: float | None  # None when every step is an update step
    update_ms: float
    cycle_ms: float              # mean step time over one update cycle (warm-up excluded)
    compute_ms: float            # per step, means over the cycle
    io_ms: float                 # exposed transfers
    stall_ms: float              # device idle waiting for the host
    bytes_per_step: float        # grads down + params up, column params (docs/design.md §2)


def _ms(elements: float, gelem_s: float) -> float:
    return elements / gelem_s / 1e6


def selection_exchange_bytes(columns: float, column_params: float, grad_bytes: float = 2.0,
                             norm_bytes: float = 4.0) -> dict[str, float]:
    """Bytes each rank contributes to agree on a selection: one norm per column (our all-reduce of fp32 norms)
    vs the gradients themselves (what an all-gather of the column params' gradients sends, bf16)."""
    norms, gradients = columns * norm_bytes, column_params * grad_bytes
    return {"norm_bytes": norms, "gradient_bytes": gradients, "ratio": gradients / norms}


def transfer_bytes(n: float, b: float, r: float, interval: int, device_accumulation: bool = False) -> float:
    """docs/design.md §2: ZeRO-Offload 2·N·b; ZenFlow (1-r)·N·b·(1 + 1/U); with device accumulation the fp32 sum
    down and the parameters up once per interval, (1-r)·N·(4 + b)/U."""
    if device_accumulation:
        return (1 - r) * n * (ACCUMULATOR_BYTES + b) / interval
    return (1 - r) * n * b * (1 + 1 / interval)


def predict(x: Inputs, engine: str, block: Block | None = None) -> Prediction:
    """Steady-state step times of one engine; `block` sets topk_ratio / update_interval for the ZenFlow engines and
    the accumulation of zero-offload-gas (ZeRO-Offload at ZenFlow's update frequency: every gradient copied down
    and summed on the host each step, one host AdamW per update_interval steps: the same-frequency control)."""
    n, b = x.column_params, x.dtype_bytes
    if engine == "no-offload":
        t = (x.fb_ms if x.fb_ms_no_offload is None else x.fb_ms_no_offload) + x.device_opt_ms
        return Prediction(engine, None, t, t, t, 0.0, 0.0, 0.0)
    if engine in ("zero-offload", "zero-offload-dpu"):
        block = Block(0.0, 1, engine == "zero-offload-dpu")
    elif engine == "zero-offload-gas":
        block = Block(0.0, (block or Block()).update_interval, False)
    elif engine in ("zenflow-sync", "zenflow-overlap"):
        block = replace(block or Block(), overlap_step=engine == "zenflow-overlap")
    elif engine in ("zenflow-da-sync", "zenflow-da-overlap"):
        return _device_accumulation(x, replace(block or Block(), overlap_step=engine == "zenflow-da-overlap"), engine)
    else:
        raise CostModelError(f"engine = {engine!r}: expected one of {ENGINES}")
    r, u = block.topk_ratio, block.update_interval
    host_n = (1 - r) * n
    subset = 0 < r < 1  # only column subsets need a gather / scatter; all columns are plain copies
    down = host_n * b / ((x.gather_gbps if subset else x.d2h_gbps) * 1e6)
    up = host_n * b / ((x.scatter_gbps if subset else x.h2d_gbps) * 1e6)
    bytes_step = transfer_bytes(n, b, r, u)
    if not block.overlap_step:
        device = x.fb_ms + x.device_base_ms + r * n * x.device_col_ns / 1e6
        io_down = max(0.0, down - x.fb_ms * 2 / 3) if x.grad_copy_hidden else down  # backward ≈ 2/3 of fwd+bwd
        acc = device + io_down + _ms(host_n, x.accum_gelem_s) * (r < 1)
        upd = acc + (_ms(host_n, x.adamw_gelem_s) + up) * (r < 1)
        cycle = ((u - 1) * acc + upd) / u
        stall = (u * _ms(host_n, x.accum_gelem_s) + _ms(host_n, x.adamw_gelem_s)) / u * (r < 1)
        io = (u * io_down + up) / u * (r < 1)
        return Prediction(engine, acc if u > 1 else None, upd, cycle, device, io, stall, bytes_step)
    # overlap: the worker gathers + accumulates every step and runs host AdamW once per cycle, in the background;
    # the training thread waits at each boundary for the previous boundary's job (FIFO, one interval of slack).
    device_alone = x.fb_ms_overlap + x.device_base_ms_overlap + r * n * x.device_col_ns / 1e6
    worker_alone = (u * (down + _ms(host_n, x.accum_gelem_s_worker)) + _ms(host_n, x.adamw_gelem_s_worker)) \
        if r < 1 else 0.0
    return _overlapped(x, engine, u, device_alone, worker_alone, up, up / u, bytes_step)


def _overlapped(x: Inputs, engine: str, u: int, device_alone: float, worker_alone: float, up: float, io: float,
                bytes_step: float) -> Prediction:
    """The overlap layout, whatever the worker does: per step `device_alone` on the training thread, per cycle
    `worker_alone` on the worker and `up` (the upload) at the boundary; `io` the exposed transfers per step. The
    training thread waits at each boundary for the previous boundary's job (FIFO, one interval of slack)."""
    train_alone = u * device_alone + up
    busy = min(1.0, worker_alone / train_alone)  # fraction of the cycle the worker competes for memory bandwidth
    device = device_alone * (1 + (x.compute_slowdown - 1) * busy)
    worker = worker_alone * x.host_slowdown
    train = u * device + up
    stall = max(0.0, worker - train)  # the queue never drains faster than the worker works
    upd = device + up + stall
    cycle = ((u - 1) * device + upd) / u
    return Prediction(engine, device if u > 1 else None, upd, cycle, device, io, stall / u, bytes_step)


def _device_accumulation(x: Inputs, block: Block, engine: str) -> Prediction:
    """ZenFlow with the unselected columns summed on the device (docs/cost-model.md, "Device accumulation"): every
    step the device gathers them into its fp32 accumulator; once per interval the sum crosses (4 B per element,
    contiguous) and the host runs AdamW only, then the columns go back as with host accumulation."""
    n, b = x.column_params, x.dtype_bytes
    r, u = block.topk_ratio, block.update_interval
    host_n = (1 - r) * n * (r < 1)
    ship = host_n * ACCUMULATOR_BYTES / (x.d2h_gbps * 1e6)
    up = host_n * b / ((x.scatter_gbps if 0 < r < 1 else x.h2d_gbps) * 1e6)
    bytes_step = transfer_bytes(n, b, r, u, device_accumulation=True) * (r < 1)
    if not block.overlap_step:
        rate = x.device_accum_gelem_s or x.accum_gelem_s
        device = x.fb_ms + x.device_base_ms + r * n * x.device_col_ns / 1e6 + _ms(host_n, rate)
        host = _ms(host_n, x.adamw_gelem_s)
        upd = device + ship + host + up
        return Prediction(engine, device if u > 1 else None, upd, ((u - 1) * device + upd) / u, device,
                          (ship + up) / u, host / u, bytes_step)
    # overlap: the device's per-step work grows by the accumulation; the worker only waits for the shipped sum and
    # runs AdamW once per cycle. The same FIFO queue and contention rule as host accumulation.
    rate = x.device_accum_gelem_s_overlap or x.accum_gelem_s_worker
    device_alone = x.fb_ms_overlap + x.device_base_ms_overlap + r * n * x.device_col_ns / 1e6 + _ms(host_n, rate)
    worker_alone = ship + _ms(host_n, x.adamw_gelem_s_worker)
    return _overlapped(x, engine, u, device_alone, worker_alone, up, (ship + up) / u, bytes_step)


def predict_all(x: Inputs, block: Block | None = None) -> dict[str, Prediction]:
    return {e: predict(x, e, block) for e in ENGINES}


def best_block(x: Inputs, max_device_fraction: float = 1.0, tolerance: float = 0.02) -> tuple[Block, Prediction]:
    """The overlap ZenFlow block with the lowest predicted cycle time over a grid of topk_ratio x update_interval,
    topk_ratio <= max_device_fraction (device memory for the fp32 master + moments of the selected columns);
    among blocks within `tolerance` of the best, the smallest update_interval (least staleness), then the
    smallest topk_ratio (least device memory)."""
    grid = [Block(r, u) for r in (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5) if r <= max_device_fraction
            for u in (1, 2, 4, 8, 16)]
    if not grid:
        raise CostModelError(f"max_device_fraction = {max_device_fraction!r}: no topk_ratio >= 0.01 fits")
    scored = [(predict(x, "zenflow-overlap", blk), blk) for blk in grid]
    best = min(p.cycle_ms for p, _ in scored)
    near = [(blk.update_interval, blk.topk_ratio, blk, p) for p, blk in scored if p.cycle_ms <= best * (1 + tolerance)]
    _, _, blk, pred = min(near, key=lambda t: (t[0], t[1]))
    return blk, pred
