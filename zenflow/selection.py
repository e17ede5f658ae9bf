"""Importance selection: which columns of a weight gradient are updated on the device.

A column `j` of `W[out, in]` is `W[:, j]`; its importance is the norm of its gradient column (the paper's
per-column norm proxy). Selection is per parameter: each weight keeps its own top `k = ceil(ratio * in)`.
"""

from __future__ import annotations

import math

import torch

from zenflow.config import COLUMN_NORMS


def num_selected(in_features: int, topk_ratio: float) -> int:
    """k = ceil(topk_ratio * in), clamped to [0, in]."""
    return min(in_features, max(0, math.ceil(topk_ratio * in_features - 1e-9)))


BLOCK_ROWS = 64  # rows a CPU block converts at once: its fp32 copy (1 MiB at in = 4096) stays in the L2 cache


def column_sums(grad: torch.Tensor, norm: str = "l2") -> torch.Tensor:
    """Per column of `grad` ([out, in]), in fp32: the sum of squares over the rows (L2) or of magnitudes (L1).

    On the CPU a block of rows at a time, added element by element into a block of partial sums (contiguous,
    vectorised), which are summed over their rows once at the end: converting the whole gradient to fp32 first
    writes and reads again twice its bytes through memory, and `vector_norm` along dim 0 runs ~20x slower than
    this there (docs/benchmarks.md, "Bound ratios"). The sums are fp32 either way (bf16 sums would reorder
    near-ties); only their order differs."""
    if norm not in COLUMN_NORMS:
        raise ValueError(f"column_norm = {norm!r} is not allowed: expected 'l2' or 'l1'")
    if grad.device.type != "cpu":
        g = grad.float()
        return g.square().sum(dim=0) if norm == "l2" else g.abs().sum(dim=0)
    rows, width = grad.shape
    partial = torch.zeros(min(rows, BLOCK_ROWS), width, dtype=torch.float32)
    buffer = torch.empty_like(partial)
    for start in range(0, rows, BLOCK_ROWS):
        n = min(BLOCK_ROWS, rows - start)
        block = buffer[:n].copy_(grad[start:start + n])
        if norm == "l2":
            partial[:n].addcmul_(block, block)
        else:
            partial[:n].add_(block.abs_())
    return partial.sum(dim=0)


def column_scores(grad: torch.Tensor, norm: str = "l2") -> torch.Tensor:
    """Norm of every gradient column of `grad` ([out, in]), in fp32."""
    if grad.device.type != "cpu" and norm == "l2":
        return torch.linalg.vector_norm(grad.float(), ord=2, dim=0)  # one kernel on CUDA
    sums = column_sums(grad, norm)
    return sums.sqrt_() if norm == "l2" else sums


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
