"""Gradient clipping and overflow: one global norm of the whole gradient, before the device/host split.

Clipping keeps one coefficient for both parts, exactly torch's clip_grad_norm_ rule, but instead of rewriting every
gradient on the training thread it is applied where each part reads its gradient: the device to its selected columns
(device.device_update_), the host (the worker) to the columns it accumulates (host.accumulate_). `p.grad` itself is
left as backward produced it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from zenflow.distributed import Ranks
from zenflow.hooks import Observers


@dataclass
class Clip:
    """This step's clipping coefficient, once on each side (the same value); None on both: no clipping."""

    device: torch.Tensor | None = None  # fp32 scalar on the device: multiplies the device part's gradient copies
    host: torch.Tensor | None = None    # fp32 scalar on the host: multiplies what the host part accumulates


def check_gradients(params: list[torch.Tensor], state: dict, ranks: Ranks, observers: Observers, skip_nonfinite: bool,
                    max_norm: float) -> tuple[bool, Clip]:
    """(whether the step's gradient is finite, the clipping coefficients). Without `skip_nonfinite` nothing is read:
    (True, no clipping)."""
    if not skip_nonfinite:
        return True, Clip()
    if not any(p.grad is not None for p in params):
        return True, Clip()
    total = ranks.total_norm(params, state)
    with observers.blocking("clip_sync"):
        total_value = total.item()  # device->host sync point (the step's only one)
    finite = math.isfinite(total_value)
    if not (finite and max_norm > 0):
        return finite, Clip()
    # torch's clip_grad_norm_ rule, once on the device (no sync) and once on the host from the value just read (so
    # the host part needs no second sync); the same expression, in the norm's dtype
    host_total = torch.tensor(total_value, dtype=total.dtype)  # exact: .item() of that dtype
    return True, Clip(device=coefficient(max_norm, total), host=coefficient(max_norm, host_total))


def coefficient(max_norm: float, total: torch.Tensor) -> torch.Tensor:
    """torch's clip_grad_norm_ rule, computed in the norm's dtype, as fp32."""
    return torch.clamp(max_norm / (total + 1e-6), max=1.0).to(torch.float32)
