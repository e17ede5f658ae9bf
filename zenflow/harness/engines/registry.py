"""The engine registry: one row (an EngineSpec) per engine, read by everything that used to test an engine's name.

A row says what the engine is (its class and family), where it stands in the experiment (its group, its place in the
tables, the engine its stall reduction is measured against, its same-update-frequency control), how its
DeepSpeed-style config is made (its ZeRO block and its ZenFlow block), what one update cycle is, why it cannot run
somewhere (its class's `unavailable`), and what it holds in memory (its memory function). Who reads what:

    configs.ENGINES, CORE_/CONTROL_/PEER_ENGINES   the names, in table order (the CLI choices; report.engine_rank)
    configs.DEFAULT_ENGINES                        opt_in (a run without --engines leaves those rows out)
    engines.deepspeed_config                       zero, zenflow_block, cycle_rule (gradient accumulation)
    engines.make_engine                            engine_class, cycle (DeepSpeedEngine's step kinds),
                                                   repair_weight_view (ds_divergences.py)
    session.RunSpec.cycle                          cycle (timed steps in whole cycles, the summary's cycle means)
    runner, stepper, the scripts                   family "deepspeed": its launcher, its op-build lock, its package
    runner, bench                                  unavailable: a "skipped" record instead of a run
    report, glue/report                            stall_baseline, control, family
    memory_plan.estimate                           memory, host_share, cycle_rule

Adding an engine is its class (an Engine subclass) and one row in ROWS; tests/harness/engines/test_registry.py does it.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from zenflow.harness.engines.classes import (
    DeepSpeedEngine,
    DeviceAccumulationEngine,
    Engine,
    NoOffloadEngine,
    OverlappedOffloadEngine,
    TorchEngine,
)
from zenflow.harness.engines.optimizer_peers import (
    OFFLOAD_FRACTIONS,
    BitsAndBytesAdamW8bitEngine,
    TorchAOAdamW8bitEngine,
    megatron_hybrid,
)
from zenflow.harness.engines.peers import FSDP2Engine, TorchAOEngine
from zenflow.harness.engines.sharded import ShardedZenFlowEngine
from zenflow.host import host_bytes
from zenflow.layout import whole_rows
from zenflow.selection import num_selected

# ZeRO-Offload expressed as a ZenFlow block: nothing selected, every step a synchronous host update.
OFFLOAD_BLOCK = {"topk_ratio": 0.0, "update_interval": 1, "select_interval": 1, "overlap_step": False}
# no-offload-fp32, the comparable no-offload baseline: every column selected, so AdamW runs on the device every step
# from an fp32 master and fp32 moments (torch AdamW's numbers on an fp32 copy: docs/design.md §2's topk_ratio=1 oracle),
# where no-offload is torch AdamW on the bf16 parameters themselves (small updates round away in bf16).
DEVICE_FP32_BLOCK = {"topk_ratio": 1.0, "update_interval": 1, "select_interval": 10**9, "overlap_step": False}
# Twin-Flow: the share of the optimizer's sub-groups DeepSpeed keeps on the host (offload_optimizer.ratio), and how
# many sub-groups the model is cut into for it (DeepSpeed splits by whole sub-groups; its default sub_group_size of
# 1e9 elements makes one group of any model under 1B parameters, and then the ratio has nothing to split).
TWIN_FLOW_RATIO = 0.5
TWIN_FLOW_SUB_GROUPS = 16

ASKED = "asked"  # zenflow_block of the ZenFlow engines: the run's own block (deepspeed_config's argument)
# whose system: DeepSpeed's, ZenFlowAdamW, PyTorch's, another project's optimizer in the plain loop (Megatron-core,
# torchao, bitsandbytes: optimizer_peers.py), no offload
FAMILIES = ("deepspeed", "ours", "pytorch", "other", "bound")
# configs.CORE_ENGINES, CONTROL_ENGINES, PEER_ENGINES, BEYOND_ENGINES (our variants beyond the paper, run beside the
# core engines); extra: the rest
GROUPS = ("core", "control", "peer", "beyond", "extra")
CYCLE_RULES = ("interval", "accumulation", "step")  # steps per cycle: the block's U, the gradient accumulation U, 1


# ---- ZeRO blocks: (cuda, nvme_path) -> the zero_optimization block, before its ZenFlow block ---------------------
def zero_offload(cuda: bool, nvme_path: str | None) -> dict[str, Any]:
    """ZeRO-2 with the optimizer on the host (ZeRO-Offload); ours read only the ZenFlow block inside it."""
    return {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": cuda}}


def zero_infinity(cuda: bool, nvme_path: str | None) -> dict[str, Any]:
    """ZeRO-3 with parameters and optimizer on the host, or on NVMe at `nvme_path`."""
    where = {"device": "nvme", "nvme_path": nvme_path} if nvme_path else {"device": "cpu"}
    return {"stage": 3, "offload_optimizer": {**where, "pin_memory": cuda},
            "offload_param": {**where, "pin_memory": cuda}}


def twin_flow(cuda: bool, nvme_path: str | None) -> dict[str, Any]:
    """ZeRO-3 with TWIN_FLOW_RATIO of the optimizer's sub-groups on the host; "auto": resolve_sub_groups."""
    return {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": cuda, "ratio": TWIN_FLOW_RATIO},
            "sub_group_size": "auto"}


def not_deepspeed(cuda: bool, nvme_path: str | None) -> dict[str, Any]:
    """Not DeepSpeed: only the config's optimizer, clipping and dtype are read."""
    return {"stage": 0}


# ---- memory: what each engine holds, per rank (memory_plan.estimate; docs: memory_plan.py) ------------------------
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


def memory_on_device(spec: EngineSpec, m: MemoryInputs) -> Footprint:
    """Nothing beyond the trained model: an engine without a memory function of its own."""
    return Footprint(m.trained, 0, 0)


def memory_ours(spec: EngineSpec, m: MemoryInputs) -> Footprint:
    """ZenFlowAdamW: the host-owned columns' state (our_host_bytes); on the device the fp32 state of the dense
    parameters and the selected columns, under overlap on CUDA the gathered sets in flight and the landing set (the
    CPU device has neither: its gathers write straight into the host buffers, its uploads straight into the
    weights, zenflow/link.py), and with device accumulation (its class's accumulate_on) the fp32 accumulator of the
    unselected columns."""
    shape, topk = m.shape, m.block.get("topk_ratio", 0.1)
    overlap = bool(m.block.get("overlap_step", False))
    accumulate_on = getattr(spec.engine_class, "accumulate_on", "host")
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


def memory_ours_fsdp2(spec: EngineSpec, m: MemoryInputs) -> Footprint:
    """ZenFlowAdamW over FSDP2, per rank: 1/W of the model, its gradients and ZenFlow's device state (memory_ours),
    plus the layers FSDP2 gathers whole (the current and the prefetched one); 1/W of the host state."""
    ours = memory_ours(spec, m)  # its host bytes are 1/W already
    layer = (m.shape.column_params - m.shape.root_params) / m.shape.layers  # one decoder layer's weights
    gathered = m.b * (2 * layer + m.shape.root_params)  # a layer and its prefetched next; the root's, whole
    return Footprint((ours.device - m.acts) / m.world + gathered + m.acts, ours.pinned, ours.pageable)


def memory_deepspeed_offload(spec: EngineSpec, m: MemoryInputs) -> Footprint:
    """ZeRO-2 offload: fp32 partition, training-dtype buffer and fp32 gradients pinned, CPU Adam's moments;
    -gas: a CPU gradient accumulator per parameter; ZenFlow: its worker process and its buffers."""
    P = m.shape.params
    pinned, pageable, note, shm = m.pin(4 * P) + m.pin(m.b * P) + m.pin(4 * P), 8 * P, "", 0
    if spec.cycle_rule == "accumulation":
        pinned += m.fp32_each
    if spec.cycle_rule == "interval":
        shm = 16 * P  # share_memory_(): the fp32 partition, its stale copy, 2 gradient buffers (gpu-audit-4 F1)
        pageable += shm + m.base  # and its worker process
        note = "DeepSpeed's ZenFlow worker is a second process"
    return Footprint(m.trained, pinned / m.world, pageable / m.world, note, shm / m.world)  # ZeRO: a partition each


def memory_overlapped_offload(spec: EngineSpec, m: MemoryInputs) -> Footprint:
    """OverlappedOffloadAdamW: fp32 master, moments and gradient scratch of every parameter (16 B) pageable; the
    landed gradient and the upload buffer in the training dtype, pinned on CUDA."""
    P = m.shape.params
    return Footprint(m.trained, m.pin(2 * m.b * P) if m.cuda else 0, 16 * P + (0 if m.cuda else 2 * m.b * P))


def memory_zero_infinity(spec: EngineSpec, m: MemoryInputs) -> Footprint:
    """fp32 parameters and gradients and the training-dtype parameters pinned; gathered layers only on the device."""
    P = m.shape.params
    pinned = m.pin(4 * P) + m.pin(4 * P) + m.pin(m.b * P)
    device = m.b * max(m.shape.matrices()) * 4 + m.b * P // 8 + m.acts  # (medium-low confidence)
    return Footprint(device, pinned, 8 * P, "ZeRO-3 estimate: medium-low confidence")


def memory_twin_flow(spec: EngineSpec, m: MemoryInputs) -> Footprint:
    """The host share of the optimizer state on the host; fp32 master and moments of the device sub-groups."""
    P, host = m.shape.params, spec.host_share
    device = m.trained + int((1 - host) * 12 * P)
    return Footprint(device, m.pin(int(host * 8 * P)), int(host * 8 * P), "ZeRO-3 estimate: medium-low confidence")


def memory_fsdp2(spec: EngineSpec, m: MemoryInputs) -> Footprint:
    """fp32 parameters and gradients per tensor pinned, AdamW's moments; on the device a few gathered layers."""
    return Footprint(4 * max(m.shape.matrices()) * 4 + m.acts, 2 * m.fp32_each / m.world, 8 * m.shape.params / m.world)


def memory_torchao(spec: EngineSpec, m: MemoryInputs) -> Footprint:
    """As FSDP2 on the host; on the device fp32 parameters and gradients and the autocast copies."""
    s = m.shape
    return Footprint(4 * s.all_params + 4 * s.params + m.acts + m.b * s.params, 2 * m.fp32_each, 8 * s.params)


def memory_megatron_hybrid(spec: EngineSpec, m: MemoryInputs) -> Footprint:
    """HybridDeviceOptimizer at offload_fraction f (host_share): fp32 master and moments of the device share on the
    device; of the host share an fp32 copy and fp32 gradient pinned, the moments pageable."""
    P, f = m.shape.params, spec.host_share
    host_fp32 = m.pin(int(4 * f * P)) if f else 0
    return Footprint(m.trained + 12 * (1 - f) * P, 2 * host_fp32, 8 * f * P,
                     "Megatron-core estimate: medium confidence")


def memory_device_8bit(spec: EngineSpec, m: MemoryInputs) -> Footprint:
    """Two 8-bit moments per parameter, a 4-byte scale per block of 256 each, on the device (no fp32 master)."""
    P = m.shape.params
    return Footprint(m.trained + 2 * P + 2 * 4 * P // 256, 0, 0)


def memory_device_adamw(spec: EngineSpec, m: MemoryInputs) -> Footprint:
    """torch AdamW's moments in the training dtype (no fp32 master)."""
    return Footprint(m.trained + 2 * m.b * m.shape.params, 0, 0)


def memory_device_fp32(spec: EngineSpec, m: MemoryInputs) -> Footprint:
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


# ---- the spec -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineSpec:
    """One engine. `zero(cuda, nvme_path)`: its zero_optimization block; `zenflow_block`: ASKED (the run's block),
    a fixed block, or None; `cycle_rule`: CYCLE_RULES; `stall_baseline`: the engine of its family its stall
    reduction is measured against; `control`: its same-update-frequency control (gradient accumulation U);
    `memory(spec, inputs)`: its Footprint; `host_share`: the share of the optimizer's state and work on the host
    where no ZenFlow block sets it (the memory plan's step time); `repair_weight_view`: DeepSpeed's ZenFlow with
    stage 1/2's weight view restored (ds_divergences.py; the run's `protocol.ds_weight_view` says what it did);
    `opt_in`: run only when named (`--engines`), never in a default engine list (configs.DEFAULT_ENGINES), so
    that adding the row changes no committed result set."""

    name: str
    engine_class: type[Engine]
    family: str
    group: str
    zero: Callable[[bool, str | None], dict[str, Any]] = zero_offload
    zenflow_block: dict[str, Any] | str | None = None
    cycle_rule: str = "step"
    stall_baseline: str | None = None
    control: str | None = None
    memory: Callable[[EngineSpec, MemoryInputs], Footprint] = memory_on_device
    host_share: float = 1.0
    repair_weight_view: bool = False
    opt_in: bool = False

    def __post_init__(self) -> None:
        for field, value, allowed in (("family", self.family, FAMILIES), ("group", self.group, GROUPS),
                                      ("cycle_rule", self.cycle_rule, CYCLE_RULES)):
            if value not in allowed:
                raise ValueError(f"{self.name}: {field} = {value!r} is not allowed: expected one of {allowed}")
        if self.repair_weight_view and self.family != "deepspeed":
            raise ValueError(f"{self.name}: repair_weight_view = True is not allowed for family {self.family!r}: "
                             "expected family 'deepspeed'")

    @property
    def stall_includes_io(self) -> bool:
        """Its step cannot be split into copies and host work from outside: the run books it as stall incl. I/O."""
        return self.engine_class.stall_includes_io

    def own_block(self, asked: dict[str, Any]) -> dict[str, Any] | None:
        """The ZenFlow block it runs with, given the run's (`asked`): a copy, never the caller's dict."""
        if self.zenflow_block == ASKED:
            return copy.deepcopy(asked)
        return dict(self.zenflow_block) if isinstance(self.zenflow_block, dict) else None

    def zero_optimization(self, asked: dict[str, Any], cuda: bool, nvme_path: str | None) -> dict[str, Any]:
        zero = self.zero(cuda, nvme_path)
        block = self.own_block(asked)
        return zero if block is None else {**zero, "zenflow": block}

    def accumulation(self, asked: dict[str, Any]) -> int:
        """Gradient accumulation steps: the run's update interval U for the -gas controls ("auto": 1), else 1."""
        interval = asked.get("update_interval", 1)
        return interval if self.cycle_rule == "accumulation" and isinstance(interval, int) else 1

    def cycle(self, ds_config: dict[str, Any]) -> int:
        """Steps per update cycle: the ZenFlow update interval U (an "auto" U has no fixed cycle), else the
        gradient accumulation (the -gas controls: U; every other engine: 1)."""
        if self.cycle_rule == "interval":
            interval = (ds_config["zero_optimization"].get("zenflow") or {}).get("update_interval", 1)
            if isinstance(interval, int):
                return interval
        return ds_config.get("gradient_accumulation_steps", 1)

    def unavailable(self, device: str) -> str | None:
        """Why it cannot run here on `device` ("cpu", "cuda[:N]", "auto"), or None."""
        cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
        return self.engine_class.unavailable(self.name, cuda)


# ---- the rows, in table order -------------------------------------------------------------------------------------
ROWS = (
    EngineSpec("ds-zero-offload", DeepSpeedEngine, "deepspeed", "core", memory=memory_deepspeed_offload),
    EngineSpec("ds-zero-offload-gas", DeepSpeedEngine, "deepspeed", "control", cycle_rule="accumulation",
               memory=memory_deepspeed_offload),
    EngineSpec("ds-zenflow", DeepSpeedEngine, "deepspeed", "core", zenflow_block=ASKED, cycle_rule="interval",
               stall_baseline="ds-zero-offload", control="ds-zero-offload-gas", memory=memory_deepspeed_offload),
    # DeepSpeed's ZenFlow as its authors intended: the same DeepSpeed, stage 1/2's weight view as 0.17.5-0.19.6 have
    # it (PR #8277 broke it in 0.19.7). Opt-in: the committed scenario tables were made without it.
    EngineSpec("ds-zenflow-intended", DeepSpeedEngine, "deepspeed", "extra", zenflow_block=ASKED,
               cycle_rule="interval", stall_baseline="ds-zero-offload", control="ds-zero-offload-gas",
               memory=memory_deepspeed_offload, repair_weight_view=True, opt_in=True),
    EngineSpec("ds-zero-infinity", DeepSpeedEngine, "deepspeed", "peer", zero=zero_infinity,
               memory=memory_zero_infinity),
    EngineSpec("ds-twin-flow", DeepSpeedEngine, "deepspeed", "peer", zero=twin_flow, memory=memory_twin_flow,
               host_share=TWIN_FLOW_RATIO),
    EngineSpec("ref-offload", TorchEngine, "ours", "core", zenflow_block=OFFLOAD_BLOCK, memory=memory_ours),
    EngineSpec("ref-offload-gas", TorchEngine, "ours", "control", zenflow_block=OFFLOAD_BLOCK,
               cycle_rule="accumulation", memory=memory_ours),
    EngineSpec("ref-zenflow", TorchEngine, "ours", "core", zenflow_block=ASKED, cycle_rule="interval",
               stall_baseline="ref-offload", control="ref-offload-gas", memory=memory_ours),
    EngineSpec("ref-zenflow-da", DeviceAccumulationEngine, "ours", "beyond", zenflow_block=ASKED, cycle_rule="interval",
               stall_baseline="ref-offload", control="ref-offload-gas", memory=memory_ours),
    # ZenFlowAdamW over FSDP2's row shards (issue 35): opt-in, the committed scenario tables were made without it
    EngineSpec("ref-zenflow-fsdp2", ShardedZenFlowEngine, "ours", "extra", zenflow_block=ASKED, cycle_rule="interval",
               stall_baseline="ref-offload", control="ref-offload-gas", memory=memory_ours_fsdp2, opt_in=True),
    EngineSpec("ref-offload-overlap", OverlappedOffloadEngine, "ours", "peer", zero=not_deepspeed,
               memory=memory_overlapped_offload),
    EngineSpec("fsdp2-offload", FSDP2Engine, "pytorch", "peer", zero=not_deepspeed, memory=memory_fsdp2),
    EngineSpec("torchao-offload", TorchAOEngine, "pytorch", "peer", zero=not_deepspeed, memory=memory_torchao),
    *(EngineSpec(f"megatron-hybrid-{f}", megatron_hybrid(f), "other", "peer", zero=not_deepspeed,
                 memory=memory_megatron_hybrid, host_share=f) for f in OFFLOAD_FRACTIONS),
    EngineSpec("torchao-adamw8bit", TorchAOAdamW8bitEngine, "other", "peer", zero=not_deepspeed,
               memory=memory_device_8bit, host_share=0.0),
    EngineSpec("bnb-adamw8bit", BitsAndBytesAdamW8bitEngine, "other", "peer", zero=not_deepspeed,
               memory=memory_device_8bit, host_share=0.0),
    EngineSpec("no-offload", NoOffloadEngine, "bound", "core", memory=memory_device_adamw, host_share=0.0),
    EngineSpec("no-offload-fp32", TorchEngine, "bound", "extra", zenflow_block=DEVICE_FP32_BLOCK,
               memory=memory_device_fp32, host_share=0.0),
)
ENGINE_SPECS: dict[str, EngineSpec] = {spec.name: spec for spec in ROWS}  # the registry (tests add rows to it)


def engine_names(group: str | None = None, opt_in: bool = True) -> tuple[str, ...]:
    """Every engine's name (of `group`; the opt-in rows too unless `opt_in` is False), in table order."""
    return tuple(name for name, spec in ENGINE_SPECS.items()
                 if (group is None or spec.group == group) and (opt_in or not spec.opt_in))


def engine_spec(name: str) -> EngineSpec:
    """The row of engine `name`; any other name is refused, naming the engines."""
    if name not in ENGINE_SPECS:
        raise ValueError(f"engine = {name!r} is not allowed: expected one of {engine_names()}")
    return ENGINE_SPECS[name]


def is_deepspeed(name: str) -> bool:
    """A DeepSpeed engine: it needs the package, starts through DeepSpeed's launcher and builds DeepSpeed's ops."""
    spec = ENGINE_SPECS.get(name)
    return spec is not None and spec.family == "deepspeed"


def unavailable(engine: str, device: str) -> str | None:
    """Why `engine` cannot run here on `device` ("cpu", "cuda", "auto"), or None (also for a name not registered:
    its run fails with the reason). Checked in the parent, before the run's process starts."""
    spec = ENGINE_SPECS.get(engine)
    return spec.unavailable(device) if spec else None


def zenflow_engines() -> list[EngineSpec]:
    """The ZenFlow engines (each measured against its stall baseline and control), ours first."""
    return sorted((s for s in ENGINE_SPECS.values() if s.stall_baseline), key=lambda s: s.family != "ours")


def resolve_sub_groups(ds_config: dict[str, Any], numel: int) -> dict[str, Any]:
    """sub_group_size "auto" (ds-twin-flow): a model of `numel` parameters in TWIN_FLOW_SUB_GROUPS groups, so that
    offload_optimizer.ratio has groups to split. The engine's config (and so the run record) holds the number."""
    zero = ds_config.get("zero_optimization", {})
    if zero.get("sub_group_size") != "auto":
        return ds_config
    return {**ds_config, "zero_optimization": {**zero, "sub_group_size": -(-numel // TWIN_FLOW_SUB_GROUPS)}}


def needs_async_io(engines: list[str], nvme_path: str | None) -> bool:
    """Does any of `engines` offload to NVMe at `nvme_path` (DeepSpeed's async_io op, which needs libaio)?"""
    blocks = [engine_spec(e).zero(False, nvme_path) for e in engines]
    return any(isinstance(v, dict) and v.get("device") == "nvme" for zero in blocks for v in zero.values())
