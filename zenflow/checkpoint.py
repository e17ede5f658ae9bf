"""state_dict / load_state_dict for ZenFlowAdamW: everything needed for a bit-identical resume.

Saved: device masters, moments, selected indices and step counts; the host master, moments, row layout, step
count and accumulators; the step counters; whether an overlapped host result still awaits its upload (the host
state already holds that result, so the upload is recomputed from it on resume).
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from zenflow.auto_interval import MassReport
from zenflow.config import ConfigError
from zenflow.host import HostColumns

if TYPE_CHECKING:
    from zenflow.optimizer import ZenFlowAdamW

FORMAT = "zenflow-adamw/2"  # 2: the "auto" interval's history is per-step masses (auto_interval.py)
READABLE = ("zenflow-adamw/1", FORMAT)  # /1 loads with an empty "auto" history (its rule read other numbers)
HOST_TENSORS = ("master", "exp_avg", "exp_avg_sq", "cols")
DEVICE_TENSORS = ("sel", "unsel", "d_master", "d_exp_avg", "d_exp_avg_sq")
DENSE_TENSORS = ("master", "exp_avg", "exp_avg_sq")


def pack(opt: ZenFlowAdamW) -> dict[str, Any]:
    index = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    state = {}
    for p, st in opt.state.items():
        if "host" in st:
            part = st["host"]
            entry = {name: st[name] for name in DEVICE_TENSORS} | {"d_step": st["d_step"]}
            entry |= {f"host_{name}": getattr(part, name) for name in HOST_TENSORS}
            entry |= {"host_accumulators": list(part.accumulators), "host_counts": list(part.counts),
                      "host_step": part.step, "host_staged": part.staged}
        else:
            entry = {name: st[name] for name in DENSE_TENSORS} | {"step": st["step"]}
        state[index[id(p)]] = entry
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[id(p)] for p in g["params"]]}
              for g in opt.param_groups]
    return {"format": FORMAT, "state": state, "param_groups": groups,
            "zenflow": {"config": dataclasses.asdict(opt.config), "t": opt.t, "skipped_steps": opt.skipped_steps,
                        "host_updates": opt.host_updates, "since_boundary": opt._since_boundary,
                        "slot": opt._slot,
                        "auto_history": [r.to_state(opt._wait_for) for r in opt._auto_history],
                        "pending_upload": opt._pending is not None}}


def unpack(opt: ZenFlowAdamW, sd: dict[str, Any]) -> None:
    if sd.get("format") not in READABLE:
        raise ConfigError(f"state_dict format = {sd.get('format')!r} is not allowed: expected one of {READABLE} "
                          "(a ZenFlowAdamW state_dict)")
    params = [p for g in opt.param_groups for p in g["params"]]
    sizes = [len(g["params"]) for g in sd["param_groups"]]
    if sizes != [len(g["params"]) for g in opt.param_groups]:
        raise ConfigError(f"state_dict param_groups sizes {sizes} do not match the optimizer's "
                          f"{[len(g['params']) for g in opt.param_groups]}")
    saved_config = sd["zenflow"]["config"]
    if saved_config != dataclasses.asdict(opt.config):
        raise ConfigError(f"state_dict zenflow config {saved_config} differs from the optimizer's "
                          f"{dataclasses.asdict(opt.config)}: resume with the same zenflow block")
    entries = [(params[int(i)], entry) for i, entry in sd["state"].items()]
    for p, entry in entries:  # check everything before changing anything
        _check_entry(p, opt.state[p], entry)
    opt._quiesce()  # nothing of the old run may still write host buffers
    opt._pending = None
    for p, entry in entries:
        _restore_entry(opt, p, opt.state[p], entry)
    for group, saved in zip(opt.param_groups, sd["param_groups"]):
        group.update({k: v for k, v in saved.items() if k != "params"})
    z = sd["zenflow"]
    opt.t, opt.skipped_steps, opt.host_updates = z["t"], z["skipped_steps"], z["host_updates"]
    opt._since_boundary, opt._slot = z["since_boundary"], z["slot"]
    opt._auto_history = [MassReport.from_state(r) for r in z.get("auto_history", [])]
    if z["pending_upload"]:
        opt._start_worker()
        done: Future = Future()
        done.set_result(None)
        opt._pending = done  # the result is in the host state; the next boundary uploads it


def _check_entry(p: torch.Tensor, st: dict, entry: dict) -> None:
    if ("host" in st) != ("host_master" in entry):
        raise ConfigError(f"state_dict entry for a parameter of shape {tuple(p.shape)} is of the wrong kind "
                          "(column vs dense): the parameters are not the ones it was saved from")
    if "host" not in st:
        for name in DENSE_TENSORS:
            if st[name] is not None:
                _check_shape(name, st[name], entry[name])
        return
    part = st["host"]
    width = part.master.shape[1] + st["sel"].numel()
    saved_width = entry["host_master"].shape[1] + entry["sel"].numel()
    if (part.master.shape[0], width) != (entry["host_master"].shape[0], saved_width):
        raise ConfigError(f"state_dict host_master: a weight of {entry['host_master'].shape[0]}x{saved_width} "
                          f"does not match the parameter's {part.master.shape[0]}x{width}")


def _restore_entry(opt: ZenFlowAdamW, p: torch.Tensor, st: dict, entry: dict) -> None:
    if "host" not in st:
        for name in DENSE_TENSORS:
            if st[name] is not None:
                st[name] = entry[name].to(st[name].device, st[name].dtype, copy=True)
        st["step"] = int(entry["step"])
        return
    part = st["host"]
    restored = HostColumns.create(*(entry[f"host_{name}"].to("cpu", copy=True) for name in HOST_TENSORS),
                                  model_dtype=p.dtype, n_accumulators=len(part.accumulators),
                                  host_empty=opt.link.host_empty, step=int(entry["host_step"]),
                                  n_staging=len(part.grad_staging))
    for acc, saved in zip(restored.accumulators, entry["host_accumulators"]):
        acc.copy_(saved)
    restored.counts, restored.staged = list(entry["host_counts"]), entry["host_staged"]
    if restored.staged:  # the staged upload is a pure function of the host master
        restored.param_staging.copy_(restored.master)
    st["host"] = restored
    for name in DEVICE_TENSORS:
        st[name] = entry[name].to(p.device, copy=True)
    st["d_step"] = int(entry["d_step"])


def _check_shape(name: str, mine: torch.Tensor, saved: torch.Tensor) -> None:
    if tuple(mine.shape) != tuple(saved.shape):
        raise ConfigError(f"state_dict {name}: shape {tuple(saved.shape)} does not match the parameter's "
                          f"{tuple(mine.shape)}")
