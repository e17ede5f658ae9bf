"""The byte bound of every part of a ZenFlow step, the check that holds each part to it (bench/test_bounds.py) and
the table of a run (`python -m zenflow.reports.bounds RUN.json`).

A part's *bound* is the time of a plain contiguous copy that moves the bytes the part must move at least, timed on
the same device in the same run, round by round beside the part. Its *bound ratio* is the part's time over the
copy's, paired by round (their geometric mean): 1 means the part runs at the memory system's speed for its bytes;
12 means it spends eleven twelfths of its time on something other than moving its bytes (a strided gather, a slow
kernel). docs/design.md §4 has the table; the bytes are per column weight `[out, in]` with `k` selected columns,
`n` host columns and a model dtype of `b` bytes:

| part               | what it must move at least                                         | copy          |
|--------------------|--------------------------------------------------------------------|---------------|
| selection          | the gradient read once (column norms): out·in·b                    | on the device |
| device-update      | selected gradient read, fp32 master and moments read and written,  | on the device |
|                    | weight columns written: out·k·(2b + 24)                            |               |
| gradient-offload   | the unselected gradient columns across the link: out·n·b           | device → host |
| host-accumulate    | staging read, fp32 sum read and written: out·n·(b + 8)             | on the host   |
| host-adamw         | fp32 mean gradient read, master and moments read and written, the  | on the host   |
|                    | model-dtype result written: out·n·(28 + b)                         |               |
| parameter-upload   | the updated host columns across the link: out·n·b                  | host → device |
| device-accumulate  | unselected gradient read, fp32 sum read and written: out·n·(b + 8) | on the device |
| ship               | the interval's fp32 sum across the link: 4·out·n                   | device → host |

A copy of B bytes within one memory reads B and writes B, so a part that moves T bytes within one memory is timed
against a copy of T/2 bytes; across the link the bytes crossing are the copy's size.

Memory moves whole cache lines, so a part that reads or writes scattered columns of a row-major weight also has a
*line floor*: the device update reads every 64-byte line of the gradient that holds a selected element and reads
and writes every such line of the weight (a partial line is read before it is written), beside its 24 bytes of fp32
state per selected element: out·(3·L·64 + 24·k) for L lines per row (device_update_line_floor). With a tenth of
4096 bf16 columns selected at random, L is ~97% of a row's lines: the floor is ~3x the bound, and no kernel on a
row-major weight gets under it. The table reports the part's time against both; the goal and the limits are on the
bound.

The limits on the ratios are the `[bound_ratios]` table of bench/thresholds.toml, keyed `<device>/<part>` (fnmatch
patterns, the last match wins).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import tomllib
import torch
from tabulate import tabulate

from zenflow.harness.atomic import write_text_atomic
from zenflow.reports.intervals import ratio_interval

THRESHOLDS_FILE = Path("bench/thresholds.toml")
CYCLE = "zenflow-cycle"  # bench/test_step_ratio.py: ZenFlow's cycle mean over ZeRO-Offload's step, not a byte bound
TARGET = 1.5  # the goal for every CPU column part: within 1.5x its bound (docs/design.md §4)
CYCLE_TARGET = 0.8  # the goal for ZenFlow's cycle mean (topk 0.1, U 4, sync) over ZeRO-Offload's step
# bench/test_step_ratio.py: in overlap mode, the training thread's step() at an accumulation step over the device
# update's byte bound for the same layers (the host's work is the worker's: what is left is the device update)
OVERLAP = "overlap-accumulate"


@dataclass(frozen=True)
class Part:
    """A part of the step: where its reference copy runs and the bytes it must move for one weight."""

    where: str                                          # "device", "host", "d2h" or "h2d"
    traffic: Callable[[int, int, int, int, int], int]   # (out, in, k, n, b) -> bytes moved (or crossing the link)


PARTS: dict[str, Part] = {
    "selection": Part("device", lambda out, in_, k, n, b: out * in_ * b),
    "device-update": Part("device", lambda out, in_, k, n, b: out * k * (2 * b + 24)),
    "gradient-offload": Part("d2h", lambda out, in_, k, n, b: out * n * b),
    "host-accumulate": Part("host", lambda out, in_, k, n, b: out * n * (b + 8)),
    "host-adamw": Part("host", lambda out, in_, k, n, b: out * n * (28 + b)),
    "parameter-upload": Part("h2d", lambda out, in_, k, n, b: out * n * b),
    "device-accumulate": Part("device", lambda out, in_, k, n, b: out * n * (b + 8)),
    "ship": Part("d2h", lambda out, in_, k, n, b: 4 * out * n),
}


LINE = 64  # bytes in a cache line


def touched_lines(columns: torch.Tensor, b: int) -> int:
    """Cache lines of one row (starting on a line) that hold at least one of `columns` of `b` bytes each."""
    return int(torch.unique(columns.cpu() * b // LINE).numel())


def device_update_line_floor(out: int, selected: torch.Tensor, b: int) -> int:
    """The device update's traffic in whole cache lines for one `[out, in]` weight whose `selected` columns hold
    `b` bytes each: the gradient's touched lines read, the weight's read and written, 24 bytes of fp32 state each."""
    return out * (3 * touched_lines(selected, b) * LINE + 24 * selected.numel())


def line_floor_ratio(measured: BoundRatio, bound_bytes: int, floor_traffic: int) -> float:
    """The part's time over a copy of its line floor (half the floor's traffic, as copy_bytes halves), at the rate
    the reference copy ran: the bound ratio scaled by the bytes."""
    return measured.ratio * bound_bytes / (floor_traffic // 2)


def copy_bytes(part: str, out: int, in_: int, k: int, n: int, b: int) -> int:
    """The size of the reference copy of `part` for one weight: its traffic, halved within one memory."""
    spec = PARTS[part]
    traffic = spec.traffic(out, in_, k, n, b)
    return traffic if spec.where in ("d2h", "h2d") else traffic // 2


def reference_copy(where: str, nbytes: int, device: torch.device) -> Callable[[], None]:
    """A plain contiguous copy of `nbytes` bytes: within the device or the host, or across the link (pinned host
    memory on CUDA); it ends with a CUDA sync point, so its time covers the copy."""
    host = torch.device("cpu")
    cuda = device.type == "cuda"
    src_on, dst_on = {"device": (device, device), "host": (host, host), "d2h": (device, host),
                      "h2d": (host, device)}[where]
    src = torch.ones(nbytes, dtype=torch.uint8, device=src_on, pin_memory=cuda and src_on == host)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_on, pin_memory=cuda and dst_on == host)

    def copy() -> None:
        dst.copy_(src, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()

    return copy


class InterleavedReference:
    """The reference copy, timed once before every round of the part (pytest-benchmark's `setup` hook), so part
    and bound see the same machine, round by round."""

    def __init__(self, copy: Callable[[], None], prepare: Callable[[], None] | None = None) -> None:
        self.copy = copy
        self.prepare = prepare  # untimed per-round setup of the part itself (e.g. a staged flag)
        self.seconds: list[float] = []

    def __call__(self) -> None:
        start = time.perf_counter()
        self.copy()
        self.seconds.append(time.perf_counter() - start)
        if self.prepare is not None:
            self.prepare()


@dataclass(frozen=True)
class BoundRatio:
    ratio: float              # part time / reference time, paired by round: the geometric mean
    low: float | None         # its 95% interval (Student's t on the logs of the paired ratios)
    high: float | None
    reference_gbps: float     # the reference copy's speed, bytes copied per second / 1e9


def bound_ratio(part_seconds: list[float], reference_seconds: list[float], nbytes: int) -> BoundRatio:
    """The ratios paired by round (the last rounds of the reference: earlier ones belong to warm-up rounds): their
    geometric mean and its 95% interval; the copy's speed from its median."""
    reference = reference_seconds[-len(part_seconds):]
    iv = ratio_interval(dict(enumerate(part_seconds)), dict(enumerate(reference)))
    return BoundRatio(iv.center, iv.low, iv.high, nbytes / statistics.median(reference) / 1e9)


def load_limits(path: str | Path = THRESHOLDS_FILE) -> dict[str, float]:
    """The `[bound_ratios]` table: `<device>/<part>` pattern -> the largest bound ratio allowed."""
    data = tomllib.loads(Path(path).read_text()) if Path(path).exists() else {}
    limits = {str(k): float(v) for k, v in data.get("bound_ratios", {}).items()}
    names = [*PARTS, CYCLE, OVERLAP]
    unknown = [k for k in limits if not any(_matches(f"{d}/{p}", k) for d in ("cpu", "cuda") for p in names)]
    if unknown:
        raise ValueError(f"{path} [bound_ratios]: {unknown} name no part; expected <cpu|cuda>/<part> with part one "
                         f"of {sorted(names)}")
    return limits


def limit_for(device: str, part: str, limits: dict[str, float]) -> float | None:
    """The limit of `device/part` (the last matching pattern wins), or None when none matches."""
    found = None
    for pattern, value in limits.items():
        if _matches(f"{device}/{part}", pattern):
            found = value
    return found


def violation(device: str, part: str, measured: BoundRatio, limits: dict[str, float]) -> str | None:
    """One line when the part's bound ratio is over its limit, else None."""
    limit = limit_for(device, part, limits)
    if limit is None or measured.ratio <= limit:
        return None
    return (f"{device}/{part}: bound ratio {measured.ratio:.2f} is over its limit {limit:g} "
            f"(bench/thresholds.toml [bound_ratios]; the reference copy ran at {measured.reference_gbps:.1f} GB/s)")


def _matches(name: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(name, pattern)


# ---- the table of a bench run (docs/benchmarks.md links the committed one) -----------------------------------------
def table(bench_json: dict, limits: dict[str, float]) -> str:
    """A Markdown table of every bound benchmark of a pytest-benchmark JSON run: part, shape, median, the copy's
    GB/s, bound ratio with its 95% interval, the limit and whether the part is at its goal (within 1.5x its bound;
    ZenFlow's cycle: within 0.8x ZeRO-Offload's step), and the time over the line floor where a part has one."""
    machine = bench_json.get("machine_info", {})
    rows = []
    for bench in bench_json.get("benchmarks", []):
        info = bench.get("extra_info", {})
        if "bound_ratio" not in info:
            continue
        limit = limit_for(info["device"], info["part"], limits)
        median_ms = info.get("cycle_ms", bench["stats"]["median"] * 1e3)  # a cycle: step() only, per step
        rows.append([info["part"], "x".join(map(str, info["shape"])), f"{median_ms:.2f}",
                     f"{info['reference_gbps']:.1f}" if info["reference_gbps"] else "ZeRO-Offload's step",
                     f"{info['bound_ratio']:.2f}",
                     f"{info['bound_ratio_low']:.2f}-{info['bound_ratio_high']:.2f}",
                     f"{info['line_floor_ratio']:.2f}" if "line_floor_ratio" in info else "—",
                     "—" if limit is None else f"{limit:g}",
                     "yes" if info["bound_ratio"] <= (CYCLE_TARGET if info["part"] == CYCLE else TARGET) else "no"])
    head = (f"Bound ratios on {machine.get('cpu_model') or machine.get('gpu_name')} ({machine.get('hardware_id')}), "
            f"{bench_json.get('datetime', '')[:10]}, commit {str(machine.get('git_commit'))[:7]}; "
            f"`python -m zenflow.reports.bounds RUN.json` made this table from the run.\n\n")
    return head + tabulate(rows, headers=["part", "shape", "median ms", "copy GB/s", "bound ratio", "95% interval",
                                          "× line floor", "limit", "at its goal"],
                           tablefmt="github", disable_numparse=True) + "\n"



def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Markdown table of the bound ratios in a pytest-benchmark JSON run")
    ap.add_argument("run", type=Path, help="pytest-benchmark JSON (--benchmark-json) of bench/test_bounds.py")
    ap.add_argument("--thresholds", type=Path, default=THRESHOLDS_FILE)
    ap.add_argument("--publish", type=Path, default=None, metavar="DIR",
                    help="write the run and its table to DIR/<hardware-id>/bounds.json and bounds.md")
    args = ap.parse_args(argv)
    if not args.run.is_file():
        ap.error(f"{args.run}: no such file")
    run = json.loads(args.run.read_text())
    text = table(run, load_limits(args.thresholds))
    if args.publish is None:
        print(text, end="")
        return 0
    folder = args.publish / str(run.get("machine_info", {}).get("hardware_id") or "unknown-hardware")
    folder.mkdir(parents=True, exist_ok=True)
    for name, content in (("bounds.json", args.run.read_text()), ("bounds.md", text)):
        write_text_atomic(folder / name, content)  # an interrupted write never leaves a half-written file
    print(f"wrote {folder / 'bounds.json'} and {folder / 'bounds.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
