"""The PyTorch-native peers a user would pick instead of ZenFlow, behind the same Engine interface.

| engine          | what                                                                                        |
|-----------------|---------------------------------------------------------------------------------------------|
| fsdp2-offload   | `fully_shard` per decoder layer and at the root, `CPUOffloadPolicy`: parameters, gradients and |
|                 | torch AdamW (fused) on the host, each layer's parameters copied to the device for fwd/bwd      |
| torchao-offload | torchao's `CPUOffloadOptimizer` around torch AdamW (fused): the optimizer and fp32 state on the |
|                 | host                                                                                        |

Both keep fp32 master weights as DeepSpeed does (the model is cast to fp32 and trains in the workload's dtype:
FSDP2's MixedPrecisionPolicy, autocast for torchao), so the four offload systems update the same numbers. Neither
can be split into copies and host work from outside, so, like DeepSpeed's, their step is booked as stall including
I/O. Each class's `unavailable()` says why it cannot run in this environment (registry.unavailable asks it); the run
is then a "skipped" record that the table lists as "not run here" with that reason.
"""

from __future__ import annotations

import contextlib
import importlib.util
from typing import Any

import torch

from zenflow.harness.engines.classes import Engine, adamw_args, fingerprints, model_inputs
from zenflow.harness.engines.process import join_ranks

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class HostAdamWEngine(Engine):
    """What the two peers share: AdamW on the host, stepped (after clipping) as one opaque call."""

    stall_includes_io = True
    optimizer: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.clipping = self.ds_config["gradient_clipping"]

    def optimizer_step(self) -> str:
        if self.clipping > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clipping)
        self.optimizer.step()
        self.optimizer.zero_grad()  # set_to_none (both optimizers' default)
        return "update"


class FSDP2Engine(HostAdamWEngine):
    """fsdp2-offload: torch's own ZeRO-3 with the parameters, gradients and AdamW on the host."""

    @classmethod
    def unavailable(cls, name: str, cuda: bool) -> str | None:
        return fsdp2_missing("CPUOffloadPolicy", "fully_shard")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        self.device = join_ranks(self.device, single=True)  # this rank's device; a process group even for one
        mesh = init_device_mesh(self.device.type, (torch.distributed.get_world_size(),))
        dtype = DTYPES[_dtype(self.ds_config)]
        self.model.float().to(self.device)  # fp32 master weights, as DeepSpeed keeps them
        # pin_memory: the host copies are pinned on a GPU host; there is nothing to pin for on the CPU
        policy = dict(mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=self.device.type == "cuda"),
                      mp_policy=MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32))
        for layer in decoder_layers(self.model):  # one all-gather per decoder layer, as FSDP is meant to be used
            fully_shard(layer, **policy)
        fully_shard(self.model, **policy)
        # where the parameters are: on the host
        self.optimizer = torch.optim.AdamW(self.model.parameters(), **adamw_args(self.ds_config))

    def forward_backward(self, batch: torch.Tensor | dict[str, torch.Tensor]) -> torch.Tensor:
        loss = self.model(**model_inputs(batch, self.device)).loss
        loss.backward()
        return loss

    def weight_fingerprints(self) -> dict[str, torch.Tensor]:
        """The sharded parameters (DTensors) gathered whole."""
        return fingerprints((n, p.full_tensor() if hasattr(p, "full_tensor") else p)
                            for n, p in self.model.named_parameters())


class TorchAOEngine(HostAdamWEngine):
    """torchao-offload: torchao's CPUOffloadOptimizer (the optimizer step and fp32 state on the host)."""

    @classmethod
    def unavailable(cls, name: str, cuda: bool) -> str | None:
        if not cuda:
            return "torchao's CPUOffloadOptimizer runs on CUDA (or XPU) parameters only; this run's device is the CPU"
        if importlib.util.find_spec("torchao") is None:  # the [peers] extra; `make` adds it where nvidia-smi is
            return f"torchao not installed: {name} needs it (pip install -e '.[peers]')"
        return None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        from torchao.optim import CPUOffloadOptimizer

        self.model.float().to(self.device)  # fp32 master weights; the forward runs in the workload's dtype
        self.dtype = DTYPES[_dtype(self.ds_config)]
        self.optimizer = CPUOffloadOptimizer(self.model.parameters(), torch.optim.AdamW, **adamw_args(self.ds_config))

    def forward_backward(self, batch: torch.Tensor | dict[str, torch.Tensor]) -> torch.Tensor:
        cast = (torch.autocast(self.device.type, dtype=self.dtype) if self.dtype != torch.float32
                else contextlib.nullcontext())
        with cast:
            loss = self.model(**model_inputs(batch, self.device)).loss
        loss.backward()
        return loss


def fsdp2_missing(*names: str) -> str | None:
    """Why torch has not got FSDP2's `names` (torch >= 2.6: torch.distributed.fsdp), or None."""
    import torch.distributed.fsdp as fsdp

    missing = [n for n in names if not hasattr(fsdp, n)]
    return f"torch {torch.__version__} has no FSDP2 {', '.join(missing)}" if missing else None


def _dtype(ds_config: dict[str, Any]) -> str:
    return "bf16" if ds_config.get("bf16", {}).get("enabled") else "fp16" if ds_config.get("fp16", {}).get(
        "enabled") else "fp32"


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a Hugging Face causal LM or classifier (`model.model.layers`, `encoder.layer`), else the
    model's direct children."""
    for path in ("model.layers", "bert.encoder.layer", "encoder.layer"):
        found: Any = model
        for part in path.split("."):
            found = getattr(found, part, None)
        if found is not None:
            return list(found)
    return list(model.children())

