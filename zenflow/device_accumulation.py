"""Device accumulation (`ZenFlowAdamW(accumulate_on="device")`): the unselected gradient columns are summed on the
device in fp32 and cross the link once per update interval, instead of every step.

The same algorithm as host accumulation, moved across the link. Every step adds this host's unselected columns of
the (clipped) gradient into an fp32 accumulator on the parameter's device, with the arithmetic the host would use
(host.accumulate_into_: the interval's first gradient upcast and scaled, later ones added as one fused multiply-add
acc + clip·grad in fp32), so the sum is the host's bit for bit. At a boundary each accumulator is shipped
through the link into its host part's landing accumulator (an fp32 view of the staging arena, page-locked on CUDA,
HostColumns.device_sums) with its count, and the host part only runs the deferred AdamW (host.host_adamw_): inline,
or on the worker one interval late with overlap_step, exactly as with host accumulation.

Bytes over the link per interval of U steps, per column param with P = out x (host-owned columns) elements and a
model dtype of b bytes: host accumulation U·b·P down + b·P up; device accumulation 4·P down + b·P up. Device memory:
4·P per column param (the accumulator). docs/host-worker.md, "Device accumulation".

Which side sums is decided once, at construction (`accumulation`, as distributed.data_parallel decides data
parallelism): the optimizer's `accumulation`, a HostSums or a DeviceSums, owns the four places where the two
differ, so that the step itself carries one mode flag (overlap): how many gradient staging buffers a host part gets
(`n_staging`), whether the step's gradient columns cross now (`start_offload`), how they are added (`accumulate`),
and whether the interval's sums cross at the boundary (`ship`). HostSums lives here beside its twin: host.py, whose
functions it calls, is imported by device.py and state.py, which it needs too (an import cycle).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from zenflow.config import ConfigError
from zenflow.device import start_offload
from zenflow.host import GradCopy, accumulate_, accumulate_into_, grad_staging_count
from zenflow.layout import take_columns
from zenflow.link import Link
from zenflow.selection import as_columns
from zenflow.state import ColumnState, offloads
from zenflow.worker import HostWorker


# ---- which side sums: decided once ------------------------------------------------------------------------------
def accumulation(accumulate_on: str, link: Link, worker: HostWorker, overlap_step: bool) -> HostSums | DeviceSums:
    """ZenFlowAdamW's `accumulate_on`, already checked by config.check_accumulate_on: "device" sums on the device,
    "host" (the default) on the host."""
    if accumulate_on == "device":
        return DeviceSums(link)
    return HostSums(link, worker, overlap_step)


class HostSums:
    """Host accumulation: every step's unselected gradient columns cross into staging buffers and the host adds them
    (host.accumulate_), inline or as a worker job; at a boundary they are on the host already."""

    def __init__(self, link: Link, worker: HostWorker, overlap_step: bool) -> None:
        self.link = link
        self.worker = worker
        self.n_staging = grad_staging_count(overlap_step, link.cuda)  # per host part, the whole run
        self._turn = 0  # which staging buffer the next step's copies land in (CUDA overlap: two alternate)

    def start_offload(self, params: list[torch.Tensor], state: dict, in_background: bool) -> list[GradCopy]:
        """Start the copies of the unselected gradient columns into this step's staging buffers (CUDA: they run
        beside the device update)."""
        if in_background:
            self.worker.backpressure()  # the staging buffer about to be written must have been read
        turn = self._turn % self.n_staging  # CUDA overlap: step t lands while t-1 is read
        self._turn += 1
        return start_offload(params, state, self.link, turn)

    def accumulate(self, params: list[torch.Tensor], state: dict, copies: list[GradCopy], slot: int,
                   clip: torch.Tensor | None, report_mass: bool,
                   in_background: bool) -> tuple[list[float] | Future | None, list[int]]:
        """Add the copies into the fp32 accumulators of `slot`: inline, or as a worker job (overlap_step). Returns
        the masses (report_mass: the list, or the job's future of it) and each copy's elements."""
        job = functools.partial(accumulate_, self.link, copies, slot, clip, report_mass)
        result = self.worker.submit("accumulate", job) if in_background else job()
        return result, [c.part.offloaded_elements for c in copies]  # whole rows: not the shadows

    def ship(self, states: list[tuple[torch.Tensor, ColumnState]], slot: int) -> list[GradCopy]:
        return []  # nothing to ship: the columns crossed every step


class DeviceSums:
    """Device accumulation: nothing crosses per step; the unselected columns are added into fp32 sums on the device
    (accumulate_on_device_) that cross once, at the boundary (ship_). Host parts get no gradient staging: their
    accumulators are the arena's landing views (HostColumns.device_sums)."""

    n_staging = 0

    def __init__(self, link: Link) -> None:
        self.link = link

    def start_offload(self, params: list[torch.Tensor], state: dict, in_background: bool) -> list[GradCopy]:
        return []  # nothing crosses before the boundary

    def accumulate(self, params: list[torch.Tensor], state: dict, copies: list[GradCopy], slot: int,
                   clip: torch.Tensor | None, report_mass: bool,
                   in_background: bool) -> tuple[DeviceMasses | None, list[int]]:
        """On the device, in the step (the worker has no part in it); the sums ship into `slot` at the boundary."""
        masses = accumulate_on_device_(params, state, self.link, clip, report_mass)
        return masses, masses.numels if masses is not None else []

    def ship(self, states: list[tuple[torch.Tensor, ColumnState]], slot: int) -> list[GradCopy]:
        """The interval's sums cross now, once, into this slot's landing accumulators (no host job still reads
        them)."""
        return ship_(states, self.link, slot)


# ---- the arithmetic -----------------------------------------------------------------------------------------------
@dataclass
class DeviceMasses:
    """One step's RMS per element of every offloaded parameter's accumulated sum (what host.accumulate_ reports for
    the "auto" interval), computed on the device and copied to the host without a wait: read AUTO_LAG steps later.
    Called, it gives the list host.accumulate_ would have returned."""

    numels: list[int]                         # per offloaded parameter: its accumulator's elements
    norms: torch.Tensor | None = None         # [len(numels)] fp32 on the host (CUDA: pinned, async copy)
    ready: torch.cuda.Event | None = None     # CUDA: that copy's event

    def __call__(self) -> list[float]:
        if self.ready is not None:
            self.ready.synchronize()  # long complete when read
            self.ready = None
        norms = [] if self.norms is None else self.norms.tolist()
        return [norm / max(1, n) ** 0.5 for norm, n in zip(norms, self.numels)]  # host.accumulate_'s expression


def accumulate_on_device_(params: list[torch.Tensor], state: dict, link: Link, clip: torch.Tensor | None,
                          report_mass: bool = False) -> DeviceMasses | None:
    """Add this step's unselected gradient columns (this host's: `st.unsel`) into each parameter's fp32 device
    accumulator. `clip`: the step's clipping coefficient as the host holds it (Clip.host: a CPU number, so reading
    it is no device sync), applied in fp32 as the host would (p.grad stays as backward produced it). `report_mass`:
    return the step's masses for the "auto" interval."""
    scale = 1.0 if clip is None else float(clip)
    norms, numels = [], []
    for p in params:
        st = state[p]
        if not offloads(p, st):
            continue
        grad = as_columns(p.grad)
        every_column = st.unsel.numel() == grad.shape[1]  # warm-up, ZeRO-Offload, whole rows: no gather
        block = grad if every_column else take_columns(grad, st.unsel)  # every column: p.grad itself, only read
        _add_(st, block, scale, link)
        numels.append(st.host.offloaded_elements)  # whole rows: not the shadows
        if report_mass:
            norms.append(torch.linalg.vector_norm(st.host.offloaded(st.d_acc)))
    if not report_mass:
        return None
    masses = DeviceMasses(numels)
    if norms:
        masses.norms = link.host_empty((len(norms),), torch.float32)
        masses.norms.copy_(torch.stack(norms), non_blocking=link.cuda)
        masses.ready = link.compute_event()
    return masses


def _add_(st: ColumnState, block: torch.Tensor, scale: float, link: Link) -> None:
    """The interval's first gradient is copied (no zero-fill) and scaled, later ones added as acc + scale·block in
    one rounding, as host.accumulate_into_ does."""
    first = st.d_acc_count == 0
    if first:
        if st.d_acc is None or st.d_acc.shape != block.shape:  # first use, or a rank's block changed width
            # allocated on the compute stream, which writes it; a replaced one is kept by record_stream until its
            # last ship has read it (Link.gather_to_host)
            st.d_acc = torch.empty(block.shape, dtype=torch.float32, device=block.device)
        link.compute_waits_for(st.d_acc_shipped)  # CUDA: the last ship must have read it (no host wait)
        st.d_acc_shipped = None
    if st.d_acc.device.type == "cpu":
        accumulate_into_(st.d_acc, block, scale, first)  # the CPU device: the host's own blocked kernel
    else:
        add_on_device_(st.d_acc, block, scale, first)
    st.d_acc_count += 1


def add_on_device_(acc: torch.Tensor, block: torch.Tensor, scale: float, first: bool) -> None:
    """_add_ on a CUDA device: acc (fp32) = scale·block (`first`) or acc += scale·block, torch's own kernels. A
    function of its own so that a CPU test can hold its arithmetic to host.accumulate_into_'s: no CPU-device run
    reaches it (tests/harness/checks/test_cuda_differential.py)."""
    if first:
        acc.copy_(block)  # upcast exactly
        if scale != 1.0:
            acc.mul_(scale)
    else:
        acc.add_(block, alpha=scale)  # fp32 += scale·(the gradient's dtype, upcast): one fused multiply-add


def ship_(states: list[tuple[torch.Tensor, ColumnState]], link: Link, slot: int) -> list[GradCopy]:
    """Boundary: every accumulator with gradients in it crosses once, into its host part's landing accumulator of
    `slot`, and its count with it, so host_adamw_ takes the mean. Bytes are counted now (kind "grads", fp32).

    CUDA: each copy runs on the d2h stream after the adds (Link.gather_to_host orders it by an event); whoever runs
    the host update waits for it (land_), and the accumulator's next write waits for it on the compute stream. CPU
    device: a plain copy, now. `states`: every column param's (param, state), frozen ones too (host accumulation
    keeps their sums for the host update as well)."""
    shipped = []
    for _, st in states:
        if st.d_acc_count == 0:
            continue
        part = st.host
        landing = part.accumulators[slot]
        link.observers.transfer("d2h", "grads", part.offloaded_elements * st.d_acc.element_size())
        st.d_acc_shipped = link.gather_to_host(st.d_acc, None, landing)
        part.counts[slot] = st.d_acc_count
        st.d_acc_count = 0
        shipped.append(GradCopy(part, landing, done=st.d_acc_shipped))
    return shipped


def land_(link: Link, shipped: list[GradCopy]) -> None:
    """Wait until the shipped sums are on the host (CUDA sync point, per parameter; nothing on the CPU device)."""
    for copy in shipped:
        copy.land(link)


def landed_then(link: Link, shipped: list[GradCopy], job: Callable[[], object]) -> object:
    """A host job (the worker's, with overlap_step) that first waits for the interval's sums to land."""
    land_(link, shipped)
    return job()


# ---- checkpoints: the interval's partial sum, saved as host accumulation holds it --------------------------------
def interval_sums(st: ColumnState, slot: int) -> tuple[list[torch.Tensor], list[int]]:
    """(host_accumulators, host_counts) for a checkpoint. Device accumulation saves its partial sum where host
    accumulation would hold it (the accumulator of `slot`, zeros in the others), so a checkpoint is the same whichever
    side sums and loads into either; the landing accumulators hold nothing between steps."""
    part = st.host
    if not part.device_sums:
        return list(part.accumulators), list(part.counts)
    if not part.built:
        return [], [0] * len(part.counts)
    sums = [torch.zeros(part.rows, part.n_host) for _ in part.counts]
    counts = [0] * len(part.counts)
    if st.d_acc_count:
        sums[slot] = st.d_acc.to("cpu", torch.float32, copy=True)  # device->host sync (checkpointing only)
        counts[slot] = st.d_acc_count
    return sums, counts


def check_saved_counts(counts: list[int]) -> None:
    """Device accumulation holds one partial sum: a checkpoint with two accumulators in use cannot continue on the
    device (ZenFlowAdamW.state_dict never writes one: the worker has finished every host update when it saves)."""
    if sum(1 for count in counts if count) > 1:
        raise ConfigError(f"state_dict host_counts = {counts} is not allowed with accumulate_on='device': expected at "
                          "most one accumulator with gradients in it (a state_dict saved by ZenFlowAdamW.state_dict)")


def restore_sums_(st: ColumnState, accumulators: list[torch.Tensor], counts: list[int], device: torch.device) -> None:
    """Device accumulation: a checkpoint's partial interval sum (saved by either side; check_saved_counts) goes into
    the device accumulator; the landing accumulators start empty."""
    in_use = [i for i, count in enumerate(counts) if count]
    st.host.counts = [0] * len(st.host.counts)
    st.d_acc, st.d_acc_count, st.d_acc_shipped = None, 0, None
    if in_use:
        st.d_acc = accumulators[in_use[0]].to(device, torch.float32, copy=True)
        st.d_acc_count = counts[in_use[0]]
