"""Differential tests against the installed DeepSpeed ZenFlow (0.19.8, CPU accelerator, gloo), and its divergences.

Every DeepSpeed run is a fresh subprocess (tests/support/ds_helpers.py, as the harness does); ours runs in-process on
the same job (same initial weights, batches, and DeepSpeed config dict through `ZenFlowAdamW.from_deepspeed_config`).

1. Differential (`test_differential_*`): DeepSpeed and ours agree step for step, sync and overlap, on a bias-free,
   norm-free fp32 model with explicit weight decay, integer intervals and warm-up >= 1: the same selected columns
   at every (re)selection and the same parameters after every step, within rounding. Two things are needed on top of
   docs/design.md §7's recipe, both found while writing these tests (G, H, I tested below; J read from the source):
   - DeepSpeed runs with its weight *view* repaired (G: 0.19.8 re-views its transposed flat buffer untransposed,
     so the module trains scrambled weights and the host update lands on the wrong elements; nothing agrees).
   - betas = (0, 0): AdamW without memory (update = -lr·g/(|g|+eps) - lr·wd·p), because DeepSpeed's moment
     bookkeeping differs from the contract: the host bias correction counts global steps (H), the device moments
     restart from zero at every (re)selection (I), and overlap keeps two host moment sets, one per double buffer,
     so each sees every other host update (J: `exp_avg[now_state]` in csrc/adam/cpu_adam_impl.cpp's ZenFlowAdam).
     Everything else is still checked: warm-up, selection (scores, k, timing), which part owns which column,
     boundaries, the mean over U accumulated gradients, weight decay on both parts, overlap staleness.
2. One test per DeepSpeed divergence A-F of docs/design.md §7 (and G, H+I found here), each asserting DeepSpeed's actual
   behaviour (so it fails when DeepSpeed changes it) and, where meaningful, that ours does the right thing on the
   same input. D is already fixed in 0.19.8: that test asserts what DeepSpeed does now.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from ds_helpers import build_model, ds_config, host_result_landed, make_job, run_deepspeed, run_ours

pytestmark = [
    pytest.mark.deepspeed,
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed"),
]

MODEL = {"widths": [32, 64, 64, 16]}  # bias-free, norm-free fp32: avoids C
# topk_ratio · in is an integer for every weight (k = 8, 16, 16): DeepSpeed's max(1, int(r·in)) and our
# ceil(r·in) then agree.
TOPK = 0.25
# DeepSpeed scores a column by the L1 norm of its gradient (sum |g|); ours defaults to L2. `column_norm` is ours
# only (DeepSpeed's pydantic model rejects unknown keys), so it is added to our copy of the zenflow block.
OURS = {"column_norm": "l1"}
# Tolerance of the differential, absolute on parameters of magnitude < 0.5 (lr = 1e-3). DeepSpeed's host update is
# its AVX CPU Adam kernel, its device update a copy of torch's for-each AdamW, and its forward/backward runs on a
# transposed view of each weight (another matmul summation order); ours is torch's fused AdamW on a contiguous
# weight. Each step rounds differently by about one ulp of |p| (<= 3e-8), so the gap grows by ~1e-8 per step
# (measured: 7.5e-8 after 16 steps). A semantic difference moves an element by a whole update, ~lr = 1e-3.
TOL = 1e-6
# DeepSpeed divides the loss by gradient_accumulation_steps (= update_interval) before backward; AdamW is
# scale-invariant except through eps, so a negligible eps keeps that from showing (eps = 1e-8 shows as 3e-7).
EPS = 1e-16


def zenflow_block(**kw) -> dict:
    block = dict(topk_ratio=TOPK, select_strategy="step", select_interval=1000, update_interval=2,
                 full_warm_up_rounds=2, overlap_step=False)
    block.update(kw)
    return block


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def weights_sel(trace: dict, t: int) -> list[torch.Tensor]:
    """Selected columns of every column param after step t."""
    return [s for s in trace["sel"][t] if s is not None]


# ---- module-scoped runs (one DeepSpeed subprocess each, shared by the tests that read them) -------------------
@pytest.fixture(scope="module")
def diff_sync():
    """W = S = 4, U = 2: warm-up 0-3; selections at 4, 8, 12 (DeepSpeed reselects when t % S == 0, ours when
    (t - W) % S == 0: the same steps when S divides W); host boundaries at 5, 7, ..., 15."""
    block = zenflow_block(select_interval=4, full_warm_up_rounds=4)
    job = make_job(ds_config(block, betas=(0.0, 0.0), eps=EPS), MODEL, steps=16, probes=("host_steps",),
                   repair_layout=True)
    return job, run_deepspeed(job), run_ours(job, OURS)


@pytest.fixture(scope="module")
def diff_overlap():
    """overlap_step, W = U = 2 (W a multiple of U: DeepSpeed picks the double buffer by (t // U) & 1), one
    selection (DeepSpeed does not wait for the in-flight host update before a reselection)."""
    block = zenflow_block(overlap_step=True, full_warm_up_rounds=2)
    job = make_job(ds_config(block, betas=(0.0, 0.0), eps=EPS), MODEL, steps=12, repair_layout=True)
    return job, run_deepspeed(job), run_ours(job, OURS)


# ---- 1. differential ---------------------------------------------------------------------------------------------
def check_differential(job: dict, ds: dict, ours: dict) -> float:
    assert ds["error"] is None, ds["error"]
    warm_up = job["config"]["zero_optimization"]["zenflow"]["full_warm_up_rounds"]
    assert all(torch.equal(a, b) for a, b in zip(ds["params0"], job["init"].values())), "not the same start"
    worst = 0.0
    for t in range(job["steps"]):
        worst = max(worst, max_diff(ds["params"][t], ours["params"][t]))
        torch.testing.assert_close(ds["params"][t], ours["params"][t], rtol=0, atol=TOL, msg=f"params, step {t}")
        if t >= warm_up:
            for name, a, b in zip(ds["names"], ds["sel"][t], ours["sel"][t]):
                assert torch.equal(a, b), f"selected columns of {name}, step {t}: {a.tolist()} vs {b.tolist()}"
    return worst


def test_differential_sync(diff_sync):
    """Sync: same selections (3 of them, sets changing), same parameters after each of 16 steps (10 boundaries)."""
    job, ds, ours = diff_sync
    worst = check_differential(job, ds, ours)
    assert [t for t, b in enumerate(ds["boundary"]) if b] == [0, 1, 2, 3, 5, 7, 9, 11, 13, 15]
    assert ours["host_updates"] == 10
    changed = [not all(torch.equal(a, b) for a, b in zip(weights_sel(ds, t), weights_sel(ds, t + 4)))
               for t in (4, 8)]
    assert any(changed), "the reselections picked the same columns: the comparison would not cover reselection"
    print(f"sync differential: max |DeepSpeed - ours| = {worst:.2e} (tolerance {TOL:.0e})")


def test_differential_overlap(diff_overlap):
    """overlap_step: same host staleness (each result lands one boundary late), same parameters every step."""
    job, ds, ours = diff_overlap
    worst = check_differential(job, ds, ours)
    boundaries = [t for t, b in enumerate(ds["boundary"]) if b]
    assert boundaries == [0, 1, 3, 5, 7, 9, 11]
    landed = host_result_landed(ds, ds["params0"])
    # warm-up lands inline (0, 1); after it, the result of boundary b lands at boundary b+1: 3's at 5, ...
    assert [t for t, x in enumerate(landed) if x] == [0, 1, 5, 7, 9, 11]
    assert landed == host_result_landed(ours, list(job["init"].values()))
    print(f"overlap differential: max |DeepSpeed - ours| = {worst:.2e} (tolerance {TOL:.0e})")


# ---- 2. divergences ------------------------------------------------------------------------------------------
def test_divergence_A_auto_update_interval_gives_nan():
    """A: `update_interval: "auto"` sets gradient_accumulation_steps to 0; `engine.backward` divides the loss by
    it, so step 0's gradients are infinite, its update writes NaN, and the loss of step 1 is NaN.
    Ours: "auto" is a documented rule (docs/step-semantics.md); the same job trains with finite values."""
    job = make_job(ds_config(zenflow_block(update_interval="auto", full_warm_up_rounds=0)), MODEL, steps=3)
    ds = run_deepspeed(job)
    assert ds["gas"] == 0
    assert torch.isfinite(torch.tensor(ds["loss"][0])) and torch.isnan(torch.tensor(ds["loss"][1:])).all()
    assert not all(torch.isfinite(p).all() for p in ds["params"][0]), "step 0 should write non-finite weights"
    ours = run_ours(job, OURS)
    assert all(torch.isfinite(torch.tensor(x)) for x in ours["loss"])
    assert all(torch.isfinite(p).all() for p in ours["params"][-1])


def test_divergence_B_auto_update_never_fires():
    """B: with `update_interval: "auto"` the host update never fires after warm-up. Each backward toggles
    `zenflow_state` to s and the rule may set `zenflow_need_update[s]`; the engine's boundary check then reads
    entry s ^ 1, which `backward_prologue` cleared at the start of this step, and the next `backward_prologue`
    clears entry s before anything reads it. The NaN of A is sidestepped with
    `engine.backward(loss, scale_wrt_gas=False)`, so the gradients are finite here.
    Ours: the same job fires host updates (at the latest every max_update_interval steps)."""
    block = zenflow_block(update_interval="auto", full_warm_up_rounds=1)
    job = make_job(ds_config(block), MODEL, steps=24, probes=("host_steps",), scale_wrt_gas=False)
    ds = run_deepspeed(job)
    assert ds["error"] is None and all(torch.isfinite(p).all() for p in ds["params"][-1])
    assert ds["host_step_ids"] == [1], "only the warm-up step reached the host optimizer"
    assert [t for t, b in enumerate(ds["boundary"]) if b] == [0]
    raised = sum(any(flags) for flags in ds["need_update"][1:])
    assert raised > 0, "the rule never asked for an update: this run would not show the flag being ignored"
    ours = run_ours(job, OURS)
    assert ours["host_updates"] >= 3, ours["host_updates"]
    print(f"B: DeepSpeed's rule asked for a host update after {raised} of {job['steps'] - 1} post-warm-up steps, "
          f"it ran 0; ours ran {ours['host_updates'] - 1}")


def test_divergence_C_selection_windows_shifted_by_1d_params():
    """C: stage 1/2 selection walks the gradient bucket with an offset that skips 1-D params, so each weight's
    column window is shifted by the 1-D params (biases, norms) that precede it in the bucket. DeepSpeed's picks
    equal exactly the top-k of those shifted windows, not of the weight's own columns.
    Ours, from the same weights on the same batch, picks the true top-k (L1, as DeepSpeed means to)."""
    model = {"widths": [32, 64, 64, 16], "bias": True, "norm": True}
    job = make_job(ds_config(zenflow_block(update_interval=1, full_warm_up_rounds=0)), model, steps=1,
                   probes=("select_input",))
    ds = run_deepspeed(job)
    bucket = ds["select_input"][0]
    params, names = ds["params0"], ds["names"]
    assert params[bucket["order"][0]].dim() == 1, "a 1-D param comes first in the bucket"
    truth, shifted = {}, {}
    true_offset = skipping_offset = 0
    for i in bucket["order"]:
        numel = params[i].numel()
        if params[i].dim() == 2:
            out, inp = params[i].shape
            k = max(1, int(TOPK * inp))
            for offset, picks in ((true_offset, truth), (skipping_offset, shifted)):
                scores = bucket["flat"][offset:offset + numel].view(inp, out).abs().sum(1)  # columns are contiguous
                picks[i] = torch.topk(scores, k).indices.sort().values
            skipping_offset += numel
        true_offset += numel
    ours = run_ours(job, OURS, init=params)  # the weights DeepSpeed started from (see G)
    for i in truth:
        assert torch.equal(ds["sel"][0][i], shifted[i]), names[i]
        assert not torch.equal(ds["sel"][0][i], truth[i]), f"{names[i]}: DeepSpeed picked the true columns"
        assert torch.equal(ours["sel"][0][i], truth[i]), names[i]
    overlap = {names[i]: f"{len(set(ds['sel'][0][i].tolist()) & set(truth[i].tolist()))}/{truth[i].numel()}"
               for i in truth}
    print(f"C: DeepSpeed's picks that are true top-k columns: {overlap}")


def test_divergence_D_device_step_counter_is_fp32_in_0_19_8():
    """D (fixed in 0.19.8, so this asserts what DeepSpeed does now): docs/design.md §7 says the device optimizer's step
    counter has the param dtype, so in bf16 it sticks at 256 (256 + 1 == 256 in bf16) and bias correction freezes.
    In 0.19.8 ZenFlowSelectiveAdamW creates `state["step"]` as an fp32 tensor (and upcasts bf16 ones on load):
    after 300 bf16 steps (1 warm-up) it reads exactly 299. Related, still true: the device part updates the bf16
    weight in place with bf16 moments (no fp32 master, unlike docs/design.md §2)."""
    assert torch.tensor(256.0, dtype=torch.bfloat16) + 1 == 256  # what a bf16 counter would do
    model = {"widths": [16, 16, 8], "dtype": "bfloat16"}
    job = make_job(ds_config(zenflow_block(update_interval=1, full_warm_up_rounds=1), bf16={"enabled": True}),
                   model, steps=300, probes=("device_state",))
    ds = run_deepspeed(job)
    assert ds["error"] is None
    assert ds["device_step"] == [("torch.float32", 299.0)] * 2
    assert set(ds["device_moment_dtype"]) == {"torch.bfloat16"}


def test_divergence_E_weight_decay_omitted():
    """E: with `weight_decay` omitted, DeepSpeed's device part (torch AdamW's default) decays by 0.01 while the
    host part (DeepSpeedCPUAdam's default) uses 0. One memoryless step (betas 0, layout repaired) shows it in the
    numbers: DeepSpeed's host-owned columns equal ours exactly; its selected columns are additionally shrunk by
    lr·0.01·p. Ours: omitted means 0 on both parts (zenflow/config.py)."""
    lr = 0.05
    block = zenflow_block(update_interval=1, full_warm_up_rounds=0)
    job = make_job(ds_config(block, lr=lr, betas=(0.0, 0.0), eps=EPS, weight_decay=None), MODEL, steps=1,
                   probes=("device_state",), repair_layout=True)
    ds = run_deepspeed(job)
    assert ds["device_weight_decay"] == [0.01] and ds["host_weight_decay"] == [0]
    ours = run_ours(job, OURS)
    for p0, a, b, sel in zip(ds["params0"], ds["params"][0], ours["params"][0], ours["sel"][0]):
        host = torch.ones(p0.shape[1], dtype=torch.bool)
        host[sel] = False
        torch.testing.assert_close(a[:, host], b[:, host], rtol=0, atol=TOL)
        big = p0[:, sel].abs() > 0.02
        decay = ((b - a)[:, sel] / (lr * p0[:, sel]))[big]  # ours - DeepSpeed = lr · wd · p on the device part
        torch.testing.assert_close(decay, torch.full_like(decay, 0.01), rtol=0, atol=1e-3)


def test_divergence_F_overlap_warmup0_first_host_result_at_third_boundary():
    """F: overlap_step with full_warm_up_rounds 0: DeepSpeed's `first_update_round_after_warmup` skips the wait
    at the 2nd boundary (meant for the first boundary after a warm-up), so nothing lands there and the 1st host
    result lands at the 3rd boundary. The skipped wait is drained later (`done` is a counting semaphore), so from
    then on each boundary waits for the job before the one it copies: the copy reads whatever the worker has
    written by then (here, a small model, the worker is always done). Ours: lands at the 2nd boundary, then one
    interval late at every boundary, by step count."""
    block = zenflow_block(overlap_step=True, full_warm_up_rounds=0)
    job = make_job(ds_config(block), MODEL, steps=10)
    ds = run_deepspeed(job)
    assert ds["error"] is None
    boundaries = [t for t, b in enumerate(ds["boundary"]) if b]
    assert boundaries == [1, 3, 5, 7, 9]
    ds_landed = [t for t, x in enumerate(host_result_landed(ds, ds["params0"])) if x]
    assert ds_landed == boundaries[2:]
    ours = run_ours(job, OURS, init=ds["params0"])
    ours_landed = [t for t, x in enumerate(host_result_landed(ours, ds["params0"])) if x]
    assert ours_landed == boundaries[1:]


def test_divergence_G_weights_viewed_untransposed():
    """G (docs/design.md §7): ZenFlow stage 1/2 flattens each weight W[out, in] transposed (so a column is
    contiguous) and lays the gradients out the same way, but `_update_model_bit16_weights` re-views the flat
    buffer as [out, in] without transposing. (1) At `deepspeed.initialize` every weight becomes W.T's memory read
    as [out, in] (a pretrained model is scrambled). (2) The host update applies the gradient of element (i, j) to
    the element stored at (i, j)'s transposed offset. One warm-up step (pure host, betas 0, so the update is
    -lr·sign(g)) shows it. Ours, from the same weights, applies -lr·sign(g) to the right elements."""
    lr = 1e-3
    block = zenflow_block(update_interval=1, full_warm_up_rounds=1)
    model = {"widths": [32, 64, 16]}
    job = make_job(ds_config(block, lr=lr, betas=(0.0, 0.0), eps=EPS, weight_decay=0.0), model, steps=1)
    ds = run_deepspeed(job)
    init = list(job["init"].values())
    for w, p0 in zip(init, ds["params0"]):
        assert not torch.equal(p0, w)
        assert torch.equal(p0, w.t().contiguous().view(w.shape))
    net = build_model(model)
    with torch.no_grad():
        for p, p0 in zip(net.parameters(), ds["params0"]):
            p.copy_(p0)
    (net(job["xs"][0]) - job["ys"][0]).pow(2).mean().backward()
    ours = run_ours(job, OURS, init=ds["params0"])
    for p, p0, p1, mine in zip(net.parameters(), ds["params0"], ds["params"][0], ours["params"][0]):
        g = p.grad
        misplaced = g.t().contiguous().view(g.shape)  # gradient element at the transposed offset
        torch.testing.assert_close(p1 - p0, -lr * misplaced.sign(), rtol=0, atol=TOL)
        assert ((p1 - p0) - (-lr * g.sign())).abs().max() > lr
        torch.testing.assert_close(mine - p0, -lr * g.sign(), rtol=0, atol=TOL)


def test_divergence_H_I_moment_bookkeeping():
    """With real betas (0.9, 0.999) and the layout repaired, DeepSpeed and ours agree through warm-up and pick the
    same columns at the first selection, then part (well beyond rounding) because of DeepSpeed's bookkeeping:
    H (docs/design.md §7): the host AdamW's bias correction uses the global step number (`step_id = micro_step + 1`:
      1, 2, 3, 4, 6, 8 for W = 4, U = 2), not the number of host updates (ours: 1..6).
    I (docs/design.md §7): at the first selection the device part starts from zero moments and
      step 0, dropping the warm-up history of the selected columns; its step counter then reads steps - W.
      Ours carries the columns' moments and step count over (a topk_ratio=1 run is exactly AdamW)."""
    steps, warm_up = 8, 4
    block = zenflow_block(full_warm_up_rounds=warm_up)
    job = make_job(ds_config(block, eps=EPS), MODEL, steps=steps, probes=("host_steps", "device_state"),
                   repair_layout=True)
    ds = run_deepspeed(job)
    ours = run_ours(job, OURS)
    for t in range(warm_up):
        torch.testing.assert_close(ds["params"][t], ours["params"][t], rtol=0, atol=TOL, msg=f"warm-up step {t}")
    assert all(torch.equal(a, b) for a, b in zip(weights_sel(ds, warm_up), weights_sel(ours, warm_up)))
    gap = max_diff(ds["params"][warm_up], ours["params"][warm_up])
    assert gap > 100 * TOL, gap
    assert ds["host_step_ids"] == [1, 2, 3, 4, 6, 8]
    assert ours["host_updates"] == 6
    assert [s for _, s in ds["device_step"]] == [steps - warm_up] * 3
    assert ours["d_step"] == [steps] * 3
    print(f"H/I: warm-up agrees within {TOL:.0e}; first device step differs by {gap:.2e}")
