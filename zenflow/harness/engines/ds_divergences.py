"""DeepSpeed ZenFlow's stage 1/2 weight view (divergence G, docs/design.md §7) and the repair that restores it.

ZenFlow stage 1/2 flattens every 2-D weight `W[out, in]` transposed (`zenflow_utils._flatten_dense_tensors`: a column
is contiguous) and lays its gradients out the same way. DeepSpeed 0.17.5-0.19.6 view the flat buffer back through
the matching transposing unflatten. PR #8277 (for issue #8276; first released in 0.19.7, still in 0.19.8) replaced
that call in `_update_model_bit16_weights` with `flat.narrow(...).view(shape)`, a row-major view with no transpose.
From `deepspeed.initialize` on, the module computes with W.T's memory read as `[out, in]` (a pretrained model is
scrambled) and the host (CPU Adam) update lands on transposed offsets; the device top-k update works on the module's
own view, so it is consistent with the scrambled module.

The repair re-views each 2-D weight as the transpose of its flat buffer, which is what 0.17.5-0.19.6 do; DeepSpeed's
arithmetic is untouched. It reads what DeepSpeed produced, never its version: where the flatten does not transpose,
or a weight already has the transposing view's strides, it changes nothing, so it stays right on a fixed DeepSpeed.
The engine `ds-zenflow-intended` applies it because its registry row says so (`EngineSpec.repair_weight_view`);
`ds-zenflow` is DeepSpeed as shipped; reproduce/ds_zenflow_regression.py shows both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch


def flatten_transposes(flatten: Callable[[list[torch.Tensor]], torch.Tensor]) -> bool:
    """Does `flatten` (an optimizer's `self.flatten`) lay a 2-D tensor out transposed, as ZenFlow's does?"""
    probe = torch.arange(6.0).view(2, 3)
    return torch.equal(flatten([probe]), probe.t().reshape(-1))


def restore_view(p: torch.Tensor, transposed_flat: bool) -> bool:
    """Re-view weight `p` as the transpose of its flat buffer if DeepSpeed viewed it row-major; True if it did."""
    if p.dim() != 2 or 1 in p.shape or not transposed_flat:
        return False  # a vector, a single row or column reads the same either way; a row-major flat is read right
    out, inp = p.shape
    if p.data.stride() == (1, out):
        return False  # the transposing unflatten's view (DeepSpeed 0.17.5-0.19.6): already right
    if not p.data.is_contiguous():
        raise RuntimeError(f"DeepSpeed's ZenFlow weight of shape {tuple(p.shape)} has strides {p.data.stride()}, "
                           f"expected (1, {out}) (the transposing view) or ({inp}, 1) (PR #8277's row-major view): "
                           "the weight-view repair does not know this layout")
    p.data = p.data.view(inp, out).t()
    return True


def restore_views(params: Iterable[torch.Tensor], flatten: Callable[[list[torch.Tensor]], torch.Tensor]) -> int:
    """restore_view on every parameter of a flat group; how many it re-viewed."""
    transposed = flatten_transposes(flatten)
    return sum(restore_view(p, transposed) for p in params)


def _with_intended_views(shipped: Callable[[Any, int], None]) -> Callable[[Any, int], None]:
    """DeepSpeed's `_update_model_bit16_weights`, then the intended view of each ZenFlow weight. It runs at
    initialisation, after every step and on offload/reload, so the counter read right after `deepspeed.initialize`
    says what initialisation needed."""
    def update_with_intended_views(self: Any, group_index: int) -> None:
        shipped(self, group_index)
        if getattr(self, "zenflow", False):
            restored = restore_views(self.bit16_groups[group_index], self.flatten)
            self.restored_weight_views = getattr(self, "restored_weight_views", 0) + restored

    update_with_intended_views.shipped = shipped  # type: ignore[attr-defined]
    return update_with_intended_views


def _optimizer_class() -> Any:
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return DeepSpeedZeroOptimizer


def repair_zenflow_weight_view() -> None:
    """Patch DeepSpeedZeroOptimizer for the rest of this process (each harness run is a fresh process); applying it
    again changes nothing."""
    cls = _optimizer_class()
    if not hasattr(cls._update_model_bit16_weights, "shipped"):
        cls._update_model_bit16_weights = _with_intended_views(cls._update_model_bit16_weights)


def undo_zenflow_weight_view_repair() -> None:
    """DeepSpeed's own `_update_model_bit16_weights` again (a no-op when the repair is not applied)."""
    cls = _optimizer_class()
    shipped = getattr(cls._update_model_bit16_weights, "shipped", None)
    if shipped is not None:
        cls._update_model_bit16_weights = shipped


@contextmanager
def intended_weight_view() -> Iterator[None]:
    """The repair for a block (initialize and train inside it): one process can then run both views."""
    applied_before = hasattr(_optimizer_class()._update_model_bit16_weights, "shipped")
    repair_zenflow_weight_view()
    try:
        yield
    finally:
        if not applied_before:
            undo_zenflow_weight_view_repair()


def weight_view_record(optimizer: Any) -> dict[str, Any]:
    """What the repair did at `deepspeed.initialize` (the run's `protocol.ds_weight_view`), with a one-line note.
    Who asked is the run's engine (its registry row: ds-zenflow-intended)."""
    import deepspeed

    version = deepspeed.__version__
    restored = getattr(optimizer, "restored_weight_views", None)
    if restored is None:
        note = f"DeepSpeed {version}: not a ZenFlow stage 1/2 optimizer, no weight view to repair"
    elif restored == 0:
        note = (f"DeepSpeed {version} already views ZenFlow's weights as the model's: the weight-view repair "
                "changed nothing")
    else:
        note = (f"DeepSpeed {version} viewed {restored} ZenFlow weights untransposed (PR #8277): re-viewed as the "
                "transpose of their flat buffer, as DeepSpeed 0.17.5-0.19.6 do")
    return {"restored_at_init": restored, "deepspeed": version, "note": note}
