"""The engine registry: one row (an EngineSpec) per engine, read by everything that used to test an engine's name.

A row says what the engine is (its class and family), where it stands in the experiment (its group, its place in the
tables, the engine its stall reduction is measured against, its same-update-frequency control), how its
DeepSpeed-style config is made (its ZeRO block and its ZenFlow block), what one update cycle is, why it cannot run
somewhere (its class's `unavailable`), and what it holds in memory (its memory function). Who reads what:

    configs.ENGINES, CORE_/CONTROL_/PEER_ENGINES   the names, in table order (the CLI choices; report.engine_rank)
    configs.DEFAULT_ENGINES                        opt_in (a run without --engines leaves those rows out)
    engines.deepspeed_config                       zero (zero.py), zenflow_block, cycle_rule (gradient accumulation)
    engines.make_engine                            engine_class, cycle (DeepSpeedEngine's step kinds),
                                                   repair_weight_view (ds_divergences.py)
    session.RunSpec.cycle                          cycle (timed steps in whole cycles, the summary's cycle means)
    runner, stepper, the scripts                   family "deepspeed": its launcher, its op-build lock, its package
    runner, bench                                  unavailable: a "skipped" record instead of a run
    report, glue/report                            stall_baseline, control, family
    memory_plan.estimate, scale_plan               footprint: memory (memory.py), host_share, cycle_rule
    costmodel.validate                             modelled_as (the cost model's engine for it)

Adding an engine is its class (an Engine subclass), one row in ROWS and its row in docs/peers.md's engine table;
tests/harness/engines/test_registry.py adds one and runs it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from zenflow.harness.engines import memory as mem
from zenflow.harness.engines.classes import (
    DeepSpeedEngine,
    DeviceAccumulationEngine,
    Engine,
    NoOffloadEngine,
    OverlappedOffloadEngine,
    ZenFlowEngine,
)
from zenflow.harness.engines.memory import Footprint, MemoryInputs, RowFacts
from zenflow.harness.engines.optimizer_peers import (
    OFFLOAD_FRACTIONS,
    BitsAndBytesAdamW8bitEngine,
    TorchAOAdamW8bitEngine,
    megatron_hybrid,
)
from zenflow.harness.engines.peers import FSDP2Engine, TorchAOEngine
from zenflow.harness.engines.sharded import ShardedZenFlowEngine
from zenflow.harness.engines.zero import TWIN_FLOW_RATIO, not_deepspeed, twin_flow, zero_infinity, zero_offload

# ZeRO-Offload expressed as a ZenFlow block: nothing selected, every step a synchronous host update.
OFFLOAD_BLOCK = {"topk_ratio": 0.0, "update_interval": 1, "select_interval": 1, "overlap_step": False}
# no-offload-fp32, the comparable no-offload baseline: every column selected, so AdamW runs on the device every step
# from an fp32 master and fp32 moments (torch AdamW's numbers on an fp32 copy: docs/design.md §2's topk_ratio=1 oracle),
# where no-offload is torch AdamW on the bf16 parameters themselves (small updates round away in bf16).
DEVICE_FP32_BLOCK = {"topk_ratio": 1.0, "update_interval": 1, "select_interval": 10**9, "overlap_step": False}

ASKED = "asked"  # zenflow_block of the ZenFlow engines: the run's own block (deepspeed_config's argument)
# whose system: DeepSpeed's, ZenFlowAdamW, PyTorch's, another project's optimizer in the plain loop (Megatron-core,
# torchao, bitsandbytes: optimizer_peers.py), no offload
FAMILIES = ("deepspeed", "ours", "pytorch", "other", "bound")
# configs.CORE_ENGINES, CONTROL_ENGINES, PEER_ENGINES, BEYOND_ENGINES (our variants beyond the paper, run beside the
# core engines); extra: the rest
GROUPS = ("core", "control", "peer", "beyond", "extra")
CYCLE_RULES = ("interval", "accumulation", "step")  # steps per cycle: the block's U, the gradient accumulation U, 1


# ---- the spec -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineSpec:
    """One engine. `zero(cuda, nvme_path)`: its zero_optimization block; `zenflow_block`: ASKED (the run's block),
    a fixed block, or None; `cycle_rule`: CYCLE_RULES; `stall_baseline`: the engine of its family its stall
    reduction is measured against; `control`: its same-update-frequency control (gradient accumulation U);
    `memory(inputs, row_facts)`: its Footprint (memory.py); `host_share`: the share of the optimizer's state and
    work on the host where no ZenFlow block sets it (the memory plan's step time); `repair_weight_view`: DeepSpeed's
    ZenFlow with stage 1/2's weight view restored (ds_divergences.py; the run's `protocol.ds_weight_view` says what
    it did); `opt_in`: run only when named (`--engines`), never in a default engine list (configs.DEFAULT_ENGINES),
    so that adding the row changes no committed result set; `modelled_as`: the cost model's engine that predicts
    it (costmodel/validate.py), or None."""

    name: str
    engine_class: type[Engine]
    family: str
    group: str
    zero: Callable[[bool, str | None], dict[str, Any]] = zero_offload
    zenflow_block: dict[str, Any] | str | None = None
    cycle_rule: str = "step"
    stall_baseline: str | None = None
    control: str | None = None
    memory: Callable[[MemoryInputs, RowFacts], Footprint] = mem.memory_on_device
    host_share: float = 1.0
    repair_weight_view: bool = False
    opt_in: bool = False
    modelled_as: str | None = None

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

    @property
    def row_facts(self) -> RowFacts:
        """What its memory function reads of the row; `accumulate_on` is its class's (ZenFlowEngine's)."""
        return RowFacts(self.cycle_rule, getattr(self.engine_class, "accumulate_on", "host"), self.host_share)

    def footprint(self, inputs: MemoryInputs) -> Footprint:
        """What it holds per rank (memory_plan.estimate, scale_plan)."""
        return self.memory(inputs, self.row_facts)

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

    def unavailable(self, device: str, placement: str = "shared") -> str | None:
        """Why it cannot run here on `device` ("cpu", "cuda[:N]", "auto") at `placement` (harness/placement.py),
        or None."""
        cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
        if placement == "split" and cuda:
            return "placement split is the GPU analog of a host without a GPU: on a GPU the device's work is the GPU's"
        if placement == "split" and self.engine_class.placed_by is None:
            return (f"placement split: {self.name} cannot be placed (its host work runs inside its own step, unseen "
                    "from outside), so it would share the cores")
        return self.engine_class.unavailable(self.name, cuda)


# ---- the rows, in table order -------------------------------------------------------------------------------------
ROWS = (
    EngineSpec("ds-zero-offload", DeepSpeedEngine, "deepspeed", "core", memory=mem.memory_deepspeed_offload),
    EngineSpec("ds-zero-offload-gas", DeepSpeedEngine, "deepspeed", "control", cycle_rule="accumulation",
               memory=mem.memory_deepspeed_offload),
    EngineSpec("ds-zenflow", DeepSpeedEngine, "deepspeed", "core", zenflow_block=ASKED, cycle_rule="interval",
               stall_baseline="ds-zero-offload", control="ds-zero-offload-gas", memory=mem.memory_deepspeed_offload),
    # DeepSpeed's ZenFlow as its authors intended: the same DeepSpeed, stage 1/2's weight view as 0.17.5-0.19.6 have
    # it (PR #8277 broke it in 0.19.7). Opt-in: the committed scenario tables were made without it.
    EngineSpec("ds-zenflow-intended", DeepSpeedEngine, "deepspeed", "extra", zenflow_block=ASKED,
               cycle_rule="interval", stall_baseline="ds-zero-offload", control="ds-zero-offload-gas",
               memory=mem.memory_deepspeed_offload, repair_weight_view=True, opt_in=True),
    EngineSpec("ds-zero-infinity", DeepSpeedEngine, "deepspeed", "peer", zero=zero_infinity,
               memory=mem.memory_zero_infinity),
    EngineSpec("ds-twin-flow", DeepSpeedEngine, "deepspeed", "peer", zero=twin_flow, memory=mem.memory_twin_flow,
               host_share=TWIN_FLOW_RATIO),
    EngineSpec("ref-offload", ZenFlowEngine, "ours", "core", zenflow_block=OFFLOAD_BLOCK, memory=mem.memory_ours,
               modelled_as="zero-offload"),
    EngineSpec("ref-offload-gas", ZenFlowEngine, "ours", "control", zenflow_block=OFFLOAD_BLOCK,
               cycle_rule="accumulation", memory=mem.memory_ours, modelled_as="zero-offload-gas"),
    EngineSpec("ref-zenflow", ZenFlowEngine, "ours", "core", zenflow_block=ASKED, cycle_rule="interval",
               stall_baseline="ref-offload", control="ref-offload-gas", memory=mem.memory_ours,
               modelled_as="zenflow-overlap"),
    EngineSpec("ref-zenflow-da", DeviceAccumulationEngine, "ours", "beyond", zenflow_block=ASKED, cycle_rule="interval",
               stall_baseline="ref-offload", control="ref-offload-gas", memory=mem.memory_ours,
               modelled_as="zenflow-da-overlap"),
    # ZenFlowAdamW over FSDP2's row shards: opt-in, the committed scenario tables were made without it
    EngineSpec("ref-zenflow-fsdp2", ShardedZenFlowEngine, "ours", "extra", zenflow_block=ASKED, cycle_rule="interval",
               stall_baseline="ref-offload", control="ref-offload-gas", memory=mem.memory_ours_fsdp2, opt_in=True),
    EngineSpec("ref-offload-overlap", OverlappedOffloadEngine, "ours", "peer", zero=not_deepspeed,
               memory=mem.memory_overlapped_offload),
    EngineSpec("fsdp2-offload", FSDP2Engine, "pytorch", "peer", zero=not_deepspeed, memory=mem.memory_fsdp2),
    EngineSpec("torchao-offload", TorchAOEngine, "pytorch", "peer", zero=not_deepspeed, memory=mem.memory_torchao),
    *(EngineSpec(f"megatron-hybrid-{f}", megatron_hybrid(f), "other", "peer", zero=not_deepspeed,
                 memory=mem.memory_megatron_hybrid, host_share=f) for f in OFFLOAD_FRACTIONS),
    EngineSpec("torchao-adamw8bit", TorchAOAdamW8bitEngine, "other", "peer", zero=not_deepspeed,
               memory=mem.memory_device_8bit, host_share=0.0),
    EngineSpec("bnb-adamw8bit", BitsAndBytesAdamW8bitEngine, "other", "peer", zero=not_deepspeed,
               memory=mem.memory_device_8bit, host_share=0.0),
    EngineSpec("no-offload", NoOffloadEngine, "bound", "core", memory=mem.memory_device_adamw, host_share=0.0,
               modelled_as="no-offload"),
    EngineSpec("no-offload-fp32", ZenFlowEngine, "bound", "extra", zenflow_block=DEVICE_FP32_BLOCK,
               memory=mem.memory_device_fp32, host_share=0.0),
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


def unavailable(engine: str, device: str, placement: str = "shared") -> str | None:
    """Why `engine` cannot run here on `device` ("cpu", "cuda", "auto") at `placement`, or None (also for a name not
    registered: its run fails with the reason). Checked in the parent, before the run's process starts."""
    spec = ENGINE_SPECS.get(engine)
    return spec.unavailable(device, placement) if spec else None


def zenflow_engines() -> list[EngineSpec]:
    """The ZenFlow engines (each measured against its stall baseline and control), ours first."""
    return sorted((s for s in ENGINE_SPECS.values() if s.stall_baseline), key=lambda s: s.family != "ours")


def needs_async_io(engines: list[str], nvme_path: str | None) -> bool:
    """Does any of `engines` offload to NVMe at `nvme_path` (DeepSpeed's async_io op, which needs libaio)?"""
    blocks = [engine_spec(e).zero(False, nvme_path) for e in engines]
    return any(isinstance(v, dict) and v.get("device") == "nvme" for zero in blocks for v in zero.values())
