"""Runs are deterministic (staleness is decided by step count, never timing) and resume is bit-exact."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from helpers import Interleaved, train_steps, zenflow

CONFIGS = {
    "sync": dict(topk_ratio=0.2, update_interval=3, select_interval=6, full_warm_up_rounds=2),
    "overlap": dict(topk_ratio=0.2, update_interval=3, select_interval=6, full_warm_up_rounds=2, overlap_step=True),
    "overlap-auto": dict(topk_ratio=0.2, update_interval="auto", select_interval=8, overlap_step=True),
}


def fresh(config: dict, dtype=torch.float32):
    model = Interleaved([10, 16, 12, 3], dtype=dtype, seed=7)
    return model, zenflow(model, **copy.deepcopy(config))


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("name", ["overlap", "overlap-auto"])
def test_two_overlap_runs_with_the_same_seed_are_bit_identical(name):
    results = []
    for _ in range(2):
        model, opt = fresh(CONFIGS[name])
        with opt:
            losses = train_steps(model, opt, 25, seed=3)
        results.append((losses, params_of(model)))
    assert results[0][0] == results[1][0]
    for a, b in zip(results[0][1], results[1][1]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("stop_at", [4, 7, 11])
def test_resume_from_state_dict_is_bit_identical(name, stop_at):
    total = 18
    model, opt = fresh(CONFIGS[name])
    with opt:
        train_steps(model, opt, total, seed=5)
    uninterrupted = params_of(model)

    model, opt = fresh(CONFIGS[name])
    train_steps(model, opt, stop_at, seed=5)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)  # a real checkpoint round trip
    opt.close(flush=False)

    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    model, opt = fresh(CONFIGS[name])
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    with opt:
        train_steps(model, opt, total - stop_at, seed=5, start=stop_at)
    for a, b in zip(uninterrupted, params_of(model)):
        assert torch.equal(a, b)


def test_state_dict_mid_run_does_not_change_the_run():
    model_a, opt_a = fresh(CONFIGS["overlap"])
    model_b, opt_b = fresh(CONFIGS["overlap"])
    for i in range(12):
        train_steps(model_a, opt_a, 1, seed=2, start=i)
        train_steps(model_b, opt_b, 1, seed=2, start=i)
        opt_b.state_dict()  # waits for the worker; must not upload early
    opt_a.close()
    opt_b.close()
    for a, b in zip(params_of(model_a), params_of(model_b)):
        assert torch.equal(a, b)


def test_lr_scheduler_drives_both_parts():
    model, opt = fresh(CONFIGS["sync"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.0 if step >= 3 else 1.0)
    for i in range(3):
        train_steps(model, opt, 1, seed=1, start=i)
        sched.step()
    opt.drain()
    frozen = params_of(model)
    for i in range(3, 9):
        train_steps(model, opt, 1, seed=1, start=i)
        sched.step()
    opt.drain()
    for a, b in zip(frozen, params_of(model)):  # lr 0: AdamW (decay included) moves nothing on either part
        assert torch.equal(a, b)
