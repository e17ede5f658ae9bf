"""docs/design.md §2's exact oracles: degenerate ZenFlow configs equal torch.optim.AdamW (fp32, within rounding)."""

from __future__ import annotations

import pytest
import torch
from helpers import Interleaved, clone_model, grad_stream, set_grads
from hypothesis import given, settings
from hypothesis import strategies as st

LR, WD = 1e-2, 0.1
TOL = dict(rtol=1e-6, atol=1e-7)

widths = st.lists(st.integers(min_value=1, max_value=12), min_size=3, max_size=5)


def reference(model: torch.nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, fused=True)


def assert_same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(q, p, **TOL, msg=lambda m, n=name: f"{n}: {m}")


@settings(max_examples=12, deadline=None)
@given(widths=widths, seed=st.integers(0, 10_000), warm=st.integers(0, 3), interval=st.integers(1, 4),
       overlap=st.booleans())
def test_topk_one_is_adamw_every_step(zenflow_opt, feed, widths, seed, warm, interval, overlap):
    model = Interleaved(widths, seed=seed)
    ours, ref = clone_model(model), clone_model(model)
    grads = grad_stream(model, 9, seed)
    opt = zenflow_opt(ours, topk_ratio=1.0, update_interval=interval, full_warm_up_rounds=warm, overlap_step=overlap)
    feed(ours, opt, grads)
    feed(ref, reference(ref), grads)
    opt.close()
    assert_same(ref, ours)


@settings(max_examples=12, deadline=None)
@given(widths=widths, seed=st.integers(0, 10_000))
def test_topk_zero_interval_one_sync_is_zero_offload_is_adamw(zenflow_opt, feed, widths, seed):
    model = Interleaved(widths, seed=seed)
    ours, ref = clone_model(model), clone_model(model)
    grads = grad_stream(model, 7, seed)
    opt = zenflow_opt(ours, topk_ratio=0.0, update_interval=1, select_interval=1)
    feed(ours, opt, grads)
    feed(ref, reference(ref), grads)
    assert_same(ref, ours)


def interval_reference(model: torch.nn.Module, grads, interval: int, eps: float = 1e-8) -> list[list[torch.Tensor]]:
    """AdamW every `interval` steps on the mean gradient for weights; every step for biases and norms.
    Returns the parameters after each boundary."""
    columns = [p for p in model.parameters() if p.dim() >= 2]
    dense = [p for p in model.parameters() if p.dim() < 2]
    col_opt = torch.optim.AdamW(columns, lr=LR, weight_decay=WD, eps=eps, fused=True)
    dense_opt = torch.optim.AdamW(dense, lr=LR, weight_decay=WD, eps=eps, fused=True)
    sums = [torch.zeros_like(p) for p in columns]
    after_boundary = []
    for t, g in enumerate(grads):
        set_grads(model, g)
        dense_opt.step()
        for s, p in zip(sums, columns):
            s.add_(p.grad)
        if (t + 1) % interval == 0:
            for s, p in zip(sums, columns):
                p.grad = s / interval
                s.zero_()
            col_opt.step()
            after_boundary.append([p.detach().clone() for p in model.parameters()])
    return after_boundary


@settings(max_examples=10, deadline=None)
@given(widths=widths, seed=st.integers(0, 10_000), interval=st.integers(2, 4))
def test_topk_zero_sync_is_adamw_every_interval_on_mean_gradient(zenflow_opt, feed, widths, seed, interval):
    model = Interleaved(widths, seed=seed)
    ours, ref = clone_model(model), clone_model(model)
    grads = grad_stream(model, 3 * interval, seed)
    opt = zenflow_opt(ours, topk_ratio=0.0, update_interval=interval)
    feed(ours, opt, grads)
    interval_reference(ref, grads, interval)
    assert_same(ref, ours)


@pytest.mark.parametrize("interval", [2, 3, 4])
def test_the_interval_mean_divides_the_sum_by_the_count(zenflow_opt, feed, interval):
    """AdamW is blind to a constant scale of its gradients (m / sqrt(v)), so the oracle above cannot see a wrong
    divisor of the interval's mean (the fused kernel divides as it reads). With eps near the gradients' size the
    update depends on their scale, and only the true mean matches."""
    model = Interleaved([7, 5, 9], seed=interval)
    ours, ref = clone_model(model), clone_model(model)
    grads = grad_stream(model, 3 * interval, seed=interval)
    opt = zenflow_opt(ours, topk_ratio=0.0, update_interval=interval, eps=0.5)
    feed(ours, opt, grads)
    interval_reference(ref, grads, interval, eps=0.5)
    assert_same(ref, ours)


@settings(max_examples=8, deadline=None)
@given(widths=widths, seed=st.integers(0, 10_000), interval=st.integers(1, 3))
def test_topk_zero_overlap_applies_each_host_update_exactly_one_interval_late(zenflow_opt, widths, seed, interval):
    model = Interleaved(widths, seed=seed)
    ours = clone_model(model)
    boundaries = 4
    grads = grad_stream(model, boundaries * interval, seed)
    expected = interval_reference(clone_model(model), grads, interval)
    opt = zenflow_opt(ours, topk_ratio=0.0, update_interval=interval, overlap_step=True)
    try:
        for t, g in enumerate(grads):
            set_grads(ours, g)
            opt.step()
            opt.zero_grad()
            if (t + 1) % interval == 0 and t + 1 > interval:
                b = (t + 1) // interval - 1  # boundary just reached; its own result is still in flight
                for p, late, now in zip(ours.parameters(), expected[b - 1], expected[b]):
                    if p.dim() >= 2:
                        torch.testing.assert_close(p.detach(), late, **TOL)  # result of boundary b-1 ...
                        assert not torch.equal(p.detach(), now)  # ... and not yet that of boundary b
        opt.drain()
        for p, q in zip(ours.parameters(), expected[-1]):
            if p.dim() >= 2:
                torch.testing.assert_close(p.detach(), q, **TOL)
    finally:
        opt.close()


@pytest.mark.parametrize("topk", [0.1, 0.5])
@pytest.mark.parametrize("overlap", [False, True])
def test_first_warm_up_steps_of_any_config_are_adamw(zenflow_opt, feed, topk, overlap):
    model = Interleaved([9, 7, 5, 3], seed=3)
    ours, ref = clone_model(model), clone_model(model)
    grads = grad_stream(model, 5, seed=3)
    opt = zenflow_opt(ours, topk_ratio=topk, update_interval=2, full_warm_up_rounds=5, overlap_step=overlap)
    feed(ours, opt, grads)
    feed(ref, reference(ref), grads)
    opt.close()
    assert_same(ref, ours)


def test_selected_columns_follow_adamw_when_everything_else_is_frozen(zenflow_opt, feed):
    """Mixed case: with zero gradient (and no decay) on unselected columns, the selected ones are plain AdamW."""
    model = Interleaved([10, 8, 4], seed=5)
    ours = clone_model(model)
    opt = zenflow_opt(ours, topk_ratio=0.3, update_interval=2, weight_decay=0.0, lr=LR)
    gen = torch.Generator().manual_seed(1)
    hot = {id(p): torch.randperm(p.shape[1], generator=gen)[: -(-3 * p.shape[1] // 10)]
           for p in ours.parameters() if p.dim() == 2}
    ref_model = clone_model(model)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=LR, weight_decay=0.0, fused=True)
    for _ in range(6):
        grads = []
        for p in ours.parameters():
            g = torch.randn(p.shape, generator=gen)
            if p.dim() == 2:
                mask = torch.zeros(p.shape[1], dtype=torch.bool)
                mask[hot[id(p)]] = True
                g = g * mask * 10  # only the hot columns carry gradient, so they are the top-k
            grads.append(g)
        feed(ours, opt, [grads])
        feed(ref_model, ref, [grads])
    assert_same(ref_model, ours)
