"""Selection is the true per-parameter top-k by column norm, whatever precedes a weight in parameter order."""

from __future__ import annotations

import pytest
import torch
from helpers import Interleaved, grad_stream, set_grads

from zenflow.selection import BLOCK_ROWS, column_scores, column_sums, complement, num_selected, select_columns


def brute_force_topk(grad: torch.Tensor, k: int, norm: str) -> list[int]:
    cols = grad.float().reshape(grad.shape[0], -1)
    scores = [(cols[:, j].norm().item() if norm == "l2" else cols[:, j].abs().sum().item(), j)
              for j in range(cols.shape[1])]
    return sorted(j for _, j in sorted(scores, reverse=True)[:k])


@pytest.mark.parametrize("norm", ["l2", "l1"])
@pytest.mark.parametrize("ratio", [0.05, 0.1, 0.37, 1.0])
def test_selection_is_per_parameter_topk_with_1d_params_before_each_weight(zenflow_opt, norm, ratio):
    model = torch.nn.Module()
    # 1-D params deliberately registered before every weight (DeepSpeed's flat-bucket windows shift here)
    model.b0 = torch.nn.Parameter(torch.randn(40))
    model.w0 = torch.nn.Parameter(torch.randn(40, 30))
    model.g1 = torch.nn.Parameter(torch.randn(17))
    model.w1 = torch.nn.Parameter(torch.randn(17, 40))
    model.w2 = torch.nn.Parameter(torch.randn(5, 3, 2, 2))  # conv-like: columns are the flattened rest
    grads = grad_stream(model, 1, seed=11)[0]
    set_grads(model, grads)
    opt = zenflow_opt(model, topk_ratio=ratio, update_interval=1, column_norm=norm)
    opt.step()
    for p, g in zip(model.parameters(), grads):
        if p.dim() < 2:
            continue
        width = g.reshape(g.shape[0], -1).shape[1]
        k = num_selected(width, ratio)
        assert opt.state[p].sel.tolist() == brute_force_topk(g, k, norm)
        assert sorted(opt.state[p].host.offloaded_cols.tolist()) == sorted(
            set(range(width)) - set(brute_force_topk(g, k, norm)))


@pytest.mark.parametrize("norm", ["l2", "l1"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_blocked_column_scores_are_the_fp32_norms_over_every_row(norm, dtype):
    """The CPU sums a block of rows at a time: over several blocks and a ragged last one, every column's score is
    its norm to fp32 rounding (a float64 reference), and the top-k it picks is the brute force's."""
    rows = 3 * BLOCK_ROWS + 5
    gen = torch.Generator().manual_seed(5)
    scale = torch.linspace(0.5, 2.0, 48)[torch.randperm(48, generator=gen)]  # well-separated column norms
    g = (torch.randn(rows, 48, generator=gen) * scale).to(dtype)
    exact = g.double().square().sum(0).sqrt() if norm == "l2" else g.double().abs().sum(0)
    scores = column_scores(g, norm)
    assert scores.dtype == torch.float32
    torch.testing.assert_close(scores.double(), exact, rtol=2e-6, atol=0)  # fp32 sums of 197 terms: ~1e-7 each
    assert select_columns(g, 9, norm).tolist() == brute_force_topk(g, 9, norm)
    assert torch.equal(column_sums(torch.empty(0, 7), norm), torch.zeros(7))  # an FSDP2 rank without rows
    with pytest.raises(ValueError, match=r"column_norm = 'linf' is not allowed: expected 'l2' or 'l1'"):
        column_sums(g, "linf")


def test_k_is_ceil_of_ratio_times_width():
    assert [num_selected(10, r) for r in (0.0, 0.01, 0.1, 0.11, 0.5, 1.0)] == [0, 1, 1, 2, 5, 10]
    assert num_selected(4096, 0.1) == 410


def test_complement_and_select_are_sorted_and_disjoint():
    g = torch.randn(6, 50)
    sel = select_columns(g, 7)
    rest = complement(sel, 50)
    assert torch.equal(sel, sel.sort().values) and torch.equal(rest, rest.sort().values)
    assert sorted(sel.tolist() + rest.tolist()) == list(range(50))


def test_reselection_moves_values_and_moments_so_no_state_is_lost(zenflow_opt, feed):
    """Columns change owner every interval; values and moments follow them (a column that left the device and
    came back continues from where it was, bias-corrected moments preserved at the move)."""
    model = Interleaved([12, 10, 6], seed=2)
    opt = zenflow_opt(model, topk_ratio=0.25, update_interval=2, select_interval=2)
    grads = grad_stream(model, 12, seed=4)
    w = model.net[0].weight
    feed(model, opt, grads[:6], zero_grad=False)
    opt.drain()
    st = opt.state[w]
    part = st.host
    # master copies agree with the parameter column by column, wherever each column lives
    torch.testing.assert_close(st.d_master, w.detach()[:, st.sel], rtol=0, atol=0)
    host_cols = part.offloaded_cols  # whole rows: not the shadows of the selected columns
    torch.testing.assert_close(part.offloaded(part.master), w.detach()[:, host_cols], rtol=0, atol=0)
    # every column has nonzero second moments (state carried over, never reset to zero)
    v = torch.zeros(w.shape[1])
    v[st.sel] = st.d_exp_avg_sq.abs().sum(0)
    v[host_cols] = part.offloaded(part.exp_avg_sq).abs().sum(0)
    assert (v > 0).all()
