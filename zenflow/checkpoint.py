"""state_dict / load_state_dict for ZenFlowAdamW: everything needed for a bit-identical resume.

Saved: device masters, moments, selected indices and step counts; the host master, moments, row layout, step
count and accumulators; the step counters; whether an overlapped host result still awaits its upload (the host
state already holds that result, so the upload is recomputed from it on resume). With device accumulation the
interval's partial sum is saved where host accumulation holds it (`host_accumulators`, `host_counts`: the format is
the same whichever side sums, and a checkpoint of either loads into either). A host part not built yet
(HostColumns.pending: before its first offload) is saved as its columns and row count, with `host_master` None:
its values are the model's, saved with the model.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from typing import Any, Protocol, TypedDict

import torch

from zenflow.auto_interval import MassReport
from zenflow.config import ConfigError, ZenFlowConfig
from zenflow.device_accumulation import check_saved_counts, interval_sums, restore_sums_
from zenflow.distributed import Ranks, owner_of
from zenflow.fsdp import local_of
from zenflow.host import HostColumns
from zenflow.layout import offloaded_positions, shadow_positions, widen
from zenflow.link import StagingArena
from zenflow.ownership import carve_staging
from zenflow.state import Clock, ColumnState, ParamState, column_states
from zenflow.worker import HostWorker

# 2: the "auto" interval's history is per-step masses (auto_interval.py); 3: data parallelism (rank, world_size,
# each weight's width: a rank holds only its block of the host columns); 4: host parts not built yet (host_master
# None, host_rows). Older ones read as: /1 an empty "auto" history; /1, /2 one process; /1-/3 every host part built.
FORMAT = "zenflow-adamw/4"
READABLE = ("zenflow-adamw/1", "zenflow-adamw/2", "zenflow-adamw/3", FORMAT)
HOST_TENSORS = ("master", "exp_avg", "exp_avg_sq", "cols")
HOST_BLOCKS = ("host_master", "host_exp_avg", "host_exp_avg_sq")  # [out, n_host] each (None: not built yet)
DEVICE_TENSORS = ("sel", "unsel", "d_master", "d_exp_avg", "d_exp_avg_sq")
DENSE_TENSORS = ("master", "exp_avg", "exp_avg_sq")


class ColumnEntry(TypedDict):
    """One column-split weight's saved state (pack; sharded_checkpoint rearranges the same keys into rows)."""

    sel: torch.Tensor  # the selected columns (device part), as indices
    unsel: torch.Tensor  # the host part's columns, on the device
    d_master: torch.Tensor  # [out, k] each: the device part's fp32 master and moments
    d_exp_avg: torch.Tensor
    d_exp_avg_sq: torch.Tensor
    d_step: int
    host_master: torch.Tensor | None  # [out, n_host] each; None: the host part is not built yet
    host_exp_avg: torch.Tensor | None
    host_exp_avg_sq: torch.Tensor | None
    host_cols: torch.Tensor  # the host part's columns (this rank's block with data parallelism)
    host_accumulators: list[torch.Tensor]  # the interval's partial sums, one per slot, whichever side sums
    host_counts: list[int]
    host_step: int
    host_staged: bool
    width: int  # the weight's whole width (a rank holds only its block of the host columns)
    host_rows: int


class DenseEntry(TypedDict):
    """A parameter updated whole on the device (biases, norms, anything that is not a weight matrix)."""

    master: torch.Tensor | None
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: int


Entry = ColumnEntry | DenseEntry  # state_dict()["state"][i]


class Checkpointed(Protocol):
    """What a checkpoint saves and restores of the optimizer (ZenFlowAdamW's public objects)."""

    param_groups: list[dict[str, Any]]
    state: dict[torch.Tensor, ParamState]
    config: ZenFlowConfig
    clock: Clock
    ranks: Ranks
    worker: HostWorker
    arena: StagingArena
    auto_history: list[MassReport]
    pending: Future | None

    def settle(self) -> None: ...


def pack(opt: Checkpointed) -> dict[str, Any]:
    index = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    state = {}
    for p, st in opt.state.items():
        if isinstance(st, ColumnState):
            part = st.host
            entry = {name: getattr(st, name) for name in DEVICE_TENSORS} | {"d_step": st.d_step}
            entry |= {f"host_{name}": getattr(part, name) for name in HOST_TENSORS}
            sums, counts = interval_sums(st, opt.clock.slot)  # either side's partial sum, as the host holds it
            entry |= {"host_accumulators": sums, "host_counts": counts, "host_step": part.step,
                      "host_staged": part.staged, "width": st.width, "host_rows": part.rows}
            entry |= _without_shadows(entry, part)  # whole rows: saved as compact (one format, either layout)
        else:
            entry = {name: getattr(st, name) for name in DENSE_TENSORS} | {"step": st.step}
        state[index[id(p)]] = entry
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[id(p)] for p in g["params"]]}
              for g in opt.param_groups]
    clock = dataclasses.asdict(opt.clock)  # t, skipped_steps, host_updates, since_boundary, slot, select_next, ...
    return {"format": FORMAT, "state": state, "param_groups": groups,
            "zenflow": {"config": dataclasses.asdict(opt.config), **clock,
                        "auto_history": [r.to_state(opt.worker.result) for r in opt.auto_history],
                        "pending_upload": opt.pending is not None, "rank": opt.ranks.rank,
                        "world_size": opt.ranks.world}}


def unpack(opt: Checkpointed, sd: dict[str, Any]) -> None:
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
    _check_ranks(opt, sd["zenflow"])
    entries = [(params[int(i)], entry) for i, entry in sd["state"].items()]
    for p, entry in entries:  # check everything before changing anything
        _check_entry(p, opt.state[p], entry)
    opt.worker.quiesce()  # nothing of the old run may still write host buffers
    opt.pending = None
    for p, entry in entries:
        _restore_entry(p, opt.state[p], entry)
    for group, saved in zip(opt.param_groups, sd["param_groups"]):
        group.update({k: v for k, v in saved.items() if k != "params"})
    z = sd["zenflow"]
    opt.clock = Clock(t=z["t"], skipped_steps=z["skipped_steps"], host_updates=z["host_updates"],
                      since_boundary=z["since_boundary"], slot=z["slot"], select_next=z.get("select_next", False),
                      selections=z.get("selections", 0))
    opt.auto_history = [MassReport.from_state(r) for r in z.get("auto_history", [])]
    built = [st.host for _, st in column_states(opt.param_groups, opt.state) if st.host.built]
    carve_staging(opt.arena, built, opt.settle)  # the restored parts' staging: a drain may upload from it
    if z["pending_upload"]:
        opt.worker.start()
        done: Future = Future()
        done.set_result(None)
        opt.pending = done  # the result is in the host state; the next boundary uploads it


def _check_entry(p: torch.Tensor, st: ParamState, entry: Entry) -> None:
    p = local_of(p)  # FSDP2: this rank's rows
    if isinstance(st, ColumnState) != ("host_master" in entry):
        raise ConfigError(f"state_dict entry for a parameter of shape {tuple(p.shape)} is of the wrong kind "
                          "(column vs dense): the parameters are not the ones it was saved from")
    if not isinstance(st, ColumnState):
        for name in DENSE_TENSORS:
            if getattr(st, name) is not None:
                _check_shape(name, getattr(st, name), entry[name])
        return
    if st.host.device_sums:
        check_saved_counts(entry["host_counts"])
    width = st.width
    saved_width = entry["width"] if "width" in entry else entry["host_master"].shape[1] + entry["sel"].numel()  # /1
    rows = entry["host_rows"] if "host_rows" in entry else entry["host_master"].shape[0]  # /1-/3
    if (p.shape[0], width) != (rows, saved_width):
        raise ConfigError(f"state_dict host_master: a weight of {rows}x{saved_width} "
                          f"does not match the parameter's {p.shape[0]}x{width}")


def _check_ranks(opt: Checkpointed, z: dict[str, Any]) -> None:
    """A rank's state holds its block of the host columns: it loads only into the same rank of the same world."""
    saved = (z.get("rank", 0), z.get("world_size", 1))
    mine = (opt.ranks.rank, opt.ranks.world)
    if saved != mine:
        raise ConfigError(f"state_dict of rank {saved[0]} of {saved[1]} cannot load into rank {mine[0]} of {mine[1]}: "
                          "resume with the same world size, each rank its own file; or convert it with "
                          "zenflow.checkpoint.consolidate (W ranks -> one process) and shard (one process -> W ranks)")


def _restore_entry(p: torch.Tensor, st: ParamState, entry: Entry) -> None:
    p = local_of(p)  # FSDP2: this rank's rows
    if not isinstance(st, ColumnState):
        for name in DENSE_TENSORS:
            mine = getattr(st, name)
            if mine is not None:
                setattr(st, name, entry[name].to(mine.device, mine.dtype, copy=True))
        st.step = int(entry["step"])
        return
    part = st.host
    cols = entry["host_cols"].to("cpu", copy=True)
    if entry["host_master"] is None:  # not built yet: built at its first offload, from the (restored) model
        restored = HostColumns.pending(p.shape[0], cols, p.dtype, len(part.counts), part.n_staging)
    else:  # its staging comes from carve_staging, which re-casts a staged upload from the master (exact)
        restored = HostColumns.create(*(entry[name].to("cpu", copy=True) for name in HOST_BLOCKS), cols,
                                      dtype=p.dtype, n_accumulators=len(part.counts), n_staging=part.n_staging)
        for acc, saved in zip(restored.accumulators, entry["host_accumulators"]):
            acc.copy_(saved)
    restored.step, restored.staged = int(entry["host_step"]), entry["host_staged"]
    restored.counts = list(entry["host_counts"])
    st.host = restored
    for name in DEVICE_TENSORS:
        setattr(st, name, entry[name].to(p.device, copy=True))
    st.d_step = int(entry["d_step"])
    if restored.device_sums:  # device accumulation: the partial sum continues on the device
        restore_sums_(st, entry["host_accumulators"], restored.counts, p.device)
    if part.whole_rows:  # the saved (compact) columns into whole rows of this host's block, as before the load
        _widen_(st, block=part.cols)


def _without_shadows(entry: ColumnEntry, part: HostColumns) -> dict:
    """A whole-rows part's host tensors without its shadows: what a compact part of the same state holds."""
    if part.shadow.numel() == 0:
        return {}
    keep = offloaded_positions(part.n_host, part.shadow)
    out = {f"host_{name}": part.offloaded(entry[f"host_{name}"]) for name in ("master", "exp_avg", "exp_avg_sq")
           if entry[f"host_{name}"] is not None}
    cols = part.cols[keep]
    return out | {"host_cols": cols, "unsel": cols.to(entry["unsel"].device),
                  "host_accumulators": [part.offloaded(acc) for acc in entry["host_accumulators"]]}


def _widen_(st: ColumnState, block: torch.Tensor) -> None:
    """A restored compact host part (and its device sum) as whole rows of `block`: the saved columns in their
    places, zeros in the shadows (never read)."""
    part = st.host
    at = torch.searchsorted(block, part.cols)
    width = block.numel()
    if part.built:
        part.master, part.exp_avg, part.exp_avg_sq = (widen(t, at, width)
                                                      for t in (part.master, part.exp_avg, part.exp_avg_sq))
        if not part.device_sums:
            part.accumulators = [widen(acc, at, width) for acc in part.accumulators]
    if st.d_acc is not None:
        st.d_acc = widen(st.d_acc, at, width)
    part.cols, part.whole_rows = block, True
    part.shadow = shadow_positions(block, st.sel)
    part.grad_staging, part.param_staging = [], None  # carved again for the wider layout (carve_staging)
    st.unsel = block.to(st.sel.device)


def _check_shape(name: str, mine: torch.Tensor, saved: torch.Tensor) -> None:
    if tuple(mine.shape) != tuple(saved.shape):
        raise ConfigError(f"state_dict {name}: shape {tuple(saved.shape)} does not match the parameter's "
                          f"{tuple(mine.shape)}")


# ---- data parallelism: W per-rank state dicts <-> one process's -------------------------------------------
def consolidate(state_dicts: list[dict[str, Any]]) -> dict[str, Any]:
    """The state dicts of all W ranks (any order) -> the state dict of one process training the same run: each
    weight's host columns gathered from the ranks' blocks; everything else is the same on every rank."""
    by_rank = sorted(state_dicts, key=lambda sd: sd["zenflow"].get("rank", 0))
    world = by_rank[0]["zenflow"].get("world_size", 1)
    if [sd["zenflow"].get("rank", 0) for sd in by_rank] != list(range(world)):
        raise ConfigError(f"consolidate: expected the state dicts of ranks 0..{world - 1}, one each; got ranks "
                          f"{[sd['zenflow'].get('rank', 0) for sd in by_rank]}")
    out = {**by_rank[0], "state": {}, "zenflow": {**by_rank[0]["zenflow"], "rank": 0, "world_size": 1}}
    for key, entry in by_rank[0]["state"].items():
        if "host_master" not in entry:
            out["state"][key] = entry
            continue
        parts = [sd["state"][key] for sd in by_rank]
        cols = torch.cat([e["host_cols"] for e in parts])
        order = torch.argsort(cols)
        merged = {name: _cat_blocks([e[name] for e in parts], order) for name in HOST_BLOCKS}
        accumulators = [torch.cat([e["host_accumulators"][i] for e in parts], dim=1)[:, order]
                        for i in range(len(entry["host_accumulators"]))]
        out["state"][key] = {**entry, **merged, "host_cols": cols[order], "host_accumulators": accumulators,
                             "unsel": cols[order].to(entry["unsel"].device)}
    return out


def shard(state_dict: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """One process's state dict -> the one rank `rank` of `world` loads (its block of every weight's host
    columns), so a run can continue on W ranks."""
    if state_dict["zenflow"].get("world_size", 1) != 1:
        raise ConfigError("shard: expected a one-process state dict (consolidate the ranks' state dicts first)")
    out = {**state_dict, "state": {}, "zenflow": {**state_dict["zenflow"], "rank": rank, "world_size": world}}
    for key, entry in state_dict["state"].items():
        if "host_master" not in entry:
            out["state"][key] = entry
            continue
        width = entry["width"] if "width" in entry else entry["host_master"].shape[1] + entry["sel"].numel()  # /1-/2
        mine = owner_of(entry["host_cols"], width, world) == rank
        out["state"][key] = {**entry, **{name: _columns(entry[name], mine) for name in HOST_BLOCKS},
                             "host_cols": entry["host_cols"][mine], "width": width,
                             "unsel": entry["host_cols"][mine].to(entry["unsel"].device),
                             "host_accumulators": [acc[:, mine] for acc in entry["host_accumulators"]]}
    return out


def _cat_blocks(blocks: list[torch.Tensor | None], order: torch.Tensor) -> torch.Tensor | None:
    """The ranks' column blocks side by side, in column order; None where no rank has built its part yet (every
    rank builds at the same step)."""
    if any(b is None for b in blocks):
        if not all(b is None for b in blocks):
            raise ConfigError("consolidate: a weight's host part is built on some ranks and not on others")
        return None
    return torch.cat(blocks, dim=1)[:, order]


def _columns(block: torch.Tensor | None, mine: torch.Tensor) -> torch.Tensor | None:
    return None if block is None else block[:, mine]
