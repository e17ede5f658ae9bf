"""What ZenFlowAdamW holds: per-parameter state and the step clock, plain objects that the step's functions read and
write and that the checkpoint saves field by field (checkpoint.py).

A trainable parameter with two or more dimensions is a *column param* `W[out, in]` (ColumnState): its selected
columns are updated on the device from the fp32 state held here, the others on the host (`host`, a HostColumns).
Every other parameter is *dense* (DenseState): AdamW on the device every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zenflow.adam import AdamWHyper
from zenflow.host import HostColumns
from zenflow.selection import as_columns


@dataclass
class DenseState:
    """A dense param's AdamW state, on the device."""

    master: torch.Tensor | None  # fp32 copy of a lower-precision param (small updates survive); None: fp32 param
    exp_avg: torch.Tensor        # fp32, the param's shape
    exp_avg_sq: torch.Tensor     # fp32
    step: int = 0                # AdamW updates applied

    @classmethod
    def new(cls, p: torch.Tensor) -> DenseState:
        # fp32 params are their own master; lower precision ones get an fp32 master (small updates survive)
        master = p.detach().float().clone() if p.dtype != torch.float32 else None
        return cls(master=master, exp_avg=torch.zeros_like(p, dtype=torch.float32),
                   exp_avg_sq=torch.zeros_like(p, dtype=torch.float32))


@dataclass
class ColumnState:
    """A column param's state: the device side (its selected columns) and the host side (`host`)."""

    host: HostColumns           # this host's unselected columns (every one, or this rank's block of them)
    sel: torch.Tensor           # [k] int64 on the device, ascending: the device-owned (selected) columns
    unsel: torch.Tensor         # host.cols on the device: the columns the offload gathers (whole rows: shadows too)
    width: int                  # in: the weight's column count
    d_master: torch.Tensor      # [out, k] fp32 on the device: the selected columns' master values
    d_exp_avg: torch.Tensor     # [out, k] fp32
    d_exp_avg_sq: torch.Tensor  # [out, k] fp32
    d_step: int = 0             # device AdamW updates applied to this parameter
    # device accumulation only (accumulate_on="device", device_accumulation.py): this interval's fp32 sum of the
    # host's unselected gradient columns, [out, n_host] on the parameter's device, allocated at its first use
    d_acc: torch.Tensor | None = None
    d_acc_count: int = 0                          # gradients summed in d_acc since its last ship
    d_acc_shipped: torch.cuda.Event | None = None  # CUDA: d_acc's last ship; the next write waits for it

    @classmethod
    def new(cls, p: torch.Tensor, mine: torch.Tensor, n_accumulators: int, n_staging: int,
            whole_rows: bool = False) -> ColumnState:
        """Nothing selected yet; `mine`: the columns this host owns (ascending, on the CPU); `whole_rows`: the host
        part's layout (layout.py), for the whole run."""
        w = as_columns(p)
        # no host buffer yet: built at its first offload (ownership.prepare_host_), of the host's columns only
        host = HostColumns.pending(w.shape[0], mine, p.dtype, n_accumulators, n_staging, whole_rows=whole_rows)
        sel = torch.empty(0, dtype=torch.long, device=p.device)
        unsel = mine.to(p.device)
        empty = torch.zeros(w.shape[0], 0, dtype=torch.float32, device=p.device)
        return cls(host=host, sel=sel, unsel=unsel, width=w.shape[1], d_master=empty, d_exp_avg=empty.clone(),
                   d_exp_avg_sq=empty.clone())


ParamState = ColumnState | DenseState


@dataclass
class StepView:
    """What a step's functions read: the param groups and the state keyed by the tensors they update. The parameters
    themselves, or with FSDP2 aliases of this rank's rows (zenflow/fsdp.py: sharded_view)."""

    groups: list[dict]
    state: dict

    def params(self) -> list[torch.Tensor]:
        """The trainable parameters, in order."""
        return [p for g in self.groups for p in g["params"] if p.requires_grad]


@dataclass
class Clock:
    """The step counters, saved with every checkpoint (checkpoint.py reads them with `asdict`)."""

    t: int = 0                 # applied steps (skipped overflow steps do not count)
    skipped_steps: int = 0     # overflow steps skipped
    host_updates: int = 0      # boundaries so far
    selections: int = 0        # top-k selections made (the first included; none with topk 0)
    since_boundary: int = 0    # steps accumulated since the last boundary
    slot: int = 0              # the accumulator being filled (two alternate with overlap_step)
    select_next: bool = False  # parameters joined since the last selection: select at the next step


def offloads(p: torch.Tensor, st: ParamState) -> bool:
    """Whether this step sends columns of `p`'s gradient to the host (any rank's: with data parallelism a rank
    whose block holds none of them still counts the step, so every rank's host step count stays the same)."""
    return p.grad is not None and isinstance(st, ColumnState) and st.sel.numel() < as_columns(p).shape[1]


def column_states(param_groups: list[dict], state: dict) -> list[tuple[torch.Tensor, ColumnState]]:
    """(param, state) of every column param, frozen ones too, in parameter order."""
    return [(p, st) for g in param_groups for p in g["params"] if isinstance(st := state.get(p), ColumnState)]


def host_groups(param_groups: list[dict], state: dict) -> list[tuple[list[HostColumns], AdamWHyper]]:
    """Per param group: the host parts of its column params and its hyperparameters (what host AdamW reads)."""
    return [([st.host for _, st in column_states([g], state)], AdamWHyper.of(g)) for g in param_groups]
