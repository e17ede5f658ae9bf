"""The "auto" rules: update_interval="auto" trains without NaN and really performs host updates; the select
interval resolves as documented."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import Interleaved, train_steps, zenflow

from zenflow import ZenFlowConfig
from zenflow.config import AUTO_MAX_UPDATE_INTERVAL, AUTO_SELECT_INTERVAL_STEPS


@pytest.mark.parametrize("overlap", [False, True])
def test_auto_update_interval_trains_and_updates_the_host_part(overlap):
    model = Interleaved([16, 32, 32, 4], seed=0)
    w = model.net[0].weight
    opt = zenflow(model, topk_ratio=0.1, update_interval="auto", select_interval="auto", overlap_step=overlap,
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
    host_cols = opt.state[w]["host"].cols
    assert not torch.equal(w.detach()[:, host_cols], start[:, host_cols])  # host-owned columns did move


def test_auto_update_fires_before_the_cap_when_unselected_mass_catches_up():
    model = Interleaved([16, 32, 4], seed=0)
    opt = zenflow(model, topk_ratio=0.1, update_interval="auto", auto_ratio=0.5)
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


def test_no_nan_with_auto_everything_in_bf16():
    model = Interleaved([16, 24, 4], dtype=torch.bfloat16, seed=0)
    opt = zenflow(model, update_interval="auto", lr=1e-3)
    losses = train_steps(model, opt, 20, seed=3)
    assert all(math.isfinite(x) for x in losses)
