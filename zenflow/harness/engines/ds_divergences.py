"""Opt-in repair of one DeepSpeed 0.19.8 defect, for diagnosis only (never applied by default).

Divergence G (found by tests/core/test_deepspeed_differential.py): ZenFlow stage 1/2 flattens every 2-D weight
transposed (`[in, out]`, so that a column is contiguous) and lays its gradients out the same way, but re-views the
flat buffer as `[out, in]` without transposing it back. From `deepspeed.initialize` on, the module computes with
W.T's memory read as `[out, in]` (a pretrained model is scrambled), and the host update lands on the transposed
offsets. The repair re-views each 2-D weight DeepSpeed produced as the transpose of its flat buffer; DeepSpeed's
arithmetic is untouched. It answers "how does DeepSpeed's ZenFlow train once this one view is right?".
"""

from __future__ import annotations


def repair_zenflow_weight_view() -> None:
    """Patch DeepSpeedZeroOptimizer for the rest of this process (each run is a fresh process)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    original = DeepSpeedZeroOptimizer._update_model_bit16_weights
    if getattr(original, "zenflow_view_repaired", False):
        return

    def transposed_views(self, group_index):
        original(self, group_index)
        if getattr(self, "zenflow", False):
            for p in self.bit16_groups[group_index]:
                if p.dim() == 2:
                    out, inp = p.shape
                    p.data = p.data.view(inp, out).t()

    transposed_views.zenflow_view_repaired = True
    DeepSpeedZeroOptimizer._update_model_bit16_weights = transposed_views
