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

    @classmethod
    def of(cls, group: dict) -> AdamWHyper:
        """A torch param group's hyperparameters."""
        beta1, beta2 = group["betas"]
        return cls(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"])


def adamw_(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
           exp_avg_sqs: list[torch.Tensor], steps: list[int], hp: AdamWHyper, divisor: int = 1) -> None:
    """One AdamW update, in place, where `steps[i]` is the count *after* this update (>= 1), with the gradients
    `grads[i] / divisor` (a mean of `divisor` accumulated steps). The fused kernel divides as it reads (its
    `grad_scale`), the same IEEE division as a `div_` before it and written back to `grads` the same way, so the
    result is bit-identical and the gradients are read from memory once instead of three times."""
    if not params:
        return
    # The functional API increments the step tensors itself, so hand it the count before this update. torch.full
    # is a fill kernel on the parameter's device: no host->device copy and no stream sync, where
    # torch.tensor(..., device=cuda) would copy from pageable memory and wait, once per parameter.
    step_tensors = [torch.full((), float(s - 1), dtype=torch.float32, device=p.device) for s, p in zip(steps, params)]
    _functional_adamw(params, grads, exp_avgs, exp_avg_sqs, [], step_tensors, fused=True, amsgrad=False,
                      beta1=hp.beta1, beta2=hp.beta2, lr=hp.lr, weight_decay=hp.weight_decay, eps=hp.eps,
                      maximize=False, grad_scale=_divisor(divisor, params[0].device))


def _divisor(divisor: int, device: torch.device) -> torch.Tensor | None:
    return None if divisor == 1 else torch.full((), float(divisor), dtype=torch.float32, device=device)


def rebase_moment_(moment: torch.Tensor, beta: float, from_step: int, to_step: int) -> None:
    """Re-express a moment accumulated over `from_step` updates for a side that has made `to_step` updates.

    A column that changes owner keeps its bias-corrected moment m/(1-beta^s) exactly at the move, while each
    side keeps one integer step count per parameter (so the fused kernel applies to whole tensors).
    A zero count means the moment is still zero (nothing to rescale).
    """
    if from_step and to_step and from_step != to_step:
        moment.mul_((1 - beta ** to_step) / (1 - beta ** from_step))
