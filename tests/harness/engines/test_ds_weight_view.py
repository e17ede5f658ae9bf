"""The weight-view repair of DeepSpeed's ZenFlow stage 1/2 (zenflow/harness/engines/ds_divergences.py; divergence G,
docs/design.md §7), without DeepSpeed: two transcriptions of `DeepSpeedZeroOptimizer._update_model_bit16_weights`
stand in for the class the repair patches. 0.19.6's views the flat buffer through ZenFlow's transposing unflatten
(right); 0.19.8's (PR #8277) views it row-major (wrong). The flatten is ZenFlow's, transcribed: each 2-D tensor
transposed, then concatenated. The real releases: tests/reproduce/test_ds_zenflow_regression.py (0.19.8) and the
script run by hand against 0.19.6 (docs/design.md §7).
"""

from __future__ import annotations

import pytest
import torch

from zenflow.harness.engines import ds_divergences as dd

SHAPES = [(32, 16), (8, 32), (32,)]  # two rectangular weights and a vector, as a flat group holds them


def zenflow_flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """deepspeed/runtime/zenflow/zenflow_utils.py: _flatten_dense_tensors."""
    return torch.cat([(t.t().contiguous() if t.dim() == 2 else t).reshape(-1) for t in tensors])


def row_major_flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """torch's _flatten_dense_tensors: what ZeRO uses without ZenFlow."""
    return torch.cat([t.reshape(-1) for t in tensors])


class Release0196:
    """DeepSpeed 0.19.6's ZeRO stage 1/2 optimizer, the part the repair reads: `self.unflatten(flat, meta)`, which
    with ZenFlow transposes each 2-D view back (stage_1_and_2.py:805)."""

    zenflow = True

    def __init__(self, weights: list[torch.Tensor], flatten=zenflow_flatten) -> None:
        self.flatten = flatten
        self.bit16_groups = [[torch.nn.Parameter(w.clone()) for w in weights]]
        self.bit16_groups_flat = [flatten([p.data for p in self.bit16_groups[0]])]
        self._update_model_bit16_weights(0)  # at initialisation, as DeepSpeed does

    def _update_model_bit16_weights(self, group_index: int) -> None:
        flat, offset = self.bit16_groups_flat[group_index], 0
        for p in self.bit16_groups[group_index]:
            part = flat.narrow(0, offset, p.numel())
            p.data = part.view(p.shape[1], p.shape[0]).t() if p.dim() == 2 else part.view(p.shape)
            offset += p.numel()


class Release0198(Release0196):
    """DeepSpeed 0.19.8 (PR #8277): `flat.narrow(0, offset, numel).view(shape)`, no transpose (stage_1_and_2.py:889)."""

    def _update_model_bit16_weights(self, group_index: int) -> None:
        flat, offset = self.bit16_groups_flat[group_index], 0
        for p in self.bit16_groups[group_index]:
            p.data = flat.narrow(0, offset, p.numel()).view(p.shape)
            offset += p.numel()


def weights() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(shape) for shape in SHAPES]


def values(optimizer: Release0196) -> list[torch.Tensor]:
    return [p.detach().clone() for p in optimizer.bit16_groups[0]]


@pytest.fixture
def patched(monkeypatch: pytest.MonkeyPatch):
    """The repair patches the class `dd._optimizer_class()` returns: here a transcribed release (each test's
    changes to that class are undone after it)."""
    def use(cls: type) -> type:
        monkeypatch.setattr(cls, "_update_model_bit16_weights", cls.__dict__["_update_model_bit16_weights"])
        monkeypatch.setattr(dd, "_optimizer_class", lambda: cls)
        return cls
    return use


def test_pr_8277s_view_is_scrambled_and_the_repair_restores_the_models_weights(patched):
    given = weights()
    shipped = Release0198(given)
    for w, p in zip(given[:2], values(shipped)):
        assert not torch.equal(p, w) and torch.equal(p, w.t().contiguous().view(w.shape))  # W.T read as [out, in]
    cls = patched(Release0198)
    with dd.intended_weight_view():
        repaired = cls(given)
        assert all(torch.equal(p, w) for p, w in zip(values(repaired), given))
        assert repaired.restored_weight_views == 2  # the two matrices; the vector reads the same either way
        repaired._update_model_bit16_weights(0)  # after a step DeepSpeed re-views: the repair follows every time
        assert all(torch.equal(p, w) for p, w in zip(values(repaired), given))
        # the view, not a copy: an update of the flat buffer (the host update) lands on the right element
        repaired.bit16_groups_flat[0][1] += 1.0  # flat element 1 is W[1, 0] of the transposed first weight
        assert repaired.bit16_groups[0][0][1, 0] == given[0][1, 0] + 1.0
    assert not hasattr(Release0198._update_model_bit16_weights, "shipped")  # the block's end undoes the patch


def test_the_repair_is_a_no_op_where_the_release_already_views_the_weights_right(patched):
    """0.17.5-0.19.6: nothing to restore, nothing changed (not even the strides), and the counter says so."""
    given = weights()
    plain = Release0196(given)
    cls = patched(Release0196)
    with dd.intended_weight_view():
        repaired = cls(given)
    assert all(torch.equal(p, w) for p, w in zip(values(repaired), given))
    assert repaired.restored_weight_views == 0
    assert [p.data.stride() for p in repaired.bit16_groups[0]] == [p.data.stride() for p in plain.bit16_groups[0]]


def test_applied_twice_the_repair_wraps_deepspeed_once(patched):
    cls = patched(Release0198)
    shipped = cls._update_model_bit16_weights
    dd.repair_zenflow_weight_view()
    once = cls._update_model_bit16_weights
    dd.repair_zenflow_weight_view()
    assert cls._update_model_bit16_weights is once and once.shipped is shipped
    repaired = cls(weights())
    assert repaired.restored_weight_views == 2  # re-viewed once at initialisation, not twice (back to scrambled)
    dd.undo_zenflow_weight_view_repair()
    assert cls._update_model_bit16_weights is shipped


def test_a_block_keeps_a_repair_made_before_it(patched):
    """`intended_weight_view` undoes only its own repair: an inner block, or a block after an engine's
    repair ("for the rest of this process"), leaves the repair made before it in place."""
    cls = patched(Release0198)
    with dd.intended_weight_view():
        with dd.intended_weight_view():
            pass
        assert hasattr(cls._update_model_bit16_weights, "shipped")  # the outer block's repair outlives the inner
        assert cls(weights()).restored_weight_views == 2
    assert not hasattr(cls._update_model_bit16_weights, "shipped")  # the outer block's end undoes it
    dd.repair_zenflow_weight_view()  # as the engine ds-zenflow-intended does
    with dd.intended_weight_view():
        pass
    assert hasattr(cls._update_model_bit16_weights, "shipped")
    dd.undo_zenflow_weight_view_repair()


def test_a_row_major_flat_buffer_is_read_right_and_left_alone(patched):
    """A DeepSpeed that fixed the flatten instead of the view (row-major flat, row-major view) needs no repair."""
    assert dd.flatten_transposes(zenflow_flatten) and not dd.flatten_transposes(row_major_flatten)
    given = weights()
    cls = patched(Release0198)
    with dd.intended_weight_view():
        repaired = cls(given, flatten=row_major_flatten)
    assert all(torch.equal(p, w) for p, w in zip(values(repaired), given)) and repaired.restored_weight_views == 0


def test_a_layout_the_repair_does_not_know_is_refused_not_guessed():
    strided = torch.nn.Parameter(torch.randn(64, 32)[::2, ::2])  # strides (64, 2): neither known view
    with pytest.raises(RuntimeError, match=r"strides \(64, 2\), expected \(1, 32\) .* or \(16, 1\)"):
        dd.restore_view(strided, transposed_flat=True)
