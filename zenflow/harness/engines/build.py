"""Engines: one small interface over the ways to train (docs/design.md §3), built from the engine's row in registry.py.

    cfg = deepspeed_config("ref-zenflow", block, "bf16", 1, lr=2e-5, weight_decay=0.01, clipping=1.0, cuda=True)
    engine = make_engine("ref-zenflow", model, cfg, StepTimeline())

Every engine gets the same DeepSpeed-style config dict (optimizer params, clipping, dtype, its ZeRO and ZenFlow
blocks), so the reference engines read exactly what DeepSpeed reads. What each engine is (its class, its blocks, its
update cycle) is its registry row; the classes are in classes.py (ours, DeepSpeed's, the bound) and
peers.py (the PyTorch peers); docs/peers.md describes each engine.
"""

from __future__ import annotations

from typing import Any

import torch

from zenflow.harness.engines.classes import (
    DeepSpeedEngine,
    Engine,
    NoOffloadEngine,
    TorchEngine,
    ZenFlowEngine,
    fingerprints,
    weight_fingerprints,
)
from zenflow.harness.engines.process import resolve_device
from zenflow.harness.engines.registry import engine_spec
from zenflow.harness.engines.zero import resolve_sub_groups
from zenflow.telemetry.timeline import StepTimeline

__all__ = ["DeepSpeedEngine", "Engine", "NoOffloadEngine", "TorchEngine", "ZenFlowEngine", "deepspeed_config",
           "fingerprints", "init_warnings", "make_engine", "resolve_device"]


def deepspeed_config(engine: str, zenflow_block: dict[str, Any], dtype: str, micro_batch: int, lr: float,
                     weight_decay: float, clipping: float, cuda: bool, nvme_path: str | None = None) -> dict[str, Any]:
    """The DeepSpeed JSON every engine is built from (DeepSpeedExamples' ZenFlow fine-tuning settings); the peers
    that are not DeepSpeed read its optimizer, clipping and dtype. `zenflow_block`: the run's ZenFlow block (the
    ZenFlow engines run it, the -gas controls accumulate its update interval); `nvme_path`: ZeRO-Infinity offloads
    to NVMe."""
    spec = engine_spec(engine)
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": spec.accumulation(zenflow_block),
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8,
                                                  "weight_decay": weight_decay}},
        "gradient_clipping": clipping,
        "bf16": {"enabled": dtype == "bf16"},
        "fp16": {"enabled": dtype == "fp16"},
        "zero_optimization": spec.zero_optimization(zenflow_block, cuda, nvme_path),
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def make_engine(name: str, model: torch.nn.Module, ds_config: dict[str, Any], timeline: StepTimeline,
                telemetry: bool = True, device: str = "auto") -> Engine:
    """Build the engine on `device` ("auto": CUDA when available, else the CPU; "cpu"; "cuda[:N]"; see
    resolve_device), as its registry row says (ds-zenflow-intended's row repairs DeepSpeed's weight view:
    ds_divergences.py), and record in
    `engine.weights_changed_at_init` the parameters whose values its construction changed (beyond the cast to the
    training dtype). It should be empty: a non-empty list means the model trains from other weights than the ones
    it was given (DeepSpeed 0.19.8 ZenFlow stage 1/2: divergence G)."""
    spec = engine_spec(name)
    before = weight_fingerprints(model)
    ds_config = resolve_sub_groups(ds_config, sum(p.numel() for p in model.parameters()))
    engine = spec.engine_class(name, model, ds_config, timeline, telemetry, spec.repair_weight_view, device,
                               cycle=spec.cycle(ds_config))
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
