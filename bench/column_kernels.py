"""Which torch kernel gathers or scatters weight columns on the CPU at its byte bound? (docs/benchmarks.md, "Bound
ratios"). One thread, one `[out, in]` weight, the `topk_ratio` 0.1 split: every candidate for moving the 90% host
columns (and the 10% selected ones) timed beside a plain contiguous copy of the bytes it moves, interleaved.

    .venv/bin/python bench/column_kernels.py [--shape 4096 4096] [--repeats 10] [--out results/bounds/<hw>/]

Prints a Markdown table (and writes column-kernels.md to --out): the median time and its ratio to the copy.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import torch
from tabulate import tabulate

from zenflow.harness.atomic import write_text_atomic
from zenflow.layout import as_bits


def candidates(g: torch.Tensor, cols: torch.Tensor, label: str) -> dict[str, Callable[[], object]]:
    """Ways to move columns `cols` of `g` ([out, in]) into a compact [out, n] block and back."""
    out, width = g.shape
    n = cols.numel()
    dst = torch.empty(out, n, dtype=g.dtype)
    back = g.clone()
    g32, dst32 = g.float(), torch.empty(out, n)
    mask = torch.zeros(width, dtype=torch.bool)
    mask[cols] = True
    rows = 16  # per-row-block 1-D gather: one index for `rows` rows, relative to the block's start
    flat = (torch.arange(rows).unsqueeze(1) * width + cols).reshape(-1)
    blocks, dst_blocks = g.view(out // rows, rows * width), dst.view(out // rows, rows * n)
    transposed = torch.empty(width, out, dtype=g.dtype)

    def per_row_blocks() -> None:
        for b in range(out // rows):
            torch.index_select(blocks[b], 0, flat, out=dst_blocks[b])

    def assign(full: torch.Tensor, index: torch.Tensor, block: torch.Tensor) -> None:
        full[:, index] = block

    # inductor's C++ loops: one row at a time, so the gather's reads stay inside a row (compiled at the warm-up call)
    compiled_gather = torch.compile(lambda full, index: full[:, index], dynamic=False)
    compiled_scatter = torch.compile(assign, dynamic=False)

    return {
        f"gather {label}: index_select dim 1 (CUDA's)": lambda: torch.index_select(g, 1, cols, out=dst),
        f"gather {label}: index_select dim 1, fp32 data": lambda: torch.index_select(g32, 1, cols, out=dst32),
        f"gather {label}: torch.gather, expanded index": lambda: torch.gather(g, 1, cols.expand(out, n), out=dst),
        f"gather {label}: torch.gather on the int16 bits (the CPU's)":
            lambda: torch.gather(as_bits(g), 1, cols.expand(out, n), out=as_bits(dst)),
        f"gather {label}: masked_select": lambda: torch.masked_select(g, mask.expand(out, width)),
        f"gather {label}: 1-D index_select per {rows} rows": per_row_blocks,
        f"gather {label}: transpose through copy_": lambda: transposed.copy_(g.t()),
        f"gather {label}: torch.compile of g[:, cols]": lambda: compiled_gather(g, cols),
        f"scatter {label}: index_copy_ dim 1 (CUDA's)": lambda: back.index_copy_(1, cols, dst),
        f"scatter {label}: scatter_, expanded index": lambda: back.scatter_(1, cols.expand(out, n), dst),
        f"scatter {label}: scatter_ on the int16 bits (the CPU's)":
            lambda: as_bits(back).scatter_(1, cols.expand(out, n), as_bits(dst)),
        f"scatter {label}: torch.compile of g[:, cols] = block": lambda: compiled_scatter(back, cols, dst),
        f"scatter {label}: masked_scatter_": lambda: back.masked_scatter_(mask.expand(out, width), dst),
    }


def layout_rows(g: torch.Tensor, repeats: int) -> list[list[str]]:
    """The device layout that would make every column move a row copy: a column-major weight. `F.linear` forward
    and backward (a micro-batch of 8 tokens, the weight's gradient only) with the model's row-major weight and with
    the same weight column-major, interleaved."""
    x = torch.randn(8, g.shape[1], generator=torch.Generator().manual_seed(1)).to(g.dtype)

    def forward_backward(weight: torch.nn.Parameter) -> Callable[[], object]:
        def run() -> None:
            weight.grad = None
            torch.nn.functional.linear(x, weight).float().sum().backward()
        return run

    row_major = torch.nn.Parameter(g.clone())
    column_major = torch.nn.Parameter(g.t().contiguous().t())
    column, row = measure(forward_backward(column_major), forward_backward(row_major), repeats)
    return [["F.linear forward + backward, column-major weight", f"{column * 1e3:.2f}", f"{row * 1e3:.2f}",
             f"{column / row:.1f}"]]


def measure(fn: Callable[[], object], reference: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median seconds of `fn` and of `reference`, interleaved call by call (one warm-up each)."""
    fn(), reference()
    mine, ref = [], []
    for _ in range(repeats):
        for f, times in ((reference, ref), (fn, mine)):
            start = time.perf_counter()
            f()
            times.append(time.perf_counter() - start)
    return statistics.median(mine), statistics.median(ref)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", type=int, nargs=2, default=[4096, 4096], metavar=("OUT", "IN"))
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", type=Path, default=None, help="folder to write column-kernels.md into")
    args = ap.parse_args(argv)
    out, width = args.shape
    if out % 16 or out <= 0 or width <= 0 or args.repeats < 1:
        ap.error("--shape OUT IN: positive, OUT a multiple of 16; --repeats >= 1")
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(out, width, generator=gen).to(torch.bfloat16)
    selected = torch.sort(torch.randperm(width, generator=gen)[: max(1, width // 10)]).values
    keep = torch.ones(width, dtype=torch.bool)
    keep[selected] = False
    rows = []
    for cols, label in ((keep.nonzero().squeeze(1), "90%"), (selected, "10%")):
        for name, fn in candidates(g, cols, label).items():
            moved = out * cols.numel() * (4 if "fp32" in name else 2)  # bytes of the block it produces or reads
            src, dst = torch.ones(moved, dtype=torch.uint8), torch.empty(moved, dtype=torch.uint8)
            seconds, ref = measure(fn, lambda s=src, d=dst: d.copy_(s), args.repeats)
            rows.append([name, f"{seconds * 1e3:.2f}", f"{ref * 1e3:.2f}", f"{seconds / ref:.1f}"])
    layout = layout_rows(g, max(3, args.repeats // 3))
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU") if Path("/proc/cpuinfo").exists() else "unknown CPU"
    day = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = (f"Column kernels on {cpu}, one thread, [{out}, {width}] bf16, {day}, torch {torch.__version__}; "
            f"`bench/column_kernels.py --shape {out} {width} --repeats {args.repeats}` made this table.\n\n"
            + tabulate(rows, headers=["kernel", "median ms", "copy of its bytes ms", "× the copy"],
                       tablefmt="github", disable_numparse=True) + "\n\n"
            + tabulate(layout, headers=["device layout", "median ms", "row-major (the model's) ms", "× row-major"],
                       tablefmt="github", disable_numparse=True) + "\n")
    print(text, end="")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        write_text_atomic(args.out / "column-kernels.md", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
