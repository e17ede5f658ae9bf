"""Weight decay is the same on the device and host parts, including when a DeepSpeed config omits it."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import Interleaved, clone_model

from zenflow import ZenFlowAdamW

LR = 1e-2


def ds_config(**optimizer_params) -> dict:
    return {"optimizer": {"type": "AdamW", "params": {"lr": LR, **optimizer_params}},
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                  "zenflow": {"topk_ratio": 0.25, "update_interval": 1, "select_interval": 100}}}


def zero_grad_steps(model, opt, steps):
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()


@pytest.mark.parametrize("weight_decay", [0.1, None])
def test_zero_gradients_decay_device_and_host_columns_alike(tmp_path, weight_decay):
    """With zero gradients AdamW only decays: every column, wherever it lives, is scaled by (1 - lr*wd)^t."""
    params = {} if weight_decay is None else {"weight_decay": weight_decay}
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ds_config(**params)))
    model = Interleaved([12, 8, 4], seed=0)
    before = clone_model(model)
    opt = ZenFlowAdamW.from_deepspeed_config(model.parameters(), path)
    zero_grad_steps(model, opt, 5)
    factor = (1 - LR * (weight_decay or 0.0)) ** 5
    for p, q in zip(model.parameters(), before.parameters()):
        torch.testing.assert_close(p.detach(), q.detach() * factor, rtol=1e-6, atol=0)
        if p.dim() == 2:  # both parts really exist in this configuration
            assert 0 < opt.state[p].sel.numel() < p.shape[1]


def test_omitted_weight_decay_is_zero_on_both_parts():
    model = Interleaved([6, 4], seed=0)
    opt = ZenFlowAdamW.from_deepspeed_config(model.parameters(), ds_config())
    assert opt.param_groups[0]["weight_decay"] == 0.0
