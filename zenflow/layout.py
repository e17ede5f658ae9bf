"""Which columns a host part spans: the host's unselected columns only (compact), or every column of its block
(whole rows). Decided once per optimizer (`whole_rows`), carried by every host part (HostColumns.whole_rows).

- **Compact** (CUDA): the device gathers the unselected columns at HBM speed, only their bytes cross the link, and
  the host's buffers hold them side by side, so every host kernel runs on contiguous memory.
- **Whole rows** (the CPU device): no torch kernel gathers or scatters bf16 columns on the CPU at its byte bound
  (ATen's gather along dim 1 copies one element per `memcpy` for every dtype but fp32; docs/benchmarks.md, "Bound
  ratios"). So the host part spans every column of its block (all of them, or this rank's contiguous block with data
  parallelism): the gradient offload, the accumulation, the host AdamW and the upload move whole rows at copy speed.
  The selected columns in the host buffers are *shadows*: the device holds them, the host's values there are stale
  and never read: the upload writes them back from the device's masters, a move at reselection overwrites a column
  leaving the device, a checkpoint saves the other columns only (the same format as compact), the "auto" masses and
  every byte counter skip them (the counters count what a link would carry: the unselected columns).

The price of whole rows is the shadows' share of the host work (`topk_ratio` of the columns) and memory; the gain is
every strided column copy of the host side. docs/design.md §2 ("Host layout") has the measurements behind the choice.
"""

from __future__ import annotations

import torch

from zenflow.config import ConfigError

HOST_LAYOUTS = ("auto", "compact", "rows")


def check_host_layout(value: object) -> str:
    """ZenFlowAdamW's `host_layout` keyword: "auto" (whole rows on the CPU device, compact on CUDA), "compact" or
    "rows"."""
    if not isinstance(value, str) or value not in HOST_LAYOUTS:
        raise ConfigError(f"host_layout = {value!r} is not allowed: expected one of {HOST_LAYOUTS}")
    return value


def whole_rows(host_layout: str, device: torch.device) -> bool:
    """Whether host parts span whole rows: "auto" decides by the device (the CPU device: whole rows)."""
    return host_layout == "rows" or (host_layout == "auto" and device.type == "cpu")


def host_columns(block: torch.Tensor, selected: torch.Tensor, rows: bool) -> torch.Tensor:
    """The columns a host part spans, given this host's `block` (ascending, on the CPU) and the `selected` ones:
    the whole block (whole rows), or the block less the selected columns (compact)."""
    if rows or selected.numel() == 0:
        return block
    return block[~torch.isin(block, selected.cpu())]


def shadow_positions(cols: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """Positions in `cols` (ascending) of the selected columns it holds: the shadows (none in a compact part)."""
    held = selected.cpu()
    held = held[torch.isin(held, cols)]
    return torch.searchsorted(cols, held)


def offloaded_positions(n_host: int, shadow: torch.Tensor) -> torch.Tensor:
    """Positions of a host part's columns that are not shadows (ascending)."""
    keep = torch.ones(n_host, dtype=torch.bool)
    keep[shadow] = False
    return keep.nonzero().squeeze(1)


def span(columns: torch.Tensor) -> slice | None:
    """`columns` (ascending, distinct, on the CPU) as a slice when they are one run of consecutive columns, else
    None: a run is copied as a strided slice, whole rows at a time, instead of gathered column by column."""
    if columns.device.type != "cpu" or columns.numel() == 0:
        return None
    first, last = int(columns[0]), int(columns[-1])
    return slice(first, last + 1) if last - first + 1 == columns.numel() else None


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """`t` as 16-bit integers when its dtype is a 16-bit float: the same bits, so moving them moves the values exactly.
    On the CPU, ATen's `gather` and `scatter_` along dim 1 have a tight loop for int16 and not for bf16/fp16
    (bench/column_kernels.py: 1.4x and 2.5x faster on the selected tenth of a 4096² weight's columns)."""
    return t.view(torch.int16) if _half_width(t) else t


def _half_width(t: torch.Tensor) -> bool:
    return t.is_floating_point() and t.element_size() == 2


def take_columns(t: torch.Tensor, columns: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`t[:, columns]` (into `out`, or a fresh tensor): a slice copy when the columns are one run; for a 16-bit
    float on the CPU, `torch.gather` over the expanded index on the bits (`as_bits`), the fastest torch way there
    (bench/column_kernels.py); else `index_select` (ATen's tight loop for fp32 on the CPU; CUDA's gather)."""
    run = span(columns)
    if run is not None:
        return t[:, run].clone() if out is None else out.copy_(t[:, run])
    if t.device.type == "cpu" and _half_width(t):
        if out is None:
            out = torch.empty(t.shape[0], columns.numel(), dtype=t.dtype)
        torch.gather(as_bits(t), 1, columns.expand(t.shape[0], columns.numel()), out=as_bits(out))
        return out
    return t.index_select(1, columns) if out is None else torch.index_select(t, 1, columns, out=out)


def put_columns(t: torch.Tensor, columns: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """`t[:, columns] = src` (in place; returns `t`): a slice copy when the columns are one run; on the CPU
    `scatter_` over the expanded index on the bits (`as_bits`), 2.5-4x faster there than `index_copy_`, which
    moves one element at a time in every dtype (bench/column_kernels.py); `index_copy_` on CUDA."""
    if src.shape != (t.shape[0], columns.numel()):  # scatter_ would take a larger src silently
        raise ValueError(f"put_columns: a block of shape {tuple(src.shape)} into {columns.numel()} columns of "
                         f"{tuple(t.shape)}: expected ({t.shape[0]}, {columns.numel()})")
    run = span(columns)
    if run is not None:
        t[:, run].copy_(src)
    elif t.device.type == "cpu":
        as_bits(t).scatter_(1, columns.expand(t.shape[0], columns.numel()), as_bits(src))
    else:
        t.index_copy_(1, columns, src)
    return t


def widen(compact: torch.Tensor, positions: torch.Tensor, width: int) -> torch.Tensor:
    """A whole-rows buffer of `width` columns holding `compact`'s columns at `positions`, zeros in the others
    (shadows: never read). A checkpoint's compact state into a whole-rows part."""
    out = torch.zeros(compact.shape[0], width, dtype=compact.dtype, device=compact.device)
    return put_columns(out, positions.to(compact.device), compact)
