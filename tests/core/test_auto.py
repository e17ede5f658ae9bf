"""The "auto" rules: update_interval="auto" trains without NaN and really performs host updates; the select
interval resolves as documented."""

from __future__ import annotations

import copy
import math
import random
import time

import pytest
import torch
from helpers import Interleaved, clone_model, firing_steps, grad_stream, train_steps

from zenflow import ZenFlowConfig
from zenflow.auto_interval import AUTO_LAG
from zenflow.config import AUTO_MAX_UPDATE_INTERVAL, AUTO_SELECT_INTERVAL_STEPS


@pytest.mark.parametrize("overlap", [False, True])
def test_auto_update_interval_trains_and_updates_the_host_part(zenflow_opt, overlap):
    model = Interleaved([16, 32, 32, 4], seed=0)
    w = model.net[0].weight
    opt = zenflow_opt(model, topk_ratio=0.1, update_interval="auto", select_interval="auto", overlap_step=overlap,
                  lr=3e-3)
    try:
        start = w.detach().clone()
        losses = train_steps(model, opt, 60, seed=1)
        opt.drain()
    finally:
        opt.close()
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-10:]) < sum(losses[:10])
    assert opt.host_updates >= 60 / AUTO_MAX_UPDATE_INTERVAL  # the auto rule fires (at least at its cap)
    host_cols = opt.state[w].host.cols
    assert not torch.equal(w.detach()[:, host_cols], start[:, host_cols])  # host-owned columns did move


def test_auto_update_fires_before_the_cap_when_unselected_mass_catches_up(zenflow_opt):
    model = Interleaved([16, 32, 4], seed=0)
    opt = zenflow_opt(model, topk_ratio=0.1, update_interval="auto", auto_ratio=0.5)
    train_steps(model, opt, 48, seed=2)
    assert opt.host_updates > 48 / AUTO_MAX_UPDATE_INTERVAL


def test_select_interval_auto_resolution():
    assert ZenFlowConfig(steps_per_epoch=250).resolved_select_interval() == 250
    assert ZenFlowConfig(select_strategy="epoch", select_interval=2, steps_per_epoch=100
                         ).resolved_select_interval() == 200
    assert ZenFlowConfig(update_interval=5).resolved_select_interval() == math.ceil(
        AUTO_SELECT_INTERVAL_STEPS / 5) * 5
    assert ZenFlowConfig(select_strategy="step", select_interval=8, update_interval=4
                         ).resolved_select_interval() == 8
    assert ZenFlowConfig().resolved_select_interval() == AUTO_SELECT_INTERVAL_STEPS


def test_no_nan_with_auto_everything_in_bf16(zenflow_opt):
    model = Interleaved([16, 24, 4], dtype=torch.bfloat16, seed=0)
    opt = zenflow_opt(model, update_interval="auto", lr=1e-3)
    losses = train_steps(model, opt, 20, seed=3)
    assert all(math.isfinite(x) for x in losses)


def _jittery(seed: int):
    """A HostWorker.before_job hook: the worker takes a random time per accumulation, so any timing-dependent
    decision would show."""
    rng = random.Random(seed)

    def jitter(kind: str) -> None:
        if kind == "accumulate":
            time.sleep(rng.uniform(0.0, 0.004))

    return jitter


def test_auto_fires_at_the_same_steps_in_sync_and_overlap_whatever_the_worker_timing(zenflow_opt):
    model = Interleaved([16, 32, 32, 4], seed=0)
    grads = grad_stream(model, 60, seed=5)
    block = dict(topk_ratio=0.1, update_interval="auto", full_warm_up_rounds=0)
    sync_model = clone_model(model)
    with zenflow_opt(sync_model, **block) as opt:
        sync_fired = firing_steps(opt, sync_model, grads)
    assert 60 / AUTO_MAX_UPDATE_INTERVAL < len(sync_fired) < 60  # the rule decides: neither the cap nor always
    for seed in range(3):
        overlap_model = clone_model(model)
        with zenflow_opt(overlap_model, overlap_step=True, **block) as opt:
            opt.worker.before_job = _jittery(seed)
            assert firing_steps(opt, overlap_model, grads) == sync_fired, f"worker timing seed {seed}"


@pytest.mark.parametrize("overlap", [False, True])
def test_auto_fires_exactly_when_the_unselected_mass_catches_up(zenflow_opt, overlap):
    """Constant gradients: selected columns 2.5, the others 1.0. The accumulated unselected RMS after m steps is
    m, so it catches up at m = 3, which the rule sees AUTO_LAG steps later: a boundary every 3 + AUTO_LAG steps."""
    layer = torch.nn.Linear(16, 8, bias=False)
    grad = torch.ones(8, 16)
    grad[:, :4] = 2.5  # the top 4 columns by norm: selected at topk_ratio 0.25
    opt = zenflow_opt(layer, topk_ratio=0.25, update_interval="auto", auto_ratio=1.0, full_warm_up_rounds=0,
                  overlap_step=overlap)
    with opt:
        fired = firing_steps(opt, layer, [[grad]] * 20)
    period = 3 + AUTO_LAG
    assert fired == [period * (i + 1) - 1 for i in range(20 // period)]
    assert opt.state[layer.weight].sel.tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("overlap", [False, True])
def test_auto_history_survives_a_checkpoint_taken_mid_interval(zenflow_opt, overlap):
    model = Interleaved([16, 32, 32, 4], seed=0)
    grads = grad_stream(model, 40, seed=6)
    block = dict(topk_ratio=0.1, update_interval="auto", full_warm_up_rounds=0, overlap_step=overlap)
    straight = clone_model(model)
    with zenflow_opt(straight, **block) as opt:
        fired = firing_steps(opt, straight, grads)
        opt.drain()
    cut = next(t for t in range(fired[1] + 1, fired[2]) if t - fired[1] > AUTO_LAG)  # mid-interval, history > lag
    first = clone_model(model)
    with zenflow_opt(first, **block) as opt:
        head = firing_steps(opt, first, grads[:cut])
        saved = copy.deepcopy(opt.state_dict())
        params = copy.deepcopy(first.state_dict())
    resumed = clone_model(model)
    resumed.load_state_dict(params)
    with zenflow_opt(resumed, **block) as opt:
        opt.load_state_dict(saved)
        tail = firing_steps(opt, resumed, grads[cut:])
        opt.drain()
    assert head + [t + cut for t in tail] == fired
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
