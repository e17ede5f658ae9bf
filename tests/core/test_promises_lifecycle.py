"""Promises of the step's edges, each pinned directly: the clip coefficient is capped at 1, leaving
a `with` block flushes like `drain()`, and a state_dict saved in the middle of an update interval resumes bit for bit.

Fixed gradients per step (tests/support/helpers.grad_stream), fp32, betas not (0, 0).
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from helpers import Interleaved, clone_model, grad_stream

from zenflow import ZenFlowAdamW

BETAS = (0.9, 0.99)


@pytest.fixture
def make_opt(zenflow_opt):
    """The shared factory (lr 1e-2, weight decay 0.1) with BETAS, the clipping norm, and select_interval 4 unless
    the block names one."""
    def make(model: torch.nn.Module, clipping: float = 0.0, **block) -> ZenFlowAdamW:
        block.setdefault("select_interval", 4)
        return zenflow_opt(model, betas=BETAS, gradient_clipping=clipping, **block)

    return make


def params_of(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def assert_bit_identical(a: list[torch.Tensor], b: list[torch.Tensor], where: str = "") -> None:
    assert len(a) == len(b)
    for i, (p, q) in enumerate(zip(a, b)):
        assert torch.equal(p, q), f"{where} parameter {i}: max diff {(p - q).abs().max().item():.3g}"


# ---- clipping ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block", [dict(topk_ratio=0.3, update_interval=2, full_warm_up_rounds=1),
                                   dict(topk_ratio=0.3, update_interval=2, full_warm_up_rounds=1, overlap_step=True),
                                   dict(topk_ratio=1.0, update_interval=1)])
def test_gradient_below_the_clipping_norm_gives_exactly_the_unclipped_result(feed, make_opt, block):
    """The coefficient is min(1, max_norm / (norm + 1e-6)): below the threshold it is 1 and changes no bit.

    Small gradients make the uncapped coefficient large (~1e5), and Adam is not scale invariant where eps
    matters, so an uncapped coefficient changes the update visibly."""
    model = Interleaved([12, 10, 6], seed=1)
    clipped, plain = clone_model(model), clone_model(model)
    grads = [[g * 1e-6 for g in step] for step in grad_stream(model, 8, seed=2)]
    max_norm = 1.0
    for step in grads:  # precondition: every step is below the threshold (nothing should be clipped)
        assert torch.nn.utils.get_total_norm(step).item() < max_norm / 10
    opt_clipped = make_opt(clipped, clipping=max_norm, **copy.deepcopy(block))
    opt_plain = make_opt(plain, **copy.deepcopy(block))
    try:
        feed(clipped, opt_clipped, grads)
        feed(plain, opt_plain, grads)
        opt_clipped.drain()
        opt_plain.drain()
    finally:
        opt_clipped.close()
        opt_plain.close()
    assert_bit_identical(params_of(clipped), params_of(plain))
    assert not torch.equal(params_of(clipped)[0], params_of(model)[0])  # it trained


# ---- with block ---------------------------------------------------------------------------------------------
# W=1, U=3, 9 steps: the last boundary was at step 7 (overlap: its result is still in flight) and step 8 is
# accumulated but not yet applied, so a flush has something to apply in both modes.
FLUSH_BLOCK = dict(topk_ratio=0.3, update_interval=3, full_warm_up_rounds=1, select_interval=6)


@pytest.mark.parametrize("overlap", [True, False])
def test_leaving_a_with_block_flushes_like_drain(feed, make_opt, overlap):
    model = Interleaved([12, 10, 6], seed=4)
    grads = grad_stream(model, 9, seed=5)
    explicit, in_block = clone_model(model), clone_model(model)
    opt = make_opt(explicit, overlap_step=overlap, **FLUSH_BLOCK)
    feed(explicit, opt, grads)
    undrained = params_of(explicit)
    opt.drain()
    opt.close()
    drained = params_of(explicit)
    assert any(not torch.equal(a, b) for a, b in zip(undrained, drained)), "nothing to flush: the test is void"

    with make_opt(in_block, overlap_step=overlap, **FLUSH_BLOCK) as opt:
        feed(in_block, opt, grads)
    assert_bit_identical(params_of(in_block), drained)


# ---- state_dict round trip in the middle of an interval ---------------------------------------------------------
# W=1, U=3, S=6: boundaries after steps 0, 3, 6, 9, 12, 15; reselections (which drain) at t = 1, 7, 13. Saving
# after 5, 8, 11 or 14 steps leaves 1 or 2 gradients accumulated; with overlap, after 5 and 11 a host result is
# also in flight (it must still be uploaded at the next boundary after the resume).
RESUME_BLOCK = dict(topk_ratio=0.25, update_interval=3, full_warm_up_rounds=1, select_interval=6)
TOTAL = 17


@pytest.mark.parametrize("stop_at", [5, 8, 11, 14])
@pytest.mark.parametrize("overlap", [False, True])
def test_state_dict_saved_mid_interval_resumes_bit_identically(feed, make_opt, overlap, stop_at):
    assert (stop_at - RESUME_BLOCK["full_warm_up_rounds"]) % RESUME_BLOCK["update_interval"] != 0  # mid-interval
    model = Interleaved([12, 10, 6], seed=6)
    grads = grad_stream(model, TOTAL, seed=7)
    block = dict(RESUME_BLOCK, overlap_step=overlap)

    reference = clone_model(model)
    opt = make_opt(reference, **copy.deepcopy(block))
    # step by step: a late upload shows before the final drain
    expected = feed(reference, opt, grads, record=True)[stop_at:]
    opt.drain()
    opt.close()

    saved_from = clone_model(model)
    opt = make_opt(saved_from, **copy.deepcopy(block))
    feed(saved_from, opt, grads[:stop_at])
    buffer = io.BytesIO()
    torch.save({"model": saved_from.state_dict(), "opt": opt.state_dict()}, buffer)  # a real serialisation
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=False)
    resumed = clone_model(model)  # fresh model and optimizer, as after a restart
    resumed.load_state_dict(checkpoint["model"])
    opt_resumed = make_opt(resumed, **copy.deepcopy(block))
    opt_resumed.load_state_dict(checkpoint["opt"])
    try:
        # saving must not change the run it was taken from
        continued = feed(saved_from, opt, grads[stop_at:], record=True)
        restarted = feed(resumed, opt_resumed, grads[stop_at:], record=True)
        opt.drain()
        opt_resumed.drain()
    finally:
        opt.close()
        opt_resumed.close()
    for step, (want, a, b) in enumerate(zip(expected, continued, restarted), start=stop_at):
        assert_bit_identical(a, want, f"continued run, step {step}")
        assert_bit_identical(b, want, f"resumed run, step {step}")
    assert_bit_identical(params_of(saved_from), params_of(reference), "continued run, after drain")
    assert_bit_identical(params_of(resumed), params_of(reference), "resumed run, after drain")
