"""Importance selection: which columns of a weight gradient are updated on the device.

A column `j` of `W[out, in]` is `W[:, j]`; its importance is the norm of its gradient column (the paper's
per-column norm proxy). Selection is per parameter: each weight keeps its own top `k = ceil(ratio * in)`.
"""

from __future__ import annotations

import math

import torch


def num_selected(in_features: int, topk_ratio: float) -> int:
    """k = ceil(topk_ratio * in), clamped to [0, in]."""
    return min(in_features, max(0, math.ceil(topk_ratio * in_features - 1e-9)))


def column_scores(grad: torch.Tensor, norm: str = "l2") -> torch.Tensor:
    """Norm of every gradient column, in fp32 (bf16 sums would reorder near-ties)."""
    grad = grad.float()
    if norm == "l2":
        return torch.linalg.vector_norm(grad, ord=2, dim=0)
    if norm == "l1":
        return grad.abs().sum(dim=0)
    raise ValueError(f"column_norm = {norm!r} is not allowed: expected 'l2' or 'l1'")


def select_columns(grad: torch.Tensor, k: int, norm: str = "l2", scores: torch.Tensor | None = None) -> torch.Tensor:
    """Indices of the k columns with the largest norm (or the given `scores`: data parallelism sums them across
    ranks), sorted ascending (stable gather/scatter order)."""
    if k >= grad.shape[1]:
        return torch.arange(grad.shape[1], device=grad.device)
    if k == 0:
        return torch.empty(0, dtype=torch.long, device=grad.device)
    top = torch.topk(column_scores(grad, norm) if scores is None else scores, k, sorted=False).indices
    return torch.sort(top).values


def as_columns(t: torch.Tensor) -> torch.Tensor:
    """A parameter (or its gradient) as `[out, in]` (higher ranks flattened): columns are dim 1."""
    return t.view(t.shape[0], math.prod(t.shape[1:]))  # not -1: FSDP2 may leave a rank no rows


def complement(selected: torch.Tensor, width: int) -> torch.Tensor:
    """The columns not in `selected`, ascending."""
    mask = torch.ones(width, dtype=torch.bool, device=selected.device)
    mask[selected] = False
    return mask.nonzero().squeeze(1)
