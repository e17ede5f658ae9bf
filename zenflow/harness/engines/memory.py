"""What each engine holds in memory, per rank: one function per kind of footprint, named by an engine's registry row
(`EngineSpec.memory`) and read by the memory plan (`memory_plan.estimate`, `scale_plan`; docs: memory_plan.py).

A memory function takes the run's `MemoryInputs` (the model's shape, the dtype, the engine's own ZenFlow block, the
activations) and the few facts of its engine's row it reads (`RowFacts`), not the row itself: the registry imports
this module, so this module cannot import the registry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from zenflow.host import host_bytes
from zenflow.layout import whole_rows
from zenflow.selection import num_selected


@dataclass(frozen=True)
class RowFacts:
    """What a memory function reads of its engine's row (EngineSpec.row_facts): the cycle rule (registry.CYCLE_RULES),
    where its ZenFlowAdamW sums the unselected columns (its class's `accumulate_on`), and the share of the optimizer's
    state on the host where no ZenFlow block sets it."""

    cycle_rule: str = "step"
    accumulate_on: str = "host"
    host_share: float = 1.0


class Shape(Protocol):
    """What a memory function reads of memory_plan.ModelShape."""

    @property
    def params(self) -> int: ...

    @property
    def all_params(self) -> int: ...

    @property
    def column_params(self) -> int: ...

    @property
    def layers(self) -> int: ...

    @property
    def root_params(self) -> int: ...

    def matrices(self) -> list[int]: ...

    def widths(self) -> list[int]: ...


@dataclass(frozen=True)
class MemoryInputs:
    """What every engine's estimate starts from: the model's shape, the training dtype's bytes `b`, the engine's own
    ZenFlow block (EngineSpec.own_block), the activations' bytes and the run child's measured base."""

    shape: Shape
    b: int
    cuda: bool
    block: dict[str, Any]
    acts: int
    base: int
    world: int = 1  # ranks (GPUs) sharing the work; the footprint is one rank's (memory_ours_fsdp2 divides by it)

    def pin(self, n: int) -> int:
        return pow2(n) if self.cuda else n  # rounding only where torch pins

    @property
    def fp32_each(self) -> int:
        """A pinned fp32 copy per parameter (FSDP2, torchao, DeepSpeed's gradient accumulator)."""
        return sum(self.pin(4 * n) for n in self.shape.matrices())

    @property
    def trained(self) -> int:
        """The model in the training dtype, its gradients and the activations: on the device for every engine."""
        return self.b * self.shape.all_params + self.b * self.shape.params + self.acts


@dataclass(frozen=True)
class Footprint:
    """Bytes on the device, pinned and pageable on the host (before the CPU-device fold and the process base)."""

    device: float
    pinned: float
    pageable: float
    note: str = ""
    shm: float = 0  # of the host bytes, those in /dev/shm (DeepSpeed's ZenFlow shares its buffers with its worker)


def memory_on_device(m: MemoryInputs, row: RowFacts) -> Footprint:
    """Nothing beyond the trained model: an engine without a memory function of its own."""
    return Footprint(m.trained, 0, 0)


def memory_ours(m: MemoryInputs, row: RowFacts) -> Footprint:
    """ZenFlowAdamW: the host-owned columns' state (our_host_bytes); on the device the fp32 state of the dense
    parameters and the selected columns, under overlap on CUDA the gathered sets in flight and the landing set (the
    CPU device has neither: its gathers write straight into the host buffers, its uploads straight into the
    weights, zenflow/link.py), and with device accumulation (its class's accumulate_on) the fp32 accumulator of the
    unselected columns."""
    shape, topk = m.shape, m.block.get("topk_ratio", 0.1)
    overlap = bool(m.block.get("overlap_step", False))
    accumulate_on = row.accumulate_on
    pinned, pageable = our_host_bytes(shape, topk, m.b, overlap, m.cuda, int(m.block.get("full_warm_up_rounds", 0)),
                                      accumulate_on)
    pinned, pageable = pinned // m.world, pageable // m.world  # data parallelism: each rank hosts its column block
    host_share = 1 - topk  # the unselected columns' share of each weight
    device: float = m.trained
    device += 12 * (shape.params - shape.column_params) + 12 * (1 - host_share) * shape.column_params  # fp32 state
    in_flight = overlap and m.cuda
    if accumulate_on == "device":  # the fp32 sum in place of the gathered sets: only the landing set under overlap
        device += (4 + (m.b if in_flight else 0)) * host_share * shape.column_params
    elif in_flight:
        device += 3 * m.b * host_share * shape.column_params
    return Footprint(device, pinned, pageable)


def memory_ours_fsdp2(m: MemoryInputs, row: RowFacts) -> Footprint:
    """ZenFlowAdamW over FSDP2, per rank: 1/W of the model, its gradients and ZenFlow's device state (memory_ours),
    plus the layers FSDP2 gathers whole (the current and the prefetched one); 1/W of the host state."""
    ours = memory_ours(m, row)  # its host bytes are 1/W already
    layer = (m.shape.column_params - m.shape.root_params) / m.shape.layers  # one decoder layer's weights
    gathered = m.b * (2 * layer + m.shape.root_params)  # a layer and its prefetched next; the root's, whole
    return Footprint((ours.device - m.acts) / m.world + gathered + m.acts, ours.pinned, ours.pageable)


def memory_deepspeed_offload(m: MemoryInputs, row: RowFacts) -> Footprint:
    """ZeRO-2 offload: fp32 partition, training-dtype buffer and fp32 gradients pinned, CPU Adam's moments;
    -gas: a CPU gradient accumulator per parameter; ZenFlow: its worker process and its buffers."""
    P = m.shape.params
    pinned, pageable, note, shm = m.pin(4 * P) + m.pin(m.b * P) + m.pin(4 * P), 8 * P, "", 0
    if row.cycle_rule == "accumulation":
        pinned += m.fp32_each
    if row.cycle_rule == "interval":
        shm = 16 * P  # share_memory_(): the fp32 partition, its stale copy, 2 gradient buffers
        pageable += shm + m.base  # and its worker process
        note = "DeepSpeed's ZenFlow worker is a second process"
    return Footprint(m.trained, pinned / m.world, pageable / m.world, note, shm / m.world)  # ZeRO: a partition each


def memory_overlapped_offload(m: MemoryInputs, row: RowFacts) -> Footprint:
    """OverlappedOffloadAdamW: fp32 master, moments and gradient scratch of every parameter (16 B) pageable; the
    landed gradient and the upload buffer in the training dtype, pinned on CUDA."""
    P = m.shape.params
    return Footprint(m.trained, m.pin(2 * m.b * P) if m.cuda else 0, 16 * P + (0 if m.cuda else 2 * m.b * P))


def memory_zero_infinity(m: MemoryInputs, row: RowFacts) -> Footprint:
    """fp32 parameters and gradients and the training-dtype parameters pinned; gathered layers only on the device."""
    P = m.shape.params
    pinned = m.pin(4 * P) + m.pin(4 * P) + m.pin(m.b * P)
    device = m.b * max(m.shape.matrices()) * 4 + m.b * P // 8 + m.acts  # (medium-low confidence)
    return Footprint(device, pinned, 8 * P, "ZeRO-3 estimate: medium-low confidence")


def memory_twin_flow(m: MemoryInputs, row: RowFacts) -> Footprint:
    """The host share of the optimizer state on the host; fp32 master and moments of the device sub-groups."""
    P, host = m.shape.params, row.host_share
    device = m.trained + int((1 - host) * 12 * P)
    return Footprint(device, m.pin(int(host * 8 * P)), int(host * 8 * P), "ZeRO-3 estimate: medium-low confidence")


def memory_fsdp2(m: MemoryInputs, row: RowFacts) -> Footprint:
    """fp32 parameters and gradients per tensor pinned, AdamW's moments; on the device a few gathered layers."""
    return Footprint(4 * max(m.shape.matrices()) * 4 + m.acts, 2 * m.fp32_each / m.world, 8 * m.shape.params / m.world)


def memory_torchao(m: MemoryInputs, row: RowFacts) -> Footprint:
    """As FSDP2 on the host; on the device fp32 parameters and gradients and the autocast copies."""
    s = m.shape
    return Footprint(4 * s.all_params + 4 * s.params + m.acts + m.b * s.params, 2 * m.fp32_each, 8 * s.params)


def memory_megatron_hybrid(m: MemoryInputs, row: RowFacts) -> Footprint:
    """HybridDeviceOptimizer at offload_fraction f (host_share): fp32 master and moments of the device share on the
    device; of the host share an fp32 copy and fp32 gradient pinned, the moments pageable."""
    P, f = m.shape.params, row.host_share
    host_fp32 = m.pin(int(4 * f * P)) if f else 0
    return Footprint(m.trained + 12 * (1 - f) * P, 2 * host_fp32, 8 * f * P,
                     "Megatron-core estimate: medium confidence")


def memory_device_8bit(m: MemoryInputs, row: RowFacts) -> Footprint:
    """Two 8-bit moments per parameter, a 4-byte scale per block of 256 each, on the device (no fp32 master)."""
    P = m.shape.params
    return Footprint(m.trained + 2 * P + 2 * 4 * P // 256, 0, 0)


def memory_device_adamw(m: MemoryInputs, row: RowFacts) -> Footprint:
    """torch AdamW's moments in the training dtype (no fp32 master)."""
    return Footprint(m.trained + 2 * m.b * m.shape.params, 0, 0)


def memory_device_fp32(m: MemoryInputs, row: RowFacts) -> Footprint:
    """fp32 master and moments on the device."""
    return Footprint(m.trained + 12 * m.shape.params, 0, 0)


def our_host_bytes(shape: Shape, topk: float, b: int, overlap: bool, cuda: bool, warm_up: int,
                   accumulate_on: str = "host") -> tuple[int, int]:
    """ZenFlowAdamW's host buffers (pinned, pageable) at their peak, from the optimizer's own formula
    (`zenflow.host.host_bytes`, what `host_state_bytes` equals): fp32 master, moments and accumulators of the
    host-owned columns (k = ceil(topk·in) selected; every column while warm-up steps run), and the staging arena
    (pinned on CUDA, exact: docs/host-worker.md). With warm-up the arena keeps its full-width size. On the CPU device
    the host parts span whole rows (zenflow/layout.py: the selected columns as shadows), so every column."""
    full = shape.matrices()
    host = [numel // width * (width - num_selected(width, topk)) for numel, width in zip(full, shape.widths())]
    if whole_rows("auto", torch.device("cuda" if cuda else "cpu")):
        host = full
    held = host_bytes(full if warm_up > 0 else host, b, overlap_step=overlap, cuda=cuda,
                      arena_elements=full if warm_up > 0 else host, accumulate_on=accumulate_on)
    arena = host_bytes([0] * len(full), b, overlap_step=overlap, cuda=cuda,
                       arena_elements=full if warm_up > 0 else host, accumulate_on=accumulate_on)
    return (arena, held - arena) if cuda else (0, held)


def pow2(n: int) -> int:
    """torch's CachingHostAllocator rounds every pinned allocation up to a power of two."""
    return 1 << max(0, math.ceil(math.log2(max(1, n))))
