"""Moving columns between owners at a reselection: values and moments go with them, nothing is zeroed.

Only the columns that change owner move (fp32 master values and both moments); the moments are re-expressed for
the receiving side's step count so the bias-corrected moments are exactly preserved (adam.rebase_moment_).
"""

from __future__ import annotations

import torch

from zenflow.adam import AdamWHyper, rebase_moment_
from zenflow.distributed import DataParallel
from zenflow.host import HostColumns
from zenflow.link import Link
from zenflow.selection import complement


def move_columns(st: dict, new_sel: torch.Tensor, link: Link, hp: AdamWHyper, model_dtype: torch.dtype,
                 n_accumulators: int, n_staging: int = 1, dp: DataParallel | None = None) -> None:
    """Hand the columns that change owner (fp32 values and moments) to their new side; keep the rest.

    With data parallelism (`dp`) every rank holds the device side and its own block of the host side: a column
    leaving the device goes to the host of the rank that owns it; a column arriving on the device comes from its
    owner's host to every rank (assembled: one rank fills each column)."""
    part: HostColumns = st["host"]
    device = st["sel"].device
    width = st["width"]
    old_sel, new_sel = st["sel"].cpu(), new_sel.cpu()  # device->host sync point (indices)
    link.observers.transfer("d2h", "indices", new_sel.numel() * 8)
    if torch.equal(old_sel, new_sel):
        return  # nobody changes owner (always so with topk_ratio 0): nothing moves
    if old_sel.numel() == 0:
        st["d_step"] = part.step  # first selection: the device continues the host's count
    new_host_cols = complement(new_sel, width)
    if dp:
        new_host_cols = dp.owned(new_host_cols, width)  # this rank's block
    on_device = _positions(old_sel, width)  # column -> position in the device buffers, or -1
    on_host = _positions(part.cols, width)  # column -> position in this host's buffers, or -1
    leaving = old_sel[~torch.isin(old_sel, new_sel)]  # device -> host
    leaving = dp.owned(leaving, width) if dp else leaving  # ... of this rank
    entering = new_sel[on_device[new_sel] < 0]  # host -> device
    host_state = dict(master=part.master, exp_avg=part.exp_avg, exp_avg_sq=part.exp_avg_sq)
    new_host, new_device = {}, {}
    for name, host in host_state.items():
        kind = "master" if name == "master" else "moments"
        on_device_buffer = st[f"d_{name}"]
        moved_down = _fetch(link, on_device_buffer.index_select(1, on_device[leaving].to(device)), kind)
        if dp:  # every rank needs the arriving columns; each is on one rank's host
            moved_up = dp.from_owners(host, entering, width, on_host).to(dp.device)  # nccl: on the GPU
            dp.sum_(moved_up, "moved_state")
        else:
            moved_up = host.index_select(1, on_host[entering])
        if name != "master":  # keep bias-corrected moments exact across the move
            beta = hp.beta1 if name == "exp_avg" else hp.beta2
            rebase_moment_(moved_down, beta, st["d_step"], part.step)
            rebase_moment_(moved_up, beta, part.step, st["d_step"])
        new_host[name] = _merge(new_host_cols, part.cols, host, leaving, moved_down, on_host)
        new_device[name] = _merge(new_sel.to(device), old_sel.to(device), on_device_buffer, entering.to(device),
                                  _send(link, moved_up, device, kind), on_device.to(device))
    st["host"] = HostColumns.create(**new_host, cols=new_host_cols, model_dtype=model_dtype,
                                    n_accumulators=n_accumulators, host_empty=link.host_empty, step=part.step,
                                    n_staging=n_staging)
    st.update({f"d_{name}": t for name, t in new_device.items()})
    st["sel"], st["unsel"] = new_sel.to(device), new_host_cols.to(device)
    link.observers.transfer("h2d", "indices", new_host_cols.numel() * 8)


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
    """Columns `wanted` (ascending), taken from `kept` where listed in `kept_cols`, else from `arriving`
    (whose columns `arriving_cols` are ascending too, so both keep their order)."""
    out = torch.empty(kept.shape[0], wanted.numel(), dtype=kept.dtype, device=kept.device)
    from_kept = kept_pos[wanted] >= 0
    out[:, from_kept] = kept.index_select(1, kept_pos[wanted[from_kept]])
    out[:, ~from_kept] = arriving
    return out
