"""The engine classes: the Engine interface, our torch loop (ZenFlowAdamW, or torch AdamW for the bound) and
DeepSpeed's engines. The PyTorch peers are in peers.py; which engine runs which class, with which config and
update cycle, is its row in registry.py, and build.py builds it (make_engine).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterable
from typing import Any

import torch

from zenflow import ZenFlowAdamW
from zenflow.harness.engines.ds_divergences import repair_zenflow_weight_view, weight_view_record
from zenflow.harness.engines.ds_placement import place_deepspeed
from zenflow.harness.engines.process import join_ranks, pin_deepspeed_to_cpu, resolve_device, single_process_env
from zenflow.harness.placement import PhaseSwitch
from zenflow.overlapped_offload import OverlappedOffloadAdamW
from zenflow.telemetry.timeline import StepTimeline


class Engine:
    """The work of one training step, in two parts the run loop (session.py) times from outside:
    `forward_backward(batch) -> loss` (a device tensor: reading it is the step's sync point) and
    `optimizer_step() -> kind` ("warmup", "accumulate" or "update": what this step did to the host part)."""

    name: str
    weights_changed_at_init: list[str]  # set by make_engine
    weight_view: dict[str, Any] | None = None  # DeepSpeed's ZenFlow weight-view repair, when asked: what it did
    stall_includes_io = False  # DeepSpeed's step cannot be split into copies and CPU Adam from outside
    # how a split placement reaches its phases (harness/placement.py): "observers", "device", "deepspeed", or None
    # (it cannot be placed: its host work is not visible from outside)
    placed_by: str | None = None

    def __init__(self, name: str, model: torch.nn.Module, ds_config: dict[str, Any], timeline: StepTimeline,
                 telemetry: bool = True, repair_weight_view: bool = False, device: str = "auto",
                 cycle: int = 1) -> None:
        self.name, self.model, self.ds_config, self.timeline = name, model, ds_config, timeline
        self.telemetry, self.repair_weight_view = telemetry, repair_weight_view
        self.device = resolve_device(device)
        self.cycle = cycle  # steps per update cycle: the engine's registry row's rule (EngineSpec.cycle)

    @classmethod
    def unavailable(cls, name: str, cuda: bool) -> str | None:
        """Why this class cannot run engine `name` here (`cuda`: the run's device is a GPU), or None. Checked in the
        parent, before the run's process starts, from what is installed and what the device is."""
        return None

    def forward_backward(self, batch: torch.Tensor | dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def optimizer_step(self) -> str:
        raise NotImplementedError

    def weight_fingerprints(self) -> dict[str, torch.Tensor]:
        """What make_engine compares with the model it was given (engines that shard parameters gather them)."""
        return weight_fingerprints(self.model)

    def transfer_bytes(self) -> dict[str, int] | None:
        return None  # not measured by the engine itself

    def host_state_bytes(self) -> int | None:
        return None  # not measured by the engine itself

    def zenflow_facts(self) -> dict[str, Any] | None:
        """A ZenFlow engine's resolved select_interval and update_interval, and how many selections and host updates
        it made (DeepSpeed's default never re-selects, DeepSpeed PR #8456); None for the others."""
        return None

    def attach_placement(self, switch: PhaseSwitch) -> list[str]:
        """Let a placement's observer see this engine's host phases (harness/placement.py); the record's notes on
        where what runs. The base: no host phase to see (placed_by "device")."""
        return []

    def close(self) -> None:
        pass


class TorchEngine(Engine):
    """A torch optimizer in a plain torch loop (gradient accumulation: the -gas controls). A subclass says which
    optimizer (`build_optimizer`) and how it clips (`clip`): ours (ObservedEngine, ZenFlowEngine), torch AdamW
    (NoOffloadEngine), another project's (optimizer_peers.py)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.accumulation = self.ds_config.get("gradient_accumulation_steps", 1)  # micro-steps per optimizer step
        self.micro_steps = 0
        ranks = join_ranks(self.device)  # under torchrun: this rank's device; the process group is up
        self.device = ranks or self.device
        self.model.to(self.device)  # the spec's device, not whatever is available
        self.clipping = self.ds_config["gradient_clipping"]
        self.optimizer = self.build_optimizer(distributed=ranks is not None)

    def build_optimizer(self, distributed: bool) -> Any:
        raise NotImplementedError

    def clip(self) -> None:
        pass  # the optimizer clips inside its step (ours)

    def forward_backward(self, batch: torch.Tensor | dict[str, torch.Tensor]) -> torch.Tensor:
        loss = self.model(**model_inputs(batch, self.device)).loss
        (loss / self.accumulation if self.accumulation > 1 else loss).backward()  # the mean over the micro-steps
        return loss

    def optimizer_step(self) -> str:
        self.micro_steps += 1
        if self.micro_steps % self.accumulation:
            return "accumulate"  # gradients accumulate on the device, as DeepSpeed's gradient accumulation
        self.clip()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return "update"


class ObservedEngine(TorchEngine):
    """One of our optimizers (hooks.Observed: ZenFlowAdamW, OverlappedOffloadAdamW): the timeline sees its copies
    and waits, it counts its own bytes and host state, and it has a host worker to stop."""

    optimizer: Any  # an Observed optimizer
    placed_by = "observers"  # every host phase is a blocking section the placement's observer sees

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.telemetry:
            self.optimizer.add_observer(self.timeline)

    def attach_placement(self, switch: PhaseSwitch) -> list[str]:
        self.optimizer.add_observer(switch)  # after the timeline: a block's move is booked inside the block
        return []

    def transfer_bytes(self) -> dict[str, int] | None:
        return {f"{d}_{k}": n for (d, k), n in self.optimizer.transfer_bytes.items()}

    def host_state_bytes(self) -> int | None:
        return self.optimizer.host_state_bytes

    def close(self) -> None:
        self.optimizer.close()  # stop the host worker (the process group stays: a rank child exits without teardown)


class ZenFlowEngine(ObservedEngine):
    """ref-offload(-gas), ref-zenflow, no-offload-fp32: ZenFlowAdamW in the plain torch loop, its block from the
    row; its step kind is what the optimizer did (a warm-up step, a host update, or accumulation)."""

    optimizer: ZenFlowAdamW
    accumulate_on = "host"  # where ZenFlowAdamW sums the unselected columns between boundaries (docs/library.md)

    def build_optimizer(self, distributed: bool) -> ZenFlowAdamW:
        """ZenFlowAdamW, which does its own data parallelism over the default group (docs/distributed.md)."""
        return ZenFlowAdamW.from_deepspeed_config(self.model.parameters(), self.ds_config,
                                                  accumulate_on=self.accumulate_on)

    def optimizer_step(self) -> str:
        updates = self.optimizer.host_updates
        if super().optimizer_step() == "accumulate":
            return "accumulate"
        if self.optimizer.t <= self.optimizer.config.full_warm_up_rounds:
            return "warmup"
        return "update" if self.optimizer.host_updates > updates else "accumulate"

    def zenflow_facts(self) -> dict[str, Any] | None:
        opt = self.optimizer
        if not opt.config.topk_ratio:
            return None  # our ZeRO-Offload (topk 0: nothing is ever selected)
        return {"select_interval": opt.select_interval, "update_interval": opt.config.update_interval,
                "selections": opt.selections, "host_updates": opt.host_updates, "counted_by": "ZenFlowAdamW"}


class DeviceAccumulationEngine(ZenFlowEngine):
    """ref-zenflow-da: ZenFlowAdamW summing the unselected columns' gradients on the device and shipping the sum once
    per update interval (`accumulate_on="device"`, beyond the paper); the host runs only the deferred AdamW.
    Same parameters as ref-zenflow (tests/core/test_device_accumulation.py), fewer bytes per step for U > 4/b."""

    accumulate_on = "device"


class OverlappedOffloadEngine(ObservedEngine):
    """ref-offload-overlap: ZeRO-Offload with each parameter's host AdamW started during backward, exact AdamW (no
    staleness, nothing selected): the control beside ZenFlow (zenflow/overlapped_offload.py)."""

    def build_optimizer(self, distributed: bool) -> OverlappedOffloadAdamW:
        refuse_ranks(self.name, distributed)
        return OverlappedOffloadAdamW(self.model.parameters(), **adamw_args(self.ds_config, fused=False),
                                      gradient_clipping=self.clipping)


class NoOffloadEngine(TorchEngine):
    """no-offload: torch.optim.AdamW (fused) on the model's own parameters, the bound when the model fits."""

    placed_by = "device"  # no host phase: every phase is the device's

    def build_optimizer(self, distributed: bool) -> torch.optim.Optimizer:
        optimizer = torch.optim.AdamW(self.model.parameters(), **adamw_args(self.ds_config))
        if distributed:  # the no-offload baseline is plain data parallelism
            self.model = torch.nn.parallel.DistributedDataParallel(self.model)
        return optimizer

    def clip(self) -> None:
        if self.clipping > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clipping)


class DeepSpeedEngine(Engine):
    """The ds-* engines: real `deepspeed.initialize` (CPU accelerator + gloo here, CUDA on a GPU)."""

    stall_includes_io = True
    placed_by = "deepspeed"  # its CPU Adam on the host cores (ds_placement.py)

    @classmethod
    def unavailable(cls, name: str, cuda: bool) -> str | None:
        return f"deepspeed not installed: {name} needs it" if importlib.util.find_spec("deepspeed") is None else None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.device.type == "cpu":  # DeepSpeed picks CUDA whenever it can; a cpu workload must stay on the CPU
            pin_deepspeed_to_cpu()
        import deepspeed

        single_process_env()
        if self.repair_weight_view:
            repair_zenflow_weight_view()  # divergence G: ds-zenflow-intended's row, or the GLUE diagnostic
        if not torch.distributed.is_initialized():
            deepspeed.init_distributed(dist_backend="nccl" if self.device.type == "cuda" else "gloo")
        self.engine, *_ = deepspeed.initialize(model=self.model, model_parameters=self.model.parameters(),
                                               config=self.ds_config)
        self.device = self.engine.device  # this rank's device (the launcher's LOCAL_RANK under multi-GPU)
        if self.repair_weight_view:  # what it did at initialize: the run's protocol.ds_weight_view
            self.weight_view = weight_view_record(self.engine.optimizer)
            print(f"{self.name}: {self.weight_view['note']}", file=sys.stderr)
        self.warm_up = (self.ds_config["zero_optimization"].get("zenflow") or {}).get("full_warm_up_rounds", 0)
        self.steps = 0
        self.selected_at: set[int] = set()  # ZenFlow: the optimizer's micro-steps that were selection boundaries
        self.updated_at: set[int] = set()   # ... and the engine steps that were host-update boundaries
        if self.ds_config["zero_optimization"].get("zenflow"):
            self._count_zenflow_boundaries()

    def forward_backward(self, batch: torch.Tensor | dict[str, torch.Tensor]) -> torch.Tensor:
        loss = self.engine(**model_inputs(batch, self.engine.device)).loss
        self.engine.backward(loss)
        return loss

    def optimizer_step(self) -> str:
        """DeepSpeed's step is CPU Adam + copies + waits: the run loop books it all as stall (incl. I/O), from the
        end of backward on the device to the end of the step's device work (`stall_includes_io`)."""
        self.engine.step()
        since = self.steps - self.warm_up
        self.steps += 1
        if since < 0:
            return "warmup"
        return "update" if self.cycle == 1 or since % self.cycle == self.cycle - 1 else "accumulate"

    def _count_zenflow_boundaries(self) -> None:
        """Count DeepSpeed's ZenFlow decisions from outside: wrap its boundary predicates (each is asked several times
        a step) and keep the steps at which they said yes."""
        optimizer, engine = self.engine.optimizer, self.engine
        if hasattr(optimizer, "is_zenflow_select_boundary"):
            optimizer.is_zenflow_select_boundary = _noting(optimizer.is_zenflow_select_boundary, self.selected_at,
                                                           lambda: optimizer.micro_step)
        if hasattr(engine, "_is_zenflow_update_boundary"):
            engine._is_zenflow_update_boundary = _noting(engine._is_zenflow_update_boundary, self.updated_at,
                                                         lambda: engine.global_steps)

    def attach_placement(self, switch: PhaseSwitch) -> list[str]:
        return place_deepspeed(self, switch)  # CPU Adam on the host cores, ZenFlow's process checked

    def zenflow_facts(self) -> dict[str, Any] | None:
        if not self.ds_config["zero_optimization"].get("zenflow"):
            return None
        optimizer = self.engine.optimizer
        interval = getattr(optimizer, "select_interval", None)
        return {"select_interval": interval, "update_interval": getattr(optimizer, "update_interval", None),
                "selections": len(self.selected_at), "host_updates": len(self.updated_at),
                "counted_by": "DeepSpeed's boundary predicates, wrapped",
                **({"note": "select_interval 0: DeepSpeed selects once and never again"} if interval == 0 else {})}

    def weight_fingerprints(self) -> dict[str, torch.Tensor]:
        """ZeRO-3 holds each parameter as a partition (the module's tensor is empty): gather them to compare."""
        if self.ds_config["zero_optimization"].get("stage") != 3:
            return weight_fingerprints(self.model)
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(self.model.parameters())):
            return weight_fingerprints(self.model)

    def close(self) -> None:
        if hasattr(self.engine, "destroy"):
            self.engine.destroy()


def adamw_args(ds_config: dict[str, Any], fused: bool = True) -> dict[str, Any]:
    """torch AdamW's arguments from the config's optimizer block (every engine reads the same one); `fused`: torch's
    fused kernel, which the torch-AdamW engines pass: for CPU tensors torch's default is neither foreach nor fused,
    a per-parameter loop that would make a host AdamW look far slower than it is."""
    p = ds_config["optimizer"]["params"]
    return {"lr": p["lr"], "betas": tuple(p["betas"]), "eps": p["eps"], "weight_decay": p["weight_decay"],
            **({"fused": True} if fused else {})}


def refuse_ranks(name: str, distributed: bool) -> None:
    """The engines that run in one process only say so under a launcher, before any step."""
    if distributed:
        raise ValueError(f"{name} runs in one process only (no data parallelism): run it with --nproc 1")


def _noting(predicate: Any, seen: set[int], when: Any) -> Any:
    """`predicate` unchanged, noting `when()` in `seen` each time it returns true."""
    def noted(*args: Any, **kwargs: Any) -> Any:
        answer = predicate(*args, **kwargs)
        if answer:
            seen.add(int(when()))
        return answer
    return noted


def weight_fingerprints(model: torch.nn.Module, samples: int = 1024) -> dict[str, torch.Tensor]:
    """About `samples` evenly strided elements of every parameter, copied to the host (cheap even for 7B)."""
    return fingerprints(model.named_parameters(), samples)


def fingerprints(named: Iterable[tuple[str, torch.Tensor]], samples: int = 1024) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in named:
        flat = p.detach().reshape(-1)
        out[name] = flat[:: max(1, flat.numel() // samples)].to("cpu", copy=True)
    return out


def model_inputs(batch: torch.Tensor | dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """A tensor of token ids is a causal-LM batch (labels = inputs); a dict (input_ids, attention_mask, labels,
    ...) goes to the model as it is (sequence classification)."""
    if isinstance(batch, dict):
        return {k: v.to(device) for k, v in batch.items()}
    batch = batch.to(device)
    return {"input_ids": batch, "labels": batch}
