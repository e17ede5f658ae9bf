"""ZenFlowAdamW's state through torch.distributed.checkpoint (DCP): saved at W ranks, loaded at any number (resharded).

`ShardedState(opt)` is a DCP `Stateful`: its state dict holds every parameter's optimizer state as whole-width,
row-sharded tensors, the way FSDP2 holds the parameters, so DCP can write each rank's rows and read them back into
another world size (W -> W', or W -> one process):

    dcp.save({"model": get_model_state_dict(model), "optimizer": ShardedState(opt)}, checkpoint_id=path)
    state = {"model": get_model_state_dict(model), "optimizer": ShardedState(opt)}
    dcp.load(state, checkpoint_id=path)              # at any world size; then set_model_state_dict(model, ...)

Per column param `W[out, in]`: `master`, `exp_avg`, `exp_avg_sq` as fp32 `[out, in]` (the device's selected columns
and the host's others side by side; a host part not built yet holds the weight's values and zero moments) and one
`[out, in]` fp32 accumulator per slot (the interval's partial sum, zero in the selected columns), plus plain
values: the selected columns, both step counts, the accumulators' counts, whether the host part is built. Per
dense param its master (lower-precision params only) and moments, row-sharded too. The clock, the config, the
param groups and a pending overlapped upload are plain values. On load the columns are split by the saved
selection again, so a resume is exact: the same step, mid-interval, with the same columns on each side.

The assembly is checkpoint.pack's per-rank dict rearranged (and unpack's on the way back): one format of the state,
two layouts. Memory: the assembled tensors are on the host, four or five fp32 copies of this rank's rows while
saving, as DTensors of a CPU mesh over the same ranks (`host_mesh`: on FSDP2's CUDA mesh they would be copied to the
GPU). Data parallelism without FSDP2 (column blocks per rank) keeps its per-rank state dicts
(docs/distributed.md, "Checkpoints").
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from zenflow.checkpoint import FORMAT, Checkpointed, Entry, unpack
from zenflow.config import ConfigError
from zenflow.distributed import DataParallel, Ranks
from zenflow.fsdp import local_of
from zenflow.selection import complement

MOMENTS = ("exp_avg", "exp_avg_sq")


class ShardedState:
    """A DCP Stateful over a ZenFlowAdamW (one process, or FSDP2's ranks)."""

    def __init__(self, opt: Checkpointed) -> None:
        if isinstance(opt.ranks, DataParallel):
            raise ConfigError("ShardedState is not allowed with ZenFlowAdamW's own data parallelism: expected FSDP2's "
                              "sharded parameters or one process (save opt.state_dict() per rank instead)")
        self.opt = opt

    def state_dict(self) -> dict[str, Any]:
        packed = self.opt.state_dict()
        params = [p for g in self.opt.param_groups for p in g["params"]]
        state = {str(i): _spread(entry, params[int(i)]) for i, entry in packed["state"].items()}
        zenflow = {k: v for k, v in packed["zenflow"].items() if k not in ("rank", "world_size")}
        return {"state": state, "param_groups": packed["param_groups"], "zenflow": zenflow}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        params = [p for g in self.opt.param_groups for p in g["params"]]
        state = {int(i): _gather(entry, params[int(i)], self.opt.ranks) for i, entry in state_dict["state"].items()}
        zenflow = {**state_dict["zenflow"], "rank": self.opt.ranks.rank, "world_size": self.opt.ranks.world}
        unpack(self.opt, {"format": FORMAT, "state": state, "param_groups": state_dict["param_groups"],
                          "zenflow": zenflow})


# ---- one rank's entry (checkpoint.pack) -> whole-width rows ---------------------------------------------------------
def _spread(entry: Entry, p: torch.Tensor) -> dict[str, Any]:
    if "host_master" not in entry:  # dense: the moments are this rank's rows already
        out = {name: _rows(entry[name], p, p.shape) for name in ("master", *MOMENTS) if entry[name] is not None}
        return out | {"step": entry["step"]}
    rows = local_of(p)
    width, sel, cols = entry["width"], entry["sel"].cpu(), entry["host_cols"].cpu()
    built = entry["host_master"] is not None
    weight = rows.detach().reshape(rows.shape[0], width).float().cpu()  # an unbuilt host part: the weight's values

    def whole(name: str, start: torch.Tensor) -> torch.Tensor:
        out = start.clone()
        out[:, sel] = entry[f"d_{name}"].cpu()
        if built:
            out[:, cols] = entry[f"host_{name}"]
        return _rows(out, p, (p.shape[0], width))

    zeros = torch.zeros(rows.shape[0], width)
    out = {"master": whole("master", weight)} | {name: whole(name, zeros) for name in MOMENTS}
    for slot in range(len(entry["host_counts"])):
        acc = zeros.clone()
        if built and entry["host_accumulators"]:
            acc[:, cols] = entry["host_accumulators"][slot]
        out[f"accumulator{slot}"] = _rows(acc, p, (p.shape[0], width))
    return out | {"selected": sel.tolist(), "d_step": entry["d_step"], "host_step": entry["host_step"],
                  "host_staged": entry["host_staged"], "host_counts": list(entry["host_counts"]),
                  "host_built": built}


def _rows(t: torch.Tensor, p: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """This rank's rows `t` of a tensor of global `shape`: a Shard(0) DTensor on the host twin of p's mesh, or `t`
    (one process)."""
    if not isinstance(p, DTensor):
        return t
    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return DTensor.from_local(t, host_mesh(p.device_mesh), [Shard(0)], run_check=False, shape=torch.Size(shape),
                              stride=stride)


_HOST_MESHES: dict[tuple[int, ...], DeviceMesh] = {}


def host_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """`mesh` where it is the CPU's, else a CPU mesh over a gloo group of the same ranks (made once per set of
    ranks). DTensor.from_local moves a local tensor to its mesh's device type: on FSDP2's CUDA mesh the assembled
    host state (four or five fp32 copies of a rank's rows, ≈140 GB at 7B on one GPU) would be copied to the GPU
    while saving."""
    if mesh.device_type == "cpu":
        return mesh
    ranks = tuple(int(r) for r in mesh.mesh.flatten().tolist())
    if ranks not in _HOST_MESHES:  # every rank saves, so every rank makes the group, in the same order
        _HOST_MESHES[ranks] = DeviceMesh.from_group(dist.new_group(list(ranks), backend="gloo"), "cpu")
    return _HOST_MESHES[ranks]


# ---- whole-width rows -> this rank's entry (checkpoint.unpack) ------------------------------------------------------
def _gather(saved: dict[str, Any], p: torch.Tensor, ranks: Ranks) -> Entry:
    if "selected" not in saved:  # dense
        master = local_of(saved["master"]) if "master" in saved else None
        return {"master": master, **{name: local_of(saved[name]) for name in MOMENTS}, "step": saved["step"]}
    counts = saved["host_counts"]
    if len(counts) != sum(1 for key in saved if key.startswith("accumulator")):
        raise ConfigError(f"checkpoint accumulators = {len(counts)} do not match the saved tensors: expected one "
                          "per slot (a checkpoint written by ShardedState)")
    rows = local_of(p)
    device = rows.device
    master = local_of(saved["master"])
    width = master.shape[1]
    sel = torch.tensor(saved["selected"], dtype=torch.long)
    cols = ranks.owned(complement(sel, width), width)
    moments = {name: local_of(saved[name]) for name in MOMENTS}
    built = saved["host_built"]
    entry = {"sel": sel.to(device), "unsel": cols.to(device), "d_step": saved["d_step"],
             "d_master": master[:, sel].to(device), **{f"d_{n}": m[:, sel].to(device) for n, m in moments.items()},
             "host_master": master[:, cols].contiguous() if built else None,
             **{f"host_{n}": m[:, cols].contiguous() if built else None for n, m in moments.items()},
             "host_cols": cols, "host_counts": list(counts), "host_step": saved["host_step"],
             "host_staged": saved["host_staged"], "width": width, "host_rows": rows.shape[0]}
    entry["host_accumulators"] = [local_of(saved[f"accumulator{slot}"])[:, cols].contiguous()
                                  for slot in range(len(counts))] if built else []
    return entry
