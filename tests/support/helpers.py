"""Small models and gradient streams shared by the tests."""

from __future__ import annotations

import torch

from zenflow import ZenFlowAdamW
from zenflow.costmodel.model import Inputs


class Interleaved(torch.nn.Module):
    """Weights with biases and norm layers between them: 1-D params precede 2-D ones in parameter order."""

    def __init__(self, widths: list[int], dtype: torch.dtype = torch.float32, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        layers: list[torch.nn.Module] = []
        for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
            layers.append(torch.nn.Linear(a, b, dtype=dtype))
            if i < len(widths) - 2:
                layers += [torch.nn.LayerNorm(b, dtype=dtype), torch.nn.GELU()]
        self.net = torch.nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def clone_model(model: torch.nn.Module) -> torch.nn.Module:
    import copy

    return copy.deepcopy(model)


def grad_stream(model: torch.nn.Module, steps: int, seed: int) -> list[list[torch.Tensor]]:
    """Fixed gradients per step (so staleness cannot change them): oracles compare updates, not training."""
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=gen).to(p.dtype) for p in model.parameters()] for _ in range(steps)]


def set_grads(model: torch.nn.Module, grads: list[torch.Tensor]) -> None:
    for p, g in zip(model.parameters(), grads):
        p.grad = g.clone()


def feed(model: torch.nn.Module, opt: torch.optim.Optimizer, grads: list[list[torch.Tensor]], zero_grad: bool = True,
         record: bool = False) -> list[list[torch.Tensor]]:
    """The step loop: per step, set its gradients (`set_grads`), `opt.step()`, then `opt.zero_grad()` (unless
    zero_grad=False: the next step's gradients replace them). record: return the parameters after every step."""
    after = []
    for step_grads in grads:
        set_grads(model, step_grads)
        opt.step()
        if zero_grad:
            opt.zero_grad()
        if record:
            after.append([p.detach().clone() for p in model.parameters()])
    return after


def firing_steps(opt: torch.optim.Optimizer, model: torch.nn.Module, grads) -> list[int]:
    """The steps (from 0) after which the optimizer's `host_updates` grew, feeding `grads` (one list per step)."""
    fired, before = [], opt.host_updates
    for t, step_grads in enumerate(grads):
        feed(model, opt, [step_grads])
        if opt.host_updates > before:
            fired.append(t)
        before = opt.host_updates
    return fired


def train_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int,
                start: int = 0) -> list[float]:
    """Real forward/backward steps on a fixed regression task; batch i depends only on (seed, i)."""
    width = next(model.parameters()).shape[1]
    losses = []
    for i in range(start, start + steps):
        gen = torch.Generator().manual_seed(seed * 100_003 + i)
        x = torch.randn(6, width, generator=gen)
        dtype = next(model.parameters()).dtype
        loss = (model(x.to(dtype)).float() - 0.5).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


OPTIMIZER_KEYWORDS = ("lr", "weight_decay", "betas", "eps", "gradient_clipping", "skip_nonfinite", "host_layout")


def column_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.dim() >= 2]


def zenflow(model: torch.nn.Module, **block) -> ZenFlowAdamW:
    """ZenFlowAdamW over `model`'s parameters: lr 1e-2, weight decay 0.1, select_interval 10 000 unless given;
    betas, eps, gradient_clipping, skip_nonfinite and host_layout go to the optimizer, every other keyword to the
    zenflow block."""
    block.setdefault("select_interval", 10_000)
    hyper = {k: block.pop(k) for k in OPTIMIZER_KEYWORDS if k in block}
    hyper.setdefault("lr", 1e-2)
    hyper.setdefault("weight_decay", 0.1)
    return ZenFlowAdamW(model.parameters(), zenflow=block, **hyper)


def train_on_global_batches(model: torch.nn.Module, opt: torch.optim.Optimizer, batches: list, world: int) -> None:
    """What `world` data-parallel ranks compute together, in one process: each global batch as `world` micro-batches
    of loss / world, gradients accumulated, then one step (the reference of the two-rank tests)."""
    for x, y in batches:
        share = x.shape[0] // world
        for r in range(world):
            rows = slice(r * share, (r + 1) * share)
            (torch.nn.functional.mse_loss(model(x[rows]), y[rows]) / world).backward()
        opt.step()
        opt.zero_grad()


INF = 1e15  # a rate the cost model treats as free


def cost_inputs(**kw: float) -> Inputs:
    """Cost-model inputs of a made-up cpu-scale-like machine (tests/costmodel), any field overridden."""
    base = dict(column_params=50e6, dense_params=1e4, tokens=16, dtype_bytes=2, fb_ms=80, fb_ms_overlap=120,
                device_opt_ms=80, device_base_ms=10, device_base_ms_overlap=15, device_col_ns=5, d2h_gbps=6,
                h2d_gbps=6, gather_gbps=2, scatter_gbps=2, accum_gelem_s=1.5, adamw_gelem_s=1.0,
                accum_gelem_s_worker=0.8, adamw_gelem_s_worker=0.5, compute_slowdown=1.1, host_slowdown=1.05)
    return Inputs(**{**base, **kw})


def _loop(fb: dict[int, float], **parts: float) -> dict:
    return {"forward_backward_ms": {str(k): v for k, v in fb.items()}, "step_parts_ms": parts}


def synthetic_calibration(hardware_id: str = "cpu-scale-test", column_elements: int = 1_000_000) -> dict:
    """A calibration record of round numbers: the two-thread loops twice as fast as the one-thread ones, so a
    prediction says which it used (tests/costmodel/test_split_placement.py computes its predictions by hand)."""
    one = dict(device=4.0, copy_d2h=6.0, copy_h2d=5.0, host_accumulate=10.0, host_update=30.0)
    fast, slow = {8: 20.0, 32: 30.0, 128: 70.0}, {8: 40.0, 32: 60.0, 128: 140.0}
    return {"schema": "costmodel-calibration/1", "hardware_id": hardware_id, "column_elements": column_elements,
            "element_bytes": 2, "model": {"dense_parameters": 0}, "calibration_seq_lens": [8, 32, 128],
            "contention": {"compute_slowdown": 1.0, "host_slowdown": 1.0},
            "loops": {"no_offload_2t": _loop(fast, total=8.0), "no_offload_1t": _loop(slow, total=16.0),
                      "offload_2t": _loop(fast, **{k: v / 2 for k, v in one.items()}),
                      "zenflow_r0_1t": _loop(slow, **one),
                      "zenflow_r0.1_1t": _loop({k: v + 2 for k, v in slow.items()}, **{**one, "device": 5.0})}}
