"""Run DeepSpeed ZenFlow on a small job in a fresh subprocess, and our ZenFlowAdamW on the same job in-process.

A *job* is a plain dict (torch.save-able, loaded back with weights_only=True): the DeepSpeed config dict, a model
spec, the initial weights, the batches, and what to record. `run_deepspeed(job)` runs this file as a script in a
fresh interpreter (docs/design.md §3: DeepSpeed changes process affinity and threads, and its overlap worker re-imports
`__main__`, so the entry point sits behind an `if __name__ == "__main__":` guard, docs/design.md §6) and returns the
recorded trace. `run_ours(job)` replays the same job through `ZenFlowAdamW.from_deepspeed_config` in-process.

A trace holds, per step: the loss, every parameter after the step and the selected column indices of every column
param (DeepSpeed: `param.selected_indices`; ours: `opt.state[p].sel`), plus the probes the job names. The
DeepSpeed side only *observes* its internals (wrapped methods call the originals unchanged), except with
`repair_layout`, which fixes one view (divergence G, see `_repair_weight_layout`).
"""

from __future__ import annotations

import copy
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve()
DS_TIMEOUT_S = 900  # the first run compiles DeepSpeed's CPU Adam (~2 min) and comm op (~1 min); later ones: seconds


# ---- config, model and data -----------------------------------------------------------------------------------
def ds_config(zenflow: dict[str, Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
              eps: float = 1e-8, weight_decay: float | None = 0.01, **top: Any) -> dict[str, Any]:
    """ZeRO stage 2 + CPU optimizer offload + the zenflow block, AdamW (weight_decay None: the key is omitted)."""
    params: dict[str, Any] = {"lr": lr, "betas": list(betas), "eps": eps}
    if weight_decay is not None:
        params["weight_decay"] = weight_decay
    return {"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW", "params": params},
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": dict(zenflow)},
            **top}


def build_model(spec: dict[str, Any]) -> torch.nn.Module:
    """Linear layers `widths[i] -> widths[i+1]` with Tanh between them; optional biases and LayerNorms."""
    torch.manual_seed(spec.get("seed", 0))
    widths, bias, norm = spec["widths"], spec.get("bias", False), spec.get("norm", False)
    dtype = getattr(torch, spec.get("dtype", "float32"))
    layers: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(torch.nn.Linear(a, b, bias=bias, dtype=dtype))
        if i < len(widths) - 2:
            if norm:
                layers.append(torch.nn.LayerNorm(b, dtype=dtype))
            layers.append(torch.nn.Tanh())
    return torch.nn.Sequential(*layers)


def make_job(config: dict[str, Any], model: dict[str, Any], steps: int, batch: int = 8, data_seed: int = 1,
             probes: tuple[str, ...] = (), repair_layout: bool = False, scale_wrt_gas: bool = True) -> dict[str, Any]:
    """probes: "host_steps" (every host optimizer call and its step_id), "select_input" (the flat gradient bucket
    the selection scores, in bucket order), "device_state" (the device optimizer's step counters, moments dtype and
    the weight decay each part uses)."""
    net = build_model(model)
    gen = torch.Generator().manual_seed(data_seed)
    dtype = getattr(torch, model.get("dtype", "float32"))
    xs = [torch.randn(batch, model["widths"][0], generator=gen).to(dtype) for _ in range(steps)]
    ys = [torch.randn(batch, model["widths"][-1], generator=gen).to(dtype) for _ in range(steps)]
    return dict(config=config, model=model, init={k: v.clone() for k, v in net.state_dict().items()}, xs=xs, ys=ys,
                steps=steps, probes=list(probes), repair_layout=repair_layout, scale_wrt_gas=scale_wrt_gas)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out.float() - y.float()).pow(2).mean()


def host_result_landed(trace: dict[str, Any], start: list[torch.Tensor]) -> list[bool]:
    """Per step: did any *unselected* column of a column param change? Only a host result can change those."""
    landed, prev = [], start
    for params, sel in zip(trace["params"], trace["sel"]):
        changed = False
        for p, q, s in zip(params, prev, sel):
            if p.dim() != 2:
                continue
            host = torch.ones(p.shape[1], dtype=torch.bool)
            if s is not None:
                host[s] = False
            changed |= bool((p[:, host] != q[:, host]).any())
        landed.append(changed)
        prev = params
    return landed


# ---- DeepSpeed, in a fresh subprocess -------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_deepspeed(job: dict[str, Any], timeout: float = DS_TIMEOUT_S) -> dict[str, Any]:
    """Run the job on DeepSpeed in a fresh interpreter; the trace comes back through a temp file (torch.save)."""
    with tempfile.TemporaryDirectory(prefix="ds-zenflow-") as tmp:
        src, dst = Path(tmp, "job.pt"), Path(tmp, "trace.pt")
        torch.save(job, src)
        # The differential is a CPU proof: both sides on the CPU, tolerances set for the CPU's kernels. On a GPU host
        # DeepSpeed would pick its CUDA accelerator while the job's tensors are on the CPU (seen on an H100,
        # 2026-11-24); the CUDA path has its own differential (make gpu-check).
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                   LOCAL_RANK="0", PYTHONWARNINGS="ignore", DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="")
        proc = subprocess.run([sys.executable, str(HERE), str(src), str(dst)], env=env, capture_output=True,
                              text=True, timeout=timeout)
        if not dst.exists():
            raise RuntimeError(f"DeepSpeed worker failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}\n"
                               f"{proc.stderr[-8000:]}")
        trace = torch.load(dst, weights_only=True)
    trace["stdout"] = proc.stdout
    return trace


def _ds_main(src: str, dst: str) -> None:
    import deepspeed  # only in the subprocess

    job = torch.load(src, weights_only=True)
    deepspeed.init_distributed(dist_backend="gloo")
    if job["repair_layout"]:
        _repair_weight_layout()
    model = build_model(job["model"])
    model.load_state_dict(job["init"])
    probes = set(job["probes"])
    engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=job["config"])
    trace: dict[str, Any] = dict(
        loss=[], params=[], sel=[], boundary=[], need_update=[], error=None,
        names=[n for n, _ in model.named_parameters()], gas=engine.gradient_accumulation_steps(),
        params0=[p.detach().float().clone() for p in model.parameters()],  # what DeepSpeed actually starts from
    )
    if "host_steps" in probes:
        _record_host_steps(opt, trace)
    if "select_input" in probes:
        _record_selection_input(opt, model, trace)
    try:
        for t in range(job["steps"]):
            trace["boundary"].append(bool(engine.is_gradient_accumulation_boundary()))
            loss = loss_fn(engine(job["xs"][t]), job["ys"][t])
            engine.backward(loss, scale_wrt_gas=job["scale_wrt_gas"])
            if getattr(opt, "auto_update", False):
                trace["need_update"].append(list(opt.zenflow_need_update))
            engine.step()
            trace["loss"].append(loss.item())
            trace["params"].append([p.detach().float().clone() for p in model.parameters()])
            trace["sel"].append([_selected(p) for p in model.parameters()])
    except Exception as exc:  # recorded, not raised: a divergence test may assert DeepSpeed's failure mode
        trace["error"] = f"{type(exc).__name__}: {exc}"
    if "device_state" in probes:
        device = opt.selective_optimizer
        states = [st for st in device.state.values() if "step" in st]
        trace["device_step"] = [(str(st["step"].dtype), float(st["step"])) for st in states]
        trace["device_moment_dtype"] = [str(st["exp_avg"].dtype) for st in states if "exp_avg" in st]
        trace["device_weight_decay"] = [g["weight_decay"] for g in device.param_groups]
        trace["host_weight_decay"] = [g["weight_decay"] for g in opt.optimizer.param_groups]
    torch.save(trace, dst)
    # No teardown: the interpreter exits next, and DeepSpeed's overlap optimizer process is a daemon child.


def _repair_weight_layout() -> None:
    """Divergence G: see zenflow/harness/engines/ds_divergences.py (the same repair the GLUE diagnostic run can use)."""
    from zenflow.harness.engines.ds_divergences import repair_zenflow_weight_view

    repair_zenflow_weight_view()


def _selected(p: torch.Tensor) -> torch.Tensor | None:
    sel = getattr(p, "selected_indices", None)
    return None if sel is None else sel.detach().long().sort().values.clone()


def _record_host_steps(opt: Any, trace: dict[str, Any]) -> None:
    """Observe every host optimizer call (sync mode: DeepSpeed's CPU Adam `step(step_id=...)`)."""
    trace["host_step_ids"] = []
    inner = opt.optimizer
    original = inner.step

    def recording_step(*args, **kwargs):
        trace["host_step_ids"].append(kwargs.get("step_id", args[0] if args else None))
        return original(*args, **kwargs)

    inner.step = recording_step


def _record_selection_input(opt: Any, model: torch.nn.Module, trace: dict[str, Any]) -> None:
    """Observe the flat gradient bucket `update_selected_channels` scores, and its params in bucket order."""
    trace["select_input"] = []
    original = opt.update_selected_channels
    index = {id(p): i for i, p in enumerate(model.parameters())}

    def recording(tensor, total_size, comm_dtype):
        bucket = opt.ipg_buckets[comm_dtype]
        order = [index[id(opt.bit16_groups[g][j])] for g, j, _ in bucket.params]
        trace["select_input"].append(dict(flat=tensor.detach().float().clone(), order=order))
        return original(tensor, total_size, comm_dtype)

    opt.update_selected_channels = recording


# ---- ours, in-process -----------------------------------------------------------------------------------------
def run_ours(job: dict[str, Any], zenflow_extra: dict[str, Any] | None = None,
             init: list[torch.Tensor] | None = None) -> dict[str, Any]:
    """The same job through `ZenFlowAdamW.from_deepspeed_config(params, the job's DeepSpeed dict)`.

    zenflow_extra: ours-only keys added to the zenflow block (DeepSpeed's pydantic model forbids unknown keys).
    init: start from these weights instead of the job's (e.g. the weights DeepSpeed actually started from).
    """
    from zenflow import ZenFlowAdamW

    config = copy.deepcopy(job["config"])
    config["zero_optimization"]["zenflow"].update(zenflow_extra or {})
    model = build_model(job["model"])
    model.load_state_dict(job["init"])
    if init is not None:
        with torch.no_grad():
            for p, value in zip(model.parameters(), init):
                p.copy_(value)
    trace: dict[str, Any] = dict(loss=[], params=[], sel=[], names=[n for n, _ in model.named_parameters()])
    opt = ZenFlowAdamW.from_deepspeed_config(model.parameters(), config)
    try:
        for t in range(job["steps"]):
            loss = loss_fn(model(job["xs"][t]), job["ys"][t])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            trace["loss"].append(loss.item())
            trace["params"].append([p.detach().float().clone() for p in model.parameters()])
            trace["sel"].append([opt.state[p].sel.long().clone() if p.dim() >= 2 else None
                                 for p in model.parameters()])
    finally:
        opt.close(flush=False)
    trace["host_updates"] = opt.host_updates
    trace["d_step"] = [opt.state[p].d_step for p in model.parameters() if p.dim() >= 2]
    return trace


if __name__ == "__main__":
    _ds_main(sys.argv[1], sys.argv[2])
