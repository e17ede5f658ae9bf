"""Reselection counts the index bytes that cross, per direction (zenflow/ownership.py, `transfer_bytes`).

The promise: docs/step-semantics.md, "Bytes per step": "Reselection also moves fp32 master values, moments and indices
(kinds `master`, `moments`, `indices`)", counted by direction and kind in `opt.transfer_bytes`. What crosses at a
selection of a column param: its new selection, down (`d2h`, the k int64 indices the host reads to move columns), and,
when the owners change, the list of its host-owned columns, up (`h2d`, the `in − k` int64 indices the device keeps to
gather the next gradients). A reselection that keeps every owner moves no host column list. No other test reads the
`indices` counters (tests/core/test_bytes.py, tests/core/test_promises_reselection.py read `master` and `moments`).
"""

from __future__ import annotations

import torch

from zenflow import ZenFlowAdamW

INDEX_BYTES = 8  # int64
WIDTHS = (16, 8)  # the two weights' columns; topk_ratio 0.25 selects k = 4 and 2 of them
SELECTED = (4, 2)


def gradients(strong: str) -> list[torch.Tensor]:
    """Each weight's gradient with its first (`strong="low"`) or last (`"high"`) k columns ten times the others."""
    grads = []
    for width, k in zip(WIDTHS, SELECTED):
        grad = torch.ones(6, width)
        (grad[:, :k] if strong == "low" else grad[:, width - k:]).mul_(10.0)
        grads.append(grad)
    return grads


def test_each_selection_counts_k_indices_down_and_the_host_columns_up_when_owners_change():
    weights = [torch.nn.Parameter(torch.zeros(6, width)) for width in WIDTHS]
    block = {"topk_ratio": 0.25, "update_interval": 2, "select_interval": 2, "full_warm_up_rounds": 0,
             "overlap_step": False}
    schedule = ["low", "low", "high", "high", "high", "high"]  # selections at steps 0, 2 (owners change), 4 (none)
    seen = []
    with ZenFlowAdamW(weights, lr=1e-2, zenflow=block) as opt:
        for strong in schedule:
            for w, grad in zip(weights, gradients(strong)):
                w.grad = grad
            before = opt.transfer_bytes
            opt.step()
            after = opt.transfer_bytes
            seen.append({d: after.get((d, "indices"), 0) - before.get((d, "indices"), 0) for d in ("d2h", "h2d")})
    down = INDEX_BYTES * sum(SELECTED)
    up = INDEX_BYTES * sum(w - k for w, k in zip(WIDTHS, SELECTED))
    assert seen == [
        {"d2h": down, "h2d": up},  # first selection: every weight's host columns change
        {"d2h": 0, "h2d": 0},
        {"d2h": down, "h2d": up},  # the strong columns moved: owners change
        {"d2h": 0, "h2d": 0},
        {"d2h": down, "h2d": 0},  # the same selection: only the selection is read, nothing moves
        {"d2h": 0, "h2d": 0},
    ]
