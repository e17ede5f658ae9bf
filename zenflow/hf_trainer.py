"""ZenFlowAdamW in the Hugging Face `Trainer`. This module needs transformers; the core (`import zenflow`) does not.

    from zenflow import ZenFlowAdamW
    from zenflow.hf_trainer import ZenFlowCallback, decay_groups

    opt = ZenFlowAdamW(decay_groups(model, weight_decay=0.01), lr=2e-5,
                       zenflow={"topk_ratio": 0.1, "update_interval": 4, "overlap_step": True})
    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=dev,
                      optimizers=(opt, None),            # the Trainer builds its LR scheduler on it
                      callbacks=[ZenFlowCallback()])     # drains before evaluation and saving, closes at the end
    trainer.train()                                      # or trainer.train(resume_from_checkpoint=True): bit-exact

Why a callback: with `overlap_step` the last host update is still in flight after a step, so the weights the Trainer
evaluates or saves would miss it. The callback drains (applies it) at the end of any step after which the Trainer
evaluates, saves or stops, and at the end of training it drains and stops the host worker (a later `train()` starts
a new one). The optimizer's state goes into the Trainer's checkpoints as any optimizer's does (`optimizer.pt`, read
back with `weights_only=True`). Clip with the Trainer's `max_grad_norm` or ZenFlow's `gradient_clipping`, not both.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from zenflow.optimizer import ZenFlowAdamW


def decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two param groups, as the Trainer makes them: weight decay for weights (>= 2 dims), none for biases and norms
    (1-dim); frozen parameters left out."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


class ZenFlowCallback(TrainerCallback):
    """Drains ZenFlowAdamW before the Trainer evaluates, saves or stops; closes its worker when training ends."""

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        # runs after the Trainer's own flow callback has decided this step's evaluate / save / stop
        if control.should_evaluate or control.should_save or control.should_training_stop:
            _drain(kwargs.get("optimizer"))

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        if control.should_evaluate or control.should_save or control.should_training_stop:
            _drain(kwargs.get("optimizer"))  # epoch strategies decide here, after the epoch's last step

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        optimizer = _zenflow(kwargs.get("optimizer"))
        if optimizer is not None:
            optimizer.close()  # drains first, then stops the worker and gives its cores back


def _zenflow(optimizer: Any) -> ZenFlowAdamW | None:
    """The ZenFlowAdamW inside what the Trainer passes (accelerate wraps it in an AcceleratedOptimizer)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return inner if isinstance(inner, ZenFlowAdamW) else None


def _drain(optimizer: Any) -> None:
    inner = _zenflow(optimizer)
    if inner is not None:
        inner.drain()
