"""Who holds which columns: selection, moving columns between owners, and the host part's lazy build and staging.

Only the columns that change owner move (fp32 master values and both moments); the moments are re-expressed for
the receiving side's step count so the bias-corrected moments are exactly preserved (adam.rebase_moment_). A host
part is built at the first step that offloads its parameter (HostColumns.pending): before that nothing updated its
columns, so the weight holds their values and the moments are zero, and a first selection takes the columns it
hands to the device straight from the weight, without any host buffer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zenflow.adam import AdamWHyper, rebase_moment_
from zenflow.config import ZenFlowConfig
from zenflow.distributed import Ranks
from zenflow.host import HostColumns
from zenflow.layout import host_columns, shadow_positions, take_columns
from zenflow.link import Link, StagingArena
from zenflow.selection import as_columns, num_selected, select_columns
from zenflow.state import ColumnState, offloads


def reselect(params: list[torch.Tensor], state: dict, config: ZenFlowConfig, link: Link, ranks: Ranks,
             hypers: dict[int, AdamWHyper]) -> None:
    """Rank every column param that has a gradient and give its top-k columns to the device (`hypers`: each
    parameter's group's, by id)."""
    for p in params:
        st = state[p]
        if isinstance(st, ColumnState) and p.grad is not None:
            grad = as_columns(p.grad)
            k = num_selected(grad.shape[1], config.topk_ratio)
            ranked = 0 < k < grad.shape[1]  # none or every column: no scores needed
            scores = ranks.column_scores(grad, config.column_norm) if ranked else None
            new_sel = select_columns(grad, k, config.column_norm, scores)
            ranks.share_entering_gradients_(grad, new_sel, st.sel)  # their averaged gradient is on their owner only
            move_columns(st, new_sel, as_columns(p), link, hypers[id(p)], ranks)


def move_columns(st: ColumnState, new_sel: torch.Tensor, weight: torch.Tensor, link: Link, hp: AdamWHyper,
                 ranks: Ranks) -> None:
    """Hand the columns that change owner (fp32 values and moments) to their new side; keep the rest.

    With data parallelism (`ranks`) every rank holds the device side and its own block of the host side: a column
    leaving the device goes to the host of the rank that owns it; a column arriving on the device comes from its
    owner's host to every rank (assembled: one rank fills each column). `weight` is the parameter as `[out, in]`."""
    part = st.host
    device = st.sel.device
    width = st.width
    old_sel, new_sel = st.sel.cpu(), new_sel.cpu()  # device->host sync point (indices)
    link.observers.transfer("d2h", "indices", new_sel.numel() * 8)
    if torch.equal(old_sel, new_sel):
        return  # nobody changes owner: nothing moves
    if old_sel.numel() == 0:
        st.d_step = part.step  # first selection: the device continues the host's count
    block = ranks.owned(torch.arange(width), width)  # this host's columns: every one, or this rank's block
    new_host_cols = host_columns(block, new_sel, part.whole_rows)  # whole rows: the block, shadows and all
    layout = dict(whole_rows=part.whole_rows, shadow=shadow_positions(new_host_cols, new_sel))
    if part.built:
        new_device = _move_built(st, part, old_sel, new_sel, new_host_cols, link, hp, ranks, layout)
    elif old_sel.numel() == 0:  # never built: the device's columns come from the weight, the host keeps none
        master = weight.index_select(1, new_sel.to(device)).float()  # a fresh tensor, exact for any model dtype
        new_device = dict(master=master, exp_avg=torch.zeros_like(master), exp_avg_sq=torch.zeros_like(master))
        st.host = HostColumns.pending(part.rows, new_host_cols, part.dtype, len(part.counts), part.n_staging,
                                      **layout)
    else:
        raise RuntimeError("zenflow: a host part was never built although columns are on the device")
    st.d_master, st.d_exp_avg, st.d_exp_avg_sq = new_device["master"], new_device["exp_avg"], new_device["exp_avg_sq"]
    st.sel, st.unsel = new_sel.to(device), new_host_cols.to(device)
    link.observers.transfer("h2d", "indices", st.host.n_offloaded * 8)  # a link carries no shadow's index


def _move_built(st: ColumnState, part: HostColumns, old_sel: torch.Tensor, new_sel: torch.Tensor,
                new_host_cols: torch.Tensor, link: Link, hp: AdamWHyper, ranks: Ranks, layout: dict) -> dict:
    """Move between a built host part and the device; the new host part replaces the old one (its staging is carved
    at the next step), one parameter at a time. Returns the new device buffers. Whole rows: a column leaving the
    device overwrites its shadow; one entering it is read from the host, where it was no shadow."""
    device, width = st.sel.device, st.width
    on_device = _positions(old_sel, width)  # column -> position in the device buffers, or -1
    on_host = _positions(part.cols, width)  # column -> position in this host's buffers, or -1
    leaving = old_sel[~torch.isin(old_sel, new_sel)]  # device -> host
    leaving = ranks.owned(leaving, width)  # ... of this rank
    entering = new_sel[on_device[new_sel] < 0]  # host -> device
    host_state = dict(master=part.master, exp_avg=part.exp_avg, exp_avg_sq=part.exp_avg_sq)
    new_host, new_device = {}, {}
    for name, host in host_state.items():
        kind = "master" if name == "master" else "moments"
        on_device_buffer = getattr(st, f"d_{name}")
        moved_down = _fetch(link, on_device_buffer.index_select(1, on_device[leaving].to(device)), kind)
        moved_up = ranks.columns_from_owners(host, entering, width, on_host)  # every rank needs them
        if name != "master":  # keep bias-corrected moments exact across the move
            beta = hp.beta1 if name == "exp_avg" else hp.beta2
            rebase_moment_(moved_down, beta, st.d_step, part.step)
            rebase_moment_(moved_up, beta, part.step, st.d_step)
        new_host[name] = _merge(new_host_cols, part.cols, host, leaving, moved_down, on_host)
        new_device[name] = _merge(new_sel.to(device), old_sel.to(device), on_device_buffer, entering.to(device),
                                  _send(link, moved_up, device, kind), on_device.to(device))
    st.host = HostColumns.create(**new_host, cols=new_host_cols, dtype=part.dtype,
                                    n_accumulators=len(part.counts), n_staging=part.n_staging, step=part.step,
                                    **layout)
    return new_device


# ---- the host part's buffers ------------------------------------------------------------------------------------
def carve_staging(arena: StagingArena, parts: list[HostColumns], settle: Callable[[], None]) -> None:
    """Point each part's staging buffers at its place in the arena (parts in parameter order).

    The same layout keeps every place, so parts that only changed object (a reselection) take their predecessor's.
    A changed layout (a part built, a width changed with data parallelism, parts restored) moves places: `settle`
    first waits until nothing reads or writes them any more (a sync point; rare), and an update staged for upload
    is re-cast from the master into its new place (exact: it is that cast)."""
    layout = [view for part in parts for view in part.staging_layout()]
    moved = layout != arena.layout
    if moved or any(part.staged and part.param_staging is None for part in parts):
        settle()
    if moved:
        for part in parts:  # drop the old views first: a buffer being outgrown is freed before the new one comes
            part.drop_views()
    views = iter(arena.carve(layout))
    for part in parts:
        fresh = part.param_staging is None
        part.take_views(views)
        if fresh and part.staged:
            part.param_staging.copy_(part.master)


def prepare_host_(arena: StagingArena, states: list[tuple[torch.Tensor, ColumnState]], link: Link,
                  settle: Callable[[], None]) -> None:
    """Before a step's offload: build the parts whose parameter offloads for the first time, after giving them
    (and parts new since the last step: a reselection's, a checkpoint's) their staging. `states`: every column
    param's (param, state), in parameter order."""
    pending = [(p, st) for p, st in states if not st.host.built and p.requires_grad and offloads(p, st)]
    building = {id(st.host) for _, st in pending}
    parts = [st.host for _, st in states if st.host.built or id(st.host) in building]
    if pending or any(part.param_staging is None for part in parts):
        carve_staging(arena, parts, settle)
    build_host_parts_(pending, link)


def build_host_parts_(pending: list[tuple[torch.Tensor, ColumnState]], link: Link) -> None:
    """Pending -> built, for the parts whose parameter offloads this step (their staging is carved): the weight's
    host-owned columns, never updated yet, cross once into the part's parameter staging (kind "master", model
    dtype), the fp32 master is made from there. One parameter at a time: at most one gathered block exists."""
    for p, st in pending:
        part = st.host
        weight = as_columns(p)
        block = weight if part.n_host == weight.shape[1] else take_columns(weight, st.unsel)
        counted = part.offloaded_elements * block.element_size()  # whole rows: the shadows cross no link
        link.wait(link.to_host(block, part.param_staging, "master", counted))  # sync point: once per parameter
        part.build_()


def _fetch(link: Link, src: torch.Tensor, kind: str) -> torch.Tensor:
    dst = link.host_empty(tuple(src.shape), src.dtype)
    link.wait(link.to_host(src, dst, kind))
    return dst


def _send(link: Link, src: torch.Tensor, device: torch.device, kind: str) -> torch.Tensor:
    dst = torch.empty(src.shape, dtype=src.dtype, device=device)
    link.to_device(src, dst, kind)
    return dst


def _positions(columns: torch.Tensor, width: int) -> torch.Tensor:
    """Inverse index: `pos[columns[i]] = i`, and -1 for columns not listed."""
    pos = torch.full((width,), -1, dtype=torch.long, device=columns.device)
    pos[columns] = torch.arange(columns.numel(), device=columns.device)
    return pos


def _merge(wanted: torch.Tensor, kept_cols: torch.Tensor, kept: torch.Tensor, arriving_cols: torch.Tensor,
           arriving: torch.Tensor, kept_pos: torch.Tensor) -> torch.Tensor:
    """Columns `wanted` (ascending), taken from `arriving` where listed in `arriving_cols` (ascending too, so both
    keep their order), else from `kept` (where listed in `kept_cols`). Arriving wins: a whole-rows host part keeps
    a shadow of every column that arrives from the device."""
    out = torch.empty(kept.shape[0], wanted.numel(), dtype=kept.dtype, device=kept.device)
    from_kept = (kept_pos[wanted] >= 0) & ~torch.isin(wanted, arriving_cols)
    out[:, from_kept] = kept.index_select(1, kept_pos[wanted[from_kept]])
    out[:, ~from_kept] = arriving
    return out
