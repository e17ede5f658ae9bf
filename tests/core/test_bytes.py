"""The bytes the optimizer moves per step equal docs/design.md §2's formula exactly."""

from __future__ import annotations

import pytest
import torch
from helpers import Interleaved, column_params, feed, grad_stream

from zenflow.selection import num_selected


def per_step(opt, model, steps, seed=0):
    before = opt.transfer_bytes
    feed(model, opt, grad_stream(model, steps, seed), zero_grad=False)
    after = opt.transfer_bytes
    return {key: (after.get(key, 0) - before.get(key, 0)) / steps for key in after}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("topk", [0.1, 0.25, 0.5])
@pytest.mark.parametrize("interval", [1, 2, 4])
def test_zenflow_moves_one_minus_r_times_one_plus_one_over_u_of_the_columns(zenflow_opt, dtype, topk, interval):
    model = Interleaved([40, 30, 20, 10], dtype=dtype, seed=0)
    opt = zenflow_opt(model, topk_ratio=topk, update_interval=interval)
    per_step(opt, model, 1)  # step 0 makes the first selection (moves master/moments, not grads/params)
    measured = per_step(opt, model, 3 * interval)
    b = torch.finfo(dtype).bits // 8
    expected = 0.0
    for p in column_params(model):
        out, width = p.shape
        r = num_selected(width, topk) / width  # the fraction actually selected for this param
        expected += (1 - r) * p.numel() * b * (1 + 1 / interval)
    assert measured[("d2h", "grads")] + measured[("h2d", "params")] == pytest.approx(expected, rel=1e-12)
    assert measured.get(("d2h", "master"), 0) == 0  # no reselection inside the window


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_offload_configuration_moves_two_n_b(zenflow_opt, dtype):
    model = Interleaved([40, 30, 20], dtype=dtype, seed=0)
    opt = zenflow_opt(model, topk_ratio=0.0, update_interval=1)
    measured = per_step(opt, model, 4)
    n = sum(p.numel() for p in column_params(model))
    b = torch.finfo(dtype).bits // 8
    assert measured[("d2h", "grads")] == n * b and measured[("h2d", "params")] == n * b


def test_warm_up_steps_move_everything_and_selection_moves_state_not_gradients(zenflow_opt):
    model = Interleaved([40, 30, 20], seed=0)
    opt = zenflow_opt(model, topk_ratio=0.1, update_interval=4, full_warm_up_rounds=2)
    warm = per_step(opt, model, 2)
    n = sum(p.numel() for p in column_params(model))
    assert warm[("d2h", "grads")] == warm[("h2d", "params")] == n * 4
    select = per_step(opt, model, 1)
    k_cols = sum(num_selected(p.shape[1], 0.1) * p.shape[0] for p in column_params(model))
    assert select[("h2d", "master")] == k_cols * 4 and select[("h2d", "moments")] == 2 * k_cols * 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_upcasting_accumulation_equals_a_plain_fp32_add(dtype):
    from zenflow.host import add_upcast_

    src = torch.randn(1000, 37).to(dtype)
    acc = torch.randn(1000, 37)
    expected = acc + src.float()
    add_upcast_(acc, src, chunk_elements=100)  # many chunks, a ragged last one
    assert torch.equal(acc, expected)
