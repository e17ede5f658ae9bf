"""Engines: one small interface over the five ways to train (DESIGN §3).

| engine            | optimizer                                                                 |
|-------------------|---------------------------------------------------------------------------|
| no-offload        | torch.optim.AdamW (fused) on the model's own params: the bound when it fits |
| no-offload-fp32   | ZenFlowAdamW with topk_ratio=1: AdamW on the device from an fp32 master (the comparable bound) |
| ref-offload       | ZenFlowAdamW with topk_ratio=0, update_interval=1, sync (our ZeRO-Offload) |
| ref-zenflow       | ZenFlowAdamW with the given zenflow block                                  |
| ds-zero-offload   | DeepSpeed ZeRO stage 2, offload_optimizer: cpu                             |
| ds-zenflow        | the same + the zenflow block                                               |
| ds-zero-offload-gas | ds-zero-offload with gradient_accumulation_steps = the update interval U  |
| ref-offload-gas   | ref-offload with gradient accumulation U: every parameter every U steps    |
| ds-zero-infinity  | DeepSpeed ZeRO stage 3, offload_param and offload_optimizer: cpu (or nvme) |
| ds-twin-flow      | DeepSpeed ZeRO stage 3, offload_optimizer: cpu with ratio (Twin-Flow)      |
| fsdp2-offload     | torch FSDP2 (fully_shard) with CPUOffloadPolicy, torch AdamW on the host (peer_engines.py) |
| torchao-offload   | torchao CPUOffloadOptimizer around torch AdamW (CUDA only) (peer_engines.py) |

Every engine gets the same DeepSpeed-style config dict (optimizer params, clipping, dtype, zenflow block), so the
reference engines read exactly what DeepSpeed reads.
"""

from __future__ import annotations

import copy
import os
import socket
import sys
from collections.abc import Iterable
from typing import Any

import torch

from zenflow import ZenFlowAdamW
from zenflow.harness.configs import DEVICE_FP32_BLOCK, ENGINES, OFFLOAD_BLOCK, TWIN_FLOW_RATIO, TWIN_FLOW_SUB_GROUPS
from zenflow.telemetry.timeline import StepTimeline


def deepspeed_config(engine: str, zenflow_block: dict[str, Any], dtype: str, micro_batch: int, lr: float,
                     weight_decay: float, clipping: float, cuda: bool, nvme_path: str | None = None) -> dict[str, Any]:
    """The DeepSpeed JSON every engine is built from (DeepSpeedExamples' ZenFlow fine-tuning settings); the peers
    that are not DeepSpeed read its optimizer, clipping and dtype. `nvme_path`: ZeRO-Infinity offloads to NVMe."""
    if engine not in ENGINES:
        raise ValueError(f"engine = {engine!r} is not allowed: expected one of {ENGINES}")
    zero: dict[str, Any] = {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": cuda}}
    if engine == "ds-zero-infinity":
        where = {"device": "nvme", "nvme_path": nvme_path} if nvme_path else {"device": "cpu"}
        zero = {"stage": 3, "offload_optimizer": {**where, "pin_memory": cuda},
                "offload_param": {**where, "pin_memory": cuda}}
    elif engine == "ds-twin-flow":  # sub_group_size: "auto" is resolved by the engine (DeepSpeedEngine)
        zero = {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": cuda, "ratio": TWIN_FLOW_RATIO},
                "sub_group_size": "auto"}
    elif engine in ("fsdp2-offload", "torchao-offload"):
        zero = {"stage": 0}  # not DeepSpeed: only the optimizer, clipping and dtype below are read
    interval = zenflow_block.get("update_interval", 1)
    interval = interval if isinstance(interval, int) else 1  # "auto": no fixed frequency to match
    if engine in ("ds-zenflow", "ref-zenflow"):
        zero["zenflow"] = copy.deepcopy(zenflow_block)
    elif engine in ("ref-offload", "ref-offload-gas"):  # -gas: the gradient accumulation below, then one step
        zero["zenflow"] = dict(OFFLOAD_BLOCK)
    elif engine == "no-offload-fp32":
        zero["zenflow"] = dict(DEVICE_FP32_BLOCK)
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": interval if engine.endswith("-gas") else 1,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8,
                                                  "weight_decay": weight_decay}},
        "gradient_clipping": clipping,
        "bf16": {"enabled": dtype == "bf16"},
        "fp16": {"enabled": dtype == "fp16"},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


class Engine:
    """The work of one training step, in two parts the run loop (session.py) times from outside:
    `forward_backward(batch) -> loss` (a device tensor: reading it is the step's sync point) and
    `optimizer_step() -> kind` ("warmup", "accumulate" or "update": what this step did to the host part)."""

    name: str
    weights_changed_at_init: list[str]  # set by make_engine
    stall_includes_io = False  # DeepSpeed's step cannot be split into copies and CPU Adam from outside

    def __init__(self, name: str, model: torch.nn.Module, ds_config: dict[str, Any], timeline: StepTimeline,
                 telemetry: bool = True, repair_weight_view: bool = False, device: str = "auto") -> None:
        self.name, self.model, self.ds_config, self.timeline = name, model, ds_config, timeline
        self.telemetry, self.repair_weight_view = telemetry, repair_weight_view
        self.device = resolve_device(device)

    def forward_backward(self, batch: torch.Tensor | dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def optimizer_step(self) -> str:
        raise NotImplementedError

    def weight_fingerprints(self) -> dict[str, torch.Tensor]:
        """What make_engine compares with the model it was given (engines that shard parameters gather them)."""
        return _weight_fingerprints(self.model)

    def transfer_bytes(self) -> dict[str, int] | None:
        return None  # not measured by the engine itself

    def host_state_bytes(self) -> int | None:
        return None  # not measured by the engine itself

    def close(self) -> None:
        pass


class TorchEngine(Engine):
    """no-offload(-fp32), ref-offload(-gas), ref-zenflow: a plain torch loop (gradient accumulation: -gas)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.accumulation = self.ds_config.get("gradient_accumulation_steps", 1)  # micro-steps per optimizer step
        self.micro_steps = 0
        ranks = _join_ranks(self.device)  # under torchrun: this rank's device; the process group is up
        self.device = ranks or self.device
        self.model.to(self.device)  # the spec's device, not whatever is available (audit items 7, 26)
        params = self.ds_config["optimizer"]["params"]
        self.clipping = self.ds_config["gradient_clipping"]
        if self.name == "no-offload":
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=params["lr"], betas=params["betas"],
                                               eps=params["eps"], weight_decay=params["weight_decay"], fused=True)
            if ranks:  # the no-offload baseline is plain data parallelism
                self.model = torch.nn.parallel.DistributedDataParallel(self.model)
        else:  # ZenFlowAdamW does its own data parallelism over the default group (docs/distributed.md)
            self.optimizer = ZenFlowAdamW.from_deepspeed_config(self.model.parameters(), self.ds_config)
            if self.telemetry:
                self.optimizer.add_observer(self.timeline)

    def forward_backward(self, batch: torch.Tensor | dict[str, torch.Tensor]) -> torch.Tensor:
        loss = self.model(**_model_inputs(batch, self.device)).loss
        (loss / self.accumulation if self.accumulation > 1 else loss).backward()  # the mean over the micro-steps
        return loss

    def optimizer_step(self) -> str:
        self.micro_steps += 1
        if self.micro_steps % self.accumulation:
            return "accumulate"  # gradients accumulate on the device, as DeepSpeed's gradient accumulation
        updates = getattr(self.optimizer, "host_updates", None)
        if self.name == "no-offload" and self.clipping > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clipping)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if not isinstance(self.optimizer, ZenFlowAdamW):
            return "update"
        if self.optimizer.t <= self.optimizer.config.full_warm_up_rounds:
            return "warmup"
        return "update" if self.optimizer.host_updates > updates else "accumulate"

    def transfer_bytes(self) -> dict[str, int] | None:
        if not isinstance(self.optimizer, ZenFlowAdamW):
            return None
        return {f"{d}_{k}": n for (d, k), n in self.optimizer.transfer_bytes.items()}

    def host_state_bytes(self) -> int | None:
        return self.optimizer.host_state_bytes if isinstance(self.optimizer, ZenFlowAdamW) else None

    def close(self) -> None:
        if isinstance(self.optimizer, ZenFlowAdamW):
            self.optimizer.close()  # (the process group stays: a rank child exits without teardown, runner.py)


class DeepSpeedEngine(Engine):
    """ds-zero-offload, ds-zenflow: real `deepspeed.initialize` (CPU accelerator + gloo here, CUDA on a GPU)."""

    stall_includes_io = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.device.type == "cpu":  # DeepSpeed picks CUDA whenever it can; a cpu workload must stay on the CPU
            _pin_deepspeed_to_cpu()
        import deepspeed

        _single_process_env()
        if self.repair_weight_view:
            from zenflow.harness.ds_divergences import repair_zenflow_weight_view

            repair_zenflow_weight_view()  # opt-in diagnosis of divergence G, recorded in the run's protocol
        if not torch.distributed.is_initialized():
            deepspeed.init_distributed(dist_backend="nccl" if self.device.type == "cuda" else "gloo")
        self.ds_config = _resolve_sub_groups(self.ds_config, self.model)
        self.engine, *_ = deepspeed.initialize(model=self.model, model_parameters=self.model.parameters(),
                                               config=self.ds_config)
        self.device = self.engine.device  # this rank's device (the launcher's LOCAL_RANK under multi-GPU)
        zero = self.ds_config["zero_optimization"]
        block = zero.get("zenflow") or {}
        self.interval = block.get("update_interval", 1) if isinstance(block.get("update_interval", 1), int) else 1
        self.interval = max(self.interval, self.ds_config.get("gradient_accumulation_steps", 1))  # -gas: U
        self.warm_up = block.get("full_warm_up_rounds", 0)
        self.steps = 0

    def forward_backward(self, batch: torch.Tensor | dict[str, torch.Tensor]) -> torch.Tensor:
        loss = self.engine(**_model_inputs(batch, self.engine.device)).loss
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
        return "update" if self.interval == 1 or since % self.interval == self.interval - 1 else "accumulate"

    def weight_fingerprints(self) -> dict[str, torch.Tensor]:
        """ZeRO-3 holds each parameter as a partition (the module's tensor is empty): gather them to compare."""
        if self.ds_config["zero_optimization"].get("stage") != 3:
            return _weight_fingerprints(self.model)
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(self.model.parameters())):
            return _weight_fingerprints(self.model)

    def close(self) -> None:
        self.engine.destroy() if hasattr(self.engine, "destroy") else None


def _resolve_sub_groups(ds_config: dict[str, Any], model: torch.nn.Module) -> dict[str, Any]:
    """sub_group_size "auto" (ds-twin-flow): the model's parameters in TWIN_FLOW_SUB_GROUPS groups, so that
    offload_optimizer.ratio has groups to split. The engine's config (and so the run record) holds the number."""
    zero = ds_config["zero_optimization"]
    if zero.get("sub_group_size") != "auto":
        return ds_config
    numel = sum(p.numel() for p in model.parameters())
    return {**ds_config, "zero_optimization": {**zero, "sub_group_size": -(-numel // TWIN_FLOW_SUB_GROUPS)}}


def make_engine(name: str, model: torch.nn.Module, ds_config: dict[str, Any], timeline: StepTimeline,
                telemetry: bool = True, repair_weight_view: bool = False, device: str = "auto") -> Engine:
    """Build the engine on `device` ("auto": CUDA when available, else the CPU; "cpu"; "cuda[:N]"; see
    resolve_device) (`repair_weight_view`: DeepSpeed engines only, see ds_divergences.py), and record in
    `engine.weights_changed_at_init` the parameters whose values its construction changed (beyond the cast to the
    training dtype). It should be empty: a non-empty list means the model trains from other weights than the ones
    it was given (DeepSpeed 0.19.8 ZenFlow stage 1/2: divergence G)."""
    from zenflow.harness.peer_engines import PEERS

    kind = DeepSpeedEngine if name.startswith("ds-") else PEERS.get(name, TorchEngine)
    before = _weight_fingerprints(model)
    if repair_weight_view and kind is not DeepSpeedEngine:
        raise ValueError(f"repair_weight_view applies to DeepSpeed engines only, not {name!r}")
    engine = kind(name, model, ds_config, timeline, telemetry, repair_weight_view, device)
    after = engine.weight_fingerprints()
    engine.weights_changed_at_init = [n for n, v in before.items()
                                      if n in after and not torch.equal(v.to(after[n].dtype), after[n])]
    return engine


def init_warnings(engine: Engine) -> list[str]:
    changed = engine.weights_changed_at_init
    if not changed:
        return []
    return [f"{engine.name}: building the engine changed the values of {len(changed)} parameters (e.g. "
            f"{', '.join(changed[:3])}): the model trains from other weights than it was given"]


def _weight_fingerprints(model: torch.nn.Module, samples: int = 1024) -> dict[str, torch.Tensor]:
    """About `samples` evenly strided elements of every parameter, copied to the host (cheap even for 7B)."""
    return fingerprints(model.named_parameters(), samples)


def fingerprints(named: Iterable[tuple[str, torch.Tensor]], samples: int = 1024) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in named:
        flat = p.detach().reshape(-1)
        out[name] = flat[:: max(1, flat.numel() // samples)].to("cpu", copy=True)
    return out


def _model_inputs(batch: torch.Tensor | dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """A tensor of token ids is a causal-LM batch (labels = inputs); a dict (input_ids, attention_mask, labels,
    ...) goes to the model as it is (sequence classification)."""
    if isinstance(batch, dict):
        return {k: v.to(device) for k, v in batch.items()}
    batch = batch.to(device)
    return {"input_ids": batch, "labels": batch}


def resolve_device(device: str) -> torch.device:
    """The workload's device: "auto" is CUDA when available, else the CPU; "cpu" forces the CPU (the cpu-scale
    workload of bench and the golden curve, so they mean the same on a GPU host); "cuda[:N]" must be usable."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"device = {device!r} is not allowed: expected 'auto', 'cpu' or 'cuda[:N]'") from exc
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device = {device!r} is not allowed: expected 'auto', 'cpu' or 'cuda[:N]'")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device = {device!r} but torch.cuda.is_available() is False (torch {torch.__version__}, "
                         f"built for CUDA {torch.version.cuda})")
    return resolved


def _pin_deepspeed_to_cpu() -> None:
    """DS_ACCELERATOR=cpu before DeepSpeed first resolves its accelerator (it caches the choice per process; the
    harness also sets it in the child's environment, since capturing the environment resolves it first)."""
    ds_accel = sys.modules.get("deepspeed.accelerator.real_accelerator")
    chosen = getattr(ds_accel, "ds_accelerator", None) if ds_accel else None
    if chosen is not None and chosen.device_name() != "cpu":
        raise RuntimeError(f"device = 'cpu' but DeepSpeed already chose the {chosen.device_name()!r} accelerator "
                           "in this process; run the cpu workload in a fresh process (the harness does)")
    os.environ["DS_ACCELERATOR"] = "cpu"


def _join_ranks(device: torch.device, single: bool = False) -> torch.device | None:
    """Under torchrun (WORLD_SIZE > 1): start the default process group (nccl on GPUs, gloo on the CPU) and return
    this rank's device; None for a single process, unless `single` (FSDP2 needs a group of one): then that group on
    a loopback rendezvous, and `device` as given."""
    alone = int(os.environ.get("WORLD_SIZE", "1")) == 1
    if alone and not single:
        return None
    if alone:
        _single_process_env()
    if device.type == "cuda":
        device = device if alone else torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


def _single_process_env() -> None:
    """torch.distributed needs a rendezvous even for one process; use a free loopback port."""
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
