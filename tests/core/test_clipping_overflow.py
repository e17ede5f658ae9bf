"""Clipping and overflow handling apply to the whole gradient, before the device/host split."""

from __future__ import annotations

import pytest
import torch
from helpers import Interleaved, clone_model, grad_stream, set_grads

from zenflow import ZenFlowAdamW
from zenflow.state import ColumnState


def scaled_grads(model, steps, seed, scale):
    return [[g * scale for g in step] for step in grad_stream(model, steps, seed)]


@pytest.mark.parametrize("block", [dict(topk_ratio=1.0, update_interval=1),
                                   dict(topk_ratio=0.0, update_interval=1, select_interval=1)])
def test_clipping_uses_the_global_norm_of_the_whole_gradient(block):
    """topk 1 (all on the device) and topk 0 (all on the host) both equal clip_grad_norm_ + AdamW."""
    model = Interleaved([10, 8, 6, 3], seed=1)
    ours, ref = clone_model(model), clone_model(model)
    opt = ZenFlowAdamW(ours.parameters(), lr=1e-2, weight_decay=0.1, zenflow=block, gradient_clipping=0.5)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    for g in scaled_grads(model, 6, seed=2, scale=10.0):  # norms far above 0.5: clipping really happens
        set_grads(ours, g)
        set_grads(ref, g)
        opt.step()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
    for p, q in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_mixed_split_is_clipped_with_one_coefficient_for_both_parts():
    """With the same clipped gradient fed unclipped to a reference ZenFlow, both runs agree within fp32 rounding:
    the host adds each clipped gradient as one fused multiply-add (host.accumulate_into_), where the reference
    adds the gradient clip_grad_norm_ already rounded. Negative control: the reference without clipping is far."""
    model = Interleaved([12, 10, 4], seed=3)
    clipped, manual, unclipped = clone_model(model), clone_model(model), clone_model(model)
    block = dict(topk_ratio=0.3, update_interval=2, select_interval=100)
    opt = ZenFlowAdamW(clipped.parameters(), lr=1e-2, zenflow=block, gradient_clipping=1.0)
    ref = ZenFlowAdamW(manual.parameters(), lr=1e-2, zenflow=block)
    control = ZenFlowAdamW(unclipped.parameters(), lr=1e-2, zenflow=block)
    for g in scaled_grads(model, 6, seed=4, scale=5.0):
        for m in (clipped, manual, unclipped):
            set_grads(m, g)
        torch.nn.utils.clip_grad_norm_(manual.parameters(), 1.0)  # one global coefficient
        for o in (opt, ref, control):
            o.step()
    for o in (opt, ref, control):
        o.drain()
    for p, q, r in zip(clipped.parameters(), manual.parameters(), unclipped.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
        assert not torch.allclose(p, r, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("overlap", [False, True])
def test_non_finite_gradient_skips_the_step_on_both_parts(feed, overlap):
    model = Interleaved([12, 10, 4], seed=5)
    opt = ZenFlowAdamW(model.parameters(), lr=1e-2, gradient_clipping=1.0,
                       zenflow=dict(topk_ratio=0.3, update_interval=2, overlap_step=overlap))
    grads = grad_stream(model, 3, seed=6)
    feed(model, opt, grads[:2], zero_grad=False)
    opt.drain()
    before = [p.detach().clone() for p in model.parameters()]
    state = {id(p): (getattr(opt.state[p], "d_step", None), getattr(opt.state[p], "step", None))
             for p in model.parameters()}
    bad = [g.clone() for g in grads[2]]
    bad[-2][0, 0] = float("inf")  # one element of one weight overflowed (fp16-style)
    set_grads(model, bad)
    t = opt.t
    opt.step()
    opt.drain()
    assert opt.skipped_steps == 1 and opt.t == t
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p, q)
    assert state == {id(p): (getattr(opt.state[p], "d_step", None), getattr(opt.state[p], "step", None))
                     for p in model.parameters()}
    for p in model.parameters():
        if isinstance(opt.state[p], ColumnState):
            assert all(c == 0 for c in opt.state[p].host.counts)  # nothing accumulated
    opt.close()
