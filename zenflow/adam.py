"""AdamW arithmetic shared by the device and host parts.

Both parts call torch's fused AdamW kernel on fp32 buffers (master weights, moments, gradients). Step counts are
Python integers (exact whatever the model dtype); the kernel receives them as fp32 tensors, exact up to 2**24.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.optim.adamw import adamw as _functional_adamw


@dataclass
class AdamWHyper:
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float


def adamw_(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
           exp_avg_sqs: list[torch.Tensor], steps: list[int], hp: AdamWHyper) -> None:
    """One AdamW update, in place, where `steps[i]` is the count *after* this update (>= 1)."""
    if not params:
        return
    # The functional API increments the step tensors itself, so hand it the count before this update.
    step_tensors = [torch.tensor(float(s - 1), dtype=torch.float32, device=p.device) for s, p in zip(steps, params)]
    _functional_adamw(params, grads, exp_avgs, exp_avg_sqs, [], step_tensors, fused=True, amsgrad=False,
                      beta1=hp.beta1, beta2=hp.beta2, lr=hp.lr, weight_decay=hp.weight_decay, eps=hp.eps,
                      maximize=False)


def carry_moments_(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, from_step: int, to_step: int,
                   hp: AdamWHyper) -> None:
    """Re-express moments counted under `from_step` updates for a side that has made `to_step` updates.

    A column that changes owner keeps its bias-corrected moments m/(1-b1^s) and v/(1-b2^s) exactly at the
    moment of the move; each side keeps one integer step count per parameter (so the fused kernel applies).
    """
    if from_step == to_step or from_step == 0:
        return  # identical counts, or moments still zero
    exp_avg.mul_((1 - hp.beta1 ** to_step) / (1 - hp.beta1 ** from_step))
    exp_avg_sq.mul_((1 - hp.beta2 ** to_step) / (1 - hp.beta2 ** from_step))
