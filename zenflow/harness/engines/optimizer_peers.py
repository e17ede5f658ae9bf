"""Peers that are another optimizer in the no-offload loop: the model trains as `no-offload`
does (forward, backward, clip_grad_norm_, step), and only the optimizer differs.

| engine                  | optimizer                                                                              |
|-------------------------|----------------------------------------------------------------------------------------|
| megatron-hybrid-0.1     | Megatron-core's `HybridDeviceOptimizer`: a static share of the parameters (by count,   |
| megatron-hybrid-0.5     | `offload_fraction`) stepped by torch AdamW on the host from fp32 copies, the rest on   |
| megatron-hybrid-1.0     | the device; gradients down and parameters up on side streams. ZenFlow without          |
|                         | importance or asynchrony                                                               |
| torchao-adamw8bit       | torchao's `AdamW8bit`: no offload, both moments block-quantized to 8 bits on the device |
| bnb-adamw8bit           | bitsandbytes' `AdamW8bit`: the same idea, its CUDA kernels                              |

What each computes, against its baseline (docs/peers.md):
- megatron-hybrid-*: exact AdamW from fp32 masters (`param_update_in_fp32`), the same update as `no-offload-fp32` and
  `ref-offload`, split by where it runs. Megatron-core imports without TransformerEngine (with a warning) but
  offloads only CUDA parameters (`param.is_cuda`) and drives `torch.cuda` streams, so on a CPU device it is "not
  run here".
- *-adamw8bit: AdamW whose moments are rounded to 8 bits per element (with a scale per block) every step, on the
  bf16 parameters themselves as `no-offload` keeps them: not the same numbers as AdamW; their loss against
  `no-offload`'s is the difference they make, which the table's final loss shows. Memory: 2 bytes of state per
  parameter instead of 4 (bf16 moments) or 12 (fp32 master and moments).
"""

from __future__ import annotations

import importlib.util

import torch

from zenflow.harness.engines.classes import NoOffloadEngine, adamw_args, refuse_ranks

OFFLOAD_FRACTIONS = (0.1, 0.5, 1.0)  # Megatron-core's offload_fraction: the share of parameters on the host


class MegatronHybridEngine(NoOffloadEngine):
    """megatron-hybrid-<fraction>: Megatron-core's HybridDeviceOptimizer at one `offload_fraction` (a subclass per
    fraction: `megatron_hybrid`). Its step copies and runs the host share inside `step()`, so the step is booked as
    stall including I/O, as DeepSpeed's."""

    offload_fraction: float = 0.5
    stall_includes_io = True
    placed_by = None  # its host share runs inside its own step, unseen from outside (and it needs CUDA anyway)

    @classmethod
    def unavailable(cls, name: str, cuda: bool) -> str | None:
        if not cuda:
            return ("Megatron-core's HybridDeviceOptimizer offloads CUDA parameters only (param.is_cuda) and drives "
                    "torch.cuda streams; this run's device is the CPU")
        if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
            return f"megatron-core not installed: {name} needs it (pip install -e '.[peers]')"
        return None

    def build_optimizer(self, distributed: bool) -> torch.optim.Optimizer:
        refuse_ranks(self.name, distributed)
        from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

        return HybridDeviceOptimizer(self.model.parameters(), offload_fraction=self.offload_fraction,
                                     cpu_optimizer_cls=torch.optim.AdamW, gpu_optimizer_cls=torch.optim.AdamW,
                                     param_update_in_fp32=True, pin_cpu_grads=True, pin_cpu_params=True,
                                     overlap_cpu_optimizer_d2h_h2d=True, **adamw_args(self.ds_config))


def megatron_hybrid(fraction: float) -> type[MegatronHybridEngine]:
    """The engine class of megatron-hybrid-<fraction>."""
    return type(f"MegatronHybrid{int(100 * fraction)}Engine", (MegatronHybridEngine,),
                {"offload_fraction": fraction, "__doc__": f"megatron-hybrid-{fraction}: offload_fraction {fraction}"})


class TorchAOAdamW8bitEngine(NoOffloadEngine):
    """torchao-adamw8bit: torchao's AdamW8bit on the model's own parameters, no offload."""

    @classmethod
    def unavailable(cls, name: str, cuda: bool) -> str | None:
        if importlib.util.find_spec("torchao") is None:
            return f"torchao not installed: {name} needs it (pip install -e '.[peers]')"
        return None

    def build_optimizer(self, distributed: bool) -> torch.optim.Optimizer:
        refuse_ranks(self.name, distributed)
        from torchao.optim import AdamW8bit

        return AdamW8bit(self.model.parameters(), **adamw_args(self.ds_config, fused=False))


class BitsAndBytesAdamW8bitEngine(NoOffloadEngine):
    """bnb-adamw8bit: bitsandbytes' AdamW8bit on the model's own parameters, no offload (its CUDA kernels)."""

    @classmethod
    def unavailable(cls, name: str, cuda: bool) -> str | None:
        if not cuda:
            return "bitsandbytes' 8-bit AdamW is run with its CUDA kernels only; this run's device is the CPU"
        if importlib.util.find_spec("bitsandbytes") is None:
            return f"bitsandbytes not installed: {name} needs it (pip install -e '.[peers]')"
        return None

    def build_optimizer(self, distributed: bool) -> torch.optim.Optimizer:
        refuse_ranks(self.name, distributed)
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(self.model.parameters(), **adamw_args(self.ds_config, fused=False))
