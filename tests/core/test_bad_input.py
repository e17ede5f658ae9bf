"""Bad input is refused up front with a ConfigError naming the field, the bad value and what is allowed.

One table (CASES) drives two tests: every case raises the expected message, and no failed construction leaves a
host worker thread or a changed CPU affinity behind. After the table: the neighbouring valid inputs are accepted, a
failed load_state_dict changes nothing, and a Conv2d (a >2-D weight, viewed as [out, prod(rest)]) trains exactly.
"""

from __future__ import annotations

import copy
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from zenflow import ConfigError, ZenFlowAdamW

Build = Callable[[Path], Any]


# ---- builders ---------------------------------------------------------------------------------------------------
def linear() -> torch.nn.Linear:
    return torch.nn.Linear(4, 3)


def zf(**block: Any) -> Build:
    """ZenFlowAdamW(params, zenflow=block)."""
    return lambda tmp_path: ZenFlowAdamW(linear().parameters(), zenflow=block)


def hyper(**kwargs: Any) -> Build:
    """ZenFlowAdamW(params, lr=..., betas=..., ...) with a valid zenflow block."""
    return lambda tmp_path: ZenFlowAdamW(linear().parameters(), zenflow={"update_interval": 1}, **kwargs)


def with_params(params: Callable[[], list], **block: Any) -> Build:
    return lambda tmp_path: ZenFlowAdamW(params(), zenflow=block)


def ds_config(zenflow: Any = None, offload: Any = "cpu", **top: Any) -> dict[str, Any]:
    """A valid DeepSpeed config (ZeRO-2, CPU offload, zenflow) with top-level sections replaced by `top`."""
    zero: dict[str, Any] = {"stage": 2, "zenflow": {"topk_ratio": 0.5} if zenflow is None else zenflow}
    if offload is not None:
        zero["offload_optimizer"] = {"device": offload, "pin_memory": True}
    return {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
            "zero_optimization": zero, **top}


def adamw_params(**params: Any) -> dict[str, Any]:
    return {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, **params}}}


def ds(config: Any) -> Build:
    """ZenFlowAdamW.from_deepspeed_config(params, dict)."""
    return lambda tmp_path: ZenFlowAdamW.from_deepspeed_config(linear().parameters(), config)


def ds_file(text: str | None, name: str = "ds_config.json") -> Build:
    """ZenFlowAdamW.from_deepspeed_config(params, path); text None: the file is not created."""
    def build(tmp_path: Path) -> ZenFlowAdamW:
        path = tmp_path / name
        if text is not None:
            path.write_text(text)
        return ZenFlowAdamW.from_deepspeed_config(linear().parameters(), path)
    return build


def ds_dir() -> Build:
    return lambda tmp_path: ZenFlowAdamW.from_deepspeed_config(linear().parameters(), tmp_path)


def trained_state_dict(make_optimizer: Callable[[list], torch.optim.Optimizer], model: torch.nn.Module) -> dict:
    """Two steps of `make_optimizer(model.parameters())`, then its state_dict (the optimizer is closed after)."""
    opt = make_optimizer(list(model.parameters()))
    for _ in range(2):
        model(torch.randn(5, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    sd = opt.state_dict()
    if isinstance(opt, ZenFlowAdamW):
        opt.close()  # stops the worker and restores the affinity: only the *failed* load is under test
    return sd


def load(source: Callable[[list], torch.optim.Optimizer], **block: Any) -> Build:
    """A fresh ZenFlowAdamW(zenflow=block) on the same architecture, fed the state_dict of `source`.

    Keep `block` without overlap_step: then the optimizer under test has no worker of its own, and one started by
    the failed load would show in test_nothing_is_half_initialised.
    """
    def build(tmp_path: Path) -> ZenFlowAdamW:
        torch.manual_seed(0)
        model = linear()
        sd = trained_state_dict(source, copy.deepcopy(model))
        opt = ZenFlowAdamW(model.parameters(), zenflow=block)
        opt.load_state_dict(sd)
        return opt
    return build


def two_devices() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(3, 4)), torch.nn.Parameter(torch.zeros(3, 4, device="meta"))]


OVERLAP = {"overlap_step": True, "update_interval": 1, "pt_reserved_cores_perc": 0.5}


# ---- the table: (build, match) ----------------------------------------------------------------------------------
CASES = [
    # -- the zenflow block's ranges, misspelt keys, the offload device
    pytest.param(zf(topk_ratio=1.5), r"zenflow\.topk_ratio = 1\.5 .*\[0, 1\]", id="topk_ratio-above-1"),
    pytest.param(zf(topk_ratio=-0.1), r"zenflow\.topk_ratio = -0\.1 .*\[0, 1\]", id="topk_ratio-below-0"),
    pytest.param(zf(update_interval=0), r"zenflow\.update_interval = 0 .*\"auto\" or an integer >= 1",
                 id="update_interval-0"),
    pytest.param(zf(update_interval=-3), r"zenflow\.update_interval = -3 .*\"auto\" or an integer >= 1",
                 id="update_interval-negative"),
    pytest.param(zf(update_interval=4, select_interval=2),
                 r"zenflow\.select_interval = 2 .*integer >= update_interval \(4\)", id="select_interval-below-update"),
    pytest.param(zf(select_strategy="random"),
                 r"zenflow\.select_strategy = 'random' .*one of \('auto', 'step', 'epoch'\)",
                 id="select_strategy-unknown"),
    pytest.param(zf(topk_ration=0.1), r"zenflow: unknown key 'topk_ration'; did you mean 'topk_ratio'\?",
                 id="zenflow-key-misspelt"),
    pytest.param(ds(ds_config(zenflow={"update_intervall": 4})),
                 r"zenflow: unknown key 'update_intervall'; did you mean 'update_interval'\?",
                 id="ds-zenflow-key-misspelt"),
    pytest.param(ds(ds_config(offload=None)), r"offload_optimizer\.device = 'none' .*expected \"cpu\"",
                 id="ds-offload_optimizer-missing"),
    pytest.param(ds(ds_config(offload="nvme")), r"offload_optimizer\.device = 'nvme' .*expected \"cpu\"",
                 id="ds-offload-nvme"),
    pytest.param(ds(ds_config(offload="none")), r"offload_optimizer\.device = 'none' .*expected \"cpu\"",
                 id="ds-offload-none"),
    # -- AdamW hyperparameters
    pytest.param(hyper(lr=-1e-3), r"lr = -0\.001 .*a number >= 0", id="lr-negative"),
    pytest.param(hyper(lr=float("nan")), r"lr = nan .*a number >= 0", id="lr-nan"),
    pytest.param(hyper(betas=(0.9, 1.0)), r"betas = \(0\.9, 1\.0\) .*two numbers in \[0, 1\)", id="betas-beta2-1"),
    pytest.param(hyper(betas=(-0.1, 0.999)), r"betas = \(-0\.1, 0\.999\) .*two numbers in \[0, 1\)",
                 id="betas-negative"),
    pytest.param(hyper(betas=(0.9,)), r"betas = \(0\.9,\) .*two numbers in \[0, 1\)", id="betas-length-1"),
    pytest.param(ds(ds_config(**adamw_params(betas=[0.9, 0.99, 0.999]))),
                 r"betas = \(0\.9, 0\.99, 0\.999\) .*two numbers in \[0, 1\)", id="ds-betas-length-3"),
    pytest.param(ds(ds_config(**adamw_params(betas=0.9))), r"betas = 0\.9 .*two numbers in \[0, 1\)",
                 id="ds-betas-scalar"),
    pytest.param(hyper(eps=0.0), r"eps = 0\.0 .*a number > 0", id="eps-0"),
    pytest.param(ds(ds_config(**adamw_params(eps=-1e-8))), r"eps = -1e-08 .*a number > 0", id="ds-eps-negative"),
    pytest.param(hyper(eps=float("nan")), r"eps = nan .*a number > 0", id="eps-nan"),
    pytest.param(hyper(weight_decay=-0.01), r"weight_decay = -0\.01 .*a number >= 0", id="weight_decay-negative"),
    pytest.param(hyper(gradient_clipping=-1.0), r"gradient_clipping = -1\.0 .*a number >= 0",
                 id="gradient_clipping-negative"),
    pytest.param(ds(ds_config(gradient_clipping=-1.0)), r"gradient_clipping = -1\.0 .*a number >= 0",
                 id="ds-gradient_clipping-negative"),
    pytest.param(ds(ds_config(gradient_clipping=float("nan"))), r"gradient_clipping = nan .*a number >= 0",
                 id="ds-gradient_clipping-nan"),
    # -- the rest of the zenflow block
    pytest.param(zf(full_warm_up_rounds=-1), r"zenflow\.full_warm_up_rounds = -1 .*an integer >= 0",
                 id="full_warm_up_rounds-negative"),
    pytest.param(zf(full_warm_up_rounds=2.5), r"zenflow\.full_warm_up_rounds = 2\.5 .*an integer >= 0",
                 id="full_warm_up_rounds-float"),
    pytest.param(zf(auto_ratio=0.0), r"zenflow\.auto_ratio = 0\.0 .*\(0, 1\]", id="auto_ratio-0"),
    pytest.param(zf(auto_ratio=1.5), r"zenflow\.auto_ratio = 1\.5 .*\(0, 1\]", id="auto_ratio-above-1"),
    pytest.param(zf(pt_reserved_cores_perc=-0.1), r"zenflow\.pt_reserved_cores_perc = -0\.1 .*\[0, 1\]",
                 id="pt_reserved_cores_perc-negative"),
    pytest.param(zf(pt_reserved_cores_perc=1.5), r"zenflow\.pt_reserved_cores_perc = 1\.5 .*\[0, 1\]",
                 id="pt_reserved_cores_perc-above-1"),
    pytest.param(zf(steps_per_epoch=0), r"zenflow\.steps_per_epoch = 0 .*null or an integer >= 1",
                 id="steps_per_epoch-0"),
    pytest.param(zf(select_strategy="epoch"),
                 r"zenflow\.select_strategy = 'epoch' .*\"step\" or \"auto\" unless steps_per_epoch is given",
                 id="epoch-without-steps_per_epoch"),
    pytest.param(zf(overlap_step="true"), r"zenflow\.overlap_step = 'true' .*true or false",
                 id="overlap_step-string"),
    pytest.param(zf(column_norm="l3"), r"zenflow\.column_norm = 'l3' .*one of \('l2', 'l1'\)", id="column_norm-l3"),
    pytest.param(zf(max_update_interval=0), r"zenflow\.max_update_interval = 0 .*an integer >= 1",
                 id="max_update_interval-0"),
    pytest.param(lambda tmp_path: ZenFlowAdamW(linear().parameters(), zenflow=[("topk_ratio", 0.1)]),
                 r"zenflow: expected a dict or ZenFlowConfig, found list", id="zenflow-not-a-dict"),
    # -- the rest of a DeepSpeed config
    pytest.param(ds(ds_config(optimizer={"type": "SGD", "params": {"lr": 0.1}})),
                 r"optimizer\.type = 'SGD' .*one of \('adamw', 'adam'\)", id="ds-optimizer-SGD"),
    pytest.param(ds(ds_config(**adamw_params(amsgrad=True))), r"optimizer\.params\.amsgrad = true .*expected false",
                 id="ds-amsgrad"),
    pytest.param(ds(ds_config(**adamw_params(adam_w_mode=False))),
                 r"optimizer\.params\.adam_w_mode = false .*expected true", id="ds-adam_w_mode-false"),
    pytest.param(ds(ds_config(**adamw_params(weight_decy=0.01))),
                 r"optimizer\.params: unknown key 'weight_decy'; did you mean 'weight_decay'\?",
                 id="ds-optimizer-params-key-misspelt"),
    pytest.param(ds(ds_config(optimizer={"type": "AdamW", "params": [["lr", 1e-3]]})),
                 r"optimizer\.params = \[\['lr', 0\.001\]\] .*expected an object", id="ds-optimizer-params-list"),
    pytest.param(ds(ds_config(bf16={"enabled": True}, fp16={"enabled": True})),
                 r"bf16\.enabled and fp16\.enabled are both true: expected at most one", id="ds-bf16-and-fp16"),
    pytest.param(ds(ds_config(bf16={"enabled": "false"})), r"bf16\.enabled = 'false' .*true or false",
                 id="ds-bf16-enabled-string"),
    pytest.param(ds(ds_config(zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}})),
                 r"zero_optimization\.zenflow: missing", id="ds-zenflow-missing"),
    pytest.param(ds(ds_config(zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": None})),
                 r"zero_optimization\.zenflow: missing", id="ds-zenflow-null"),
    pytest.param(ds(ds_config(zenflow=True)), r"zero_optimization\.zenflow = True .*expected an object",
                 id="ds-zenflow-true"),
    pytest.param(ds(ds_config(zero_optimization={"stage": 2, "offload_optimizer": "cpu", "zenflow": {}})),
                 r"zero_optimization\.offload_optimizer = 'cpu' .*expected an object", id="ds-offload-string"),
    pytest.param(ds_file(None, "missing.json"), r"DeepSpeed config '.*missing\.json': file not found",
                 id="ds-path-missing"),
    pytest.param(ds_file('{"zero_optimization": {"zenflow": {}'),
                 r"DeepSpeed config '.*ds_config\.json': not valid JSON", id="ds-file-invalid-json"),
    pytest.param(ds_file("[1, 2]"), r"DeepSpeed config '.*ds_config\.json' = \[1, 2\] .*expected an object",
                 id="ds-file-json-list"),
    pytest.param(ds_dir(), r"DeepSpeed config '.*': cannot be read \(Is a directory\)", id="ds-path-directory"),
    # -- parameters (checked after the config; overlap on, so a worker started too early would show)
    pytest.param(with_params(lambda: [torch.nn.Parameter(torch.zeros(3, 4, dtype=torch.long), requires_grad=False)],
                             **OVERLAP),
                 r"params'\]\[0\] \(shape \(3, 4\), torch\.int64\): dtype torch\.int64 .*expected a floating dtype",
                 id="params-int64"),
    pytest.param(with_params(lambda: [torch.zeros(3, 4, dtype=torch.float64, requires_grad=True)], **OVERLAP),
                 r"dtype torch\.float64 .*expected float32, bfloat16 or float16", id="params-float64"),
    pytest.param(with_params(lambda: [torch.zeros(4, 3).t().requires_grad_()], **OVERLAP),
                 r"\(shape \(3, 4\), torch\.float32\): a non-contiguous weight .*expected a contiguous tensor",
                 id="params-non-contiguous"),
    pytest.param(with_params(two_devices, **OVERLAP), r"parameters on \['cpu', 'meta'\]: expected all on one device",
                 id="params-two-devices"),
    # -- checkpoints
    # the source ran with overlap_step and saves a pending upload, which a successful load restarts a worker for
    pytest.param(load(lambda ps: ZenFlowAdamW(ps, zenflow={**OVERLAP, "topk_ratio": 0.5}), update_interval=1),
                 r"state_dict zenflow config .*'topk_ratio': 0\.5.* differs from the optimizer's "
                 r".*'topk_ratio': 0\.1.*resume with the same zenflow block", id="state_dict-other-zenflow-config"),
    pytest.param(load(lambda ps: torch.optim.AdamW(ps), update_interval=1),
                 r"state_dict format = None is not allowed: expected one of \('zenflow-adamw/1', "
                 r"'zenflow-adamw/2', 'zenflow-adamw/3', 'zenflow-adamw/4'\)", id="state_dict-torch-AdamW"),
]


@pytest.mark.parametrize(("build", "match"), CASES)
def test_bad_input_is_refused_naming_field_value_and_rule(build: Build, match: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=match):
        build(tmp_path)


def _workers() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "zenflow-host-worker"}


@pytest.mark.parametrize(("build", "match"), CASES)
def test_nothing_is_half_initialised(build: Build, match: str, tmp_path: Path) -> None:
    workers, affinity, threads = _workers(), os.sched_getaffinity(0), torch.get_num_threads()
    with pytest.raises(ConfigError):
        build(tmp_path)
    assert _workers() - workers == set(), "a failed construction left a host worker thread running"
    assert os.sched_getaffinity(0) == affinity, "a failed construction changed the CPU affinity"
    assert torch.get_num_threads() == threads, "a failed construction changed torch's thread count"


# ---- the neighbouring valid inputs are accepted -------------------------------------------------------------------
@pytest.mark.parametrize("build", [
    pytest.param(zf(topk_ratio=0.0), id="topk_ratio-0"),
    pytest.param(zf(topk_ratio=1), id="topk_ratio-int-1"),
    pytest.param(zf(update_interval=4, select_interval=4), id="select_interval-equals-update"),
    # "auto" with steps_per_epoch: select_interval counts epochs (here 1 epoch = 10 steps >= update_interval 4)
    pytest.param(zf(steps_per_epoch=10, select_interval=1, update_interval=4), id="auto-strategy-epochs"),
    pytest.param(zf(select_strategy="epoch", steps_per_epoch=10, select_interval=1, update_interval=4),
                 id="epoch-strategy-epochs"),
    pytest.param(zf(auto_ratio=1.0, column_norm="l1", overlap_step=True), id="auto_ratio-1"),
    pytest.param(ds(ds_config()), id="ds-dict"),
    pytest.param(ds(ds_config(optimizer={"type": "Adam", "params": {"lr": 0.0, "betas": [0.0, 0.5]}},
                              bf16={"enabled": True}, fp16={"enabled": False})), id="ds-adam-bf16"),
    pytest.param(ds_file(json.dumps(ds_config())), id="ds-file"),
])
def test_valid_neighbours_are_accepted(build: Build, tmp_path: Path) -> None:
    with build(tmp_path):
        pass


def test_failed_load_state_dict_leaves_state_untouched() -> None:
    """The first layer matches and the last does not: nothing may be restored before the mismatch is found."""
    def run(out: int, steps: int) -> tuple[torch.nn.Module, ZenFlowAdamW]:
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, out))
        opt = ZenFlowAdamW(model.parameters(), zenflow={"update_interval": 1})
        for _ in range(steps):
            model(torch.randn(5, 4)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        return model, opt

    torch.manual_seed(0)
    _, other = run(out=5, steps=3)
    model, opt = run(out=2, steps=2)
    before = copy.deepcopy((opt.state_dict(), [p.detach().clone() for p in model.parameters()]))
    with pytest.raises(ConfigError, match=r"state_dict host_master: a weight of 5x3 .*the parameter's 2x3"):
        opt.load_state_dict(other.state_dict())
    assert _same((opt.state_dict(), list(model.parameters())), before)  # tensors, step counts and t alike


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


# ---- a weight with more than two dimensions is supported (viewed as [out, prod(rest)]) ----------------------------
def test_conv2d_all_columns_selected_matches_torch_fused_adamw() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3), torch.nn.ReLU(), torch.nn.Conv2d(4, 3, 3, bias=False))
    reference, initial = copy.deepcopy(model), copy.deepcopy(model)
    opt = ZenFlowAdamW(model.parameters(), lr=1e-2, weight_decay=0.1,
                       zenflow={"topk_ratio": 1.0, "full_warm_up_rounds": 0, "update_interval": 1})
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    with opt:
        for _ in range(5):
            x, target = torch.randn(8, 2, 7, 7), torch.randn(8, 3, 3, 3)
            for m, o in ((model, opt), (reference, ref_opt)):
                o.zero_grad()
                torch.nn.functional.mse_loss(m(x), target).backward()
                o.step()
    for p, q, p0 in zip(model.parameters(), reference.parameters(), initial.parameters(), strict=True):
        assert not torch.equal(p, p0)  # every parameter (4-D weights included) was trained
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)
