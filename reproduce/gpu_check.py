"""The checks a GPU host must pass: environment, CUDA-vs-CPU differential, overlap memory vs its bound, NVML PCIe
counters vs ours, every engine on a small Llama. Writes gpu-check.json and table.md after every check (atomically:
a command killed midway leaves the checks it finished), each check's seconds in the record, and figure.png at the
end, to results/gpu-check/<hardware-id>/ (docs/gpu-check.md). On a CPU machine it runs the CPU part and says, per
check, what it could not check and why.

    python reproduce/gpu_check.py                     # what `make gpu-check` runs
    python reproduce/gpu_check.py --smoke             # a few steps, two engines (the test suite runs this)
    python reproduce/gpu_check.py --checks environment,differential,memory,pcie   # what gpu_window.py runs

Exit status: 0 all checks passed or could not run here, 1 a check failed, 2 NVML sees GPUs but torch cannot use CUDA.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from zenflow.harness.checks import arguments as cc
from zenflow.harness.checks import gpu as gc
from zenflow.harness.checks.pcie import pcie_check
from zenflow.telemetry.environment import capture_environment

ROOT = Path(__file__).resolve().parents[1]
# Test hook (tests/harness/checks/test_gpu_check.py): SIGKILL this process right after the record holds this many
# checks, as a command's time limit would.
KILL_AFTER = "ZENFLOW_GPU_CHECK_KILL_AFTER"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = cc.ArgumentParser(description=__doc__.split("\n\n")[0])  # one-line errors, exit 2 (checks/arguments.py)
    ap.add_argument("--smoke", action="store_true", help="8-step differential, two ref engines with 2+4 steps")
    ap.add_argument("--checks", type=cc.names_from(gc.CHECK_NAMES), default=list(gc.CHECK_NAMES),
                    help="the checks to run, comma-separated (default: all of " + ",".join(gc.CHECK_NAMES) + "); the "
                    "others say 'not checked: not asked'")
    ap.add_argument("--out", type=cc.out_folder, default=None, help="default: results/gpu-check/<hardware-id>")
    return ap.parse_args(argv)


def say(text: str) -> None:
    print(f"gpu-check: {text}", flush=True)


def _rows(record: dict[str, Any], key: str, result: Any) -> dict[str, Any]:
    """A check that returns (check, rows) keeps its rows in the record; a failed one (guarded) has none."""
    check, rows = result if isinstance(result, tuple) else (result, [])
    record[key] = rows
    return check


def plan_checks(args: argparse.Namespace, cuda: bool, out: Path, record: dict[str, Any]) -> list[
        tuple[str, Callable[[], dict[str, Any]]]]:
    """(what to say, how to run it) per check, in gc.CHECK_NAMES order."""
    report = record["environment"]

    def engines() -> dict[str, Any]:
        def saved(rows: list[dict]) -> None:  # after every run: a kill mid-check keeps the finished runs
            record["engines"] = rows
            gc.save_record(record, out)

        plan = gc.engine_plan(cuda, args.smoke)
        say(f"engines: {len(plan)} runs")
        return _rows(record, "engines", gc.guarded("engines", gc.run_engines, plan, out, cuda, on_row=saved))

    # a GPU host's `make test` stays short; the PCIe windows keep their 4096-wide layers, so the link's background
    # traffic (launches, doorbells) stays far below the 1% tolerance
    small = {"widths": (1024,) * 3, "steps": 6} if args.smoke else {}
    return [
        ("environment", lambda: gc.environment_check(report, cuda)),
        ("differential" + (" (CUDA vs CPU)" if cuda else " (no CUDA: CPU-vs-CPU self-check)"),
         lambda: _rows(record, "differential", gc.guarded("differential", gc.differential_check, cuda,
                                                          steps=8 if args.smoke else 24))),
        ("device memory, overlap vs sync", lambda: gc.guarded("memory", gc.memory_check, cuda, **small)),
        ("PCIe bytes, NVML vs ours", lambda: gc.guarded("pcie", pcie_check, cuda, steps=small.get("steps", 12))),
        ("engines", engines),
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    env = capture_environment()
    report = gc.environment_report(env)
    for key, value in report.items():
        say(f"{key}: {value}")
    stop = gc.cuda_unusable(env)
    if stop:  # fail fast: everything after this would measure the CPU under a GPU's name (audit item 16)
        print(f"gpu-check: STOP: {stop}", file=sys.stderr)
        return 2
    cuda = torch.cuda.is_available()
    out = args.out or ROOT / "results" / "gpu-check" / env["hardware_id"]
    problem = cc.folder_problem(out)  # the default folder (an --out was checked while parsing)
    if problem:
        return cc.refuse(f"argument --out: {str(out)!r} {problem}")
    mode = "smoke" if args.smoke else "full"
    record = gc.new_record(mode, cuda, report, env)
    for i, (title, run) in enumerate(plan_checks(args, cuda, out, record)):
        name = gc.CHECK_NAMES[i]
        if name not in args.checks:  # said, never silently left out
            record["checks"][i] = gc.check(name, "not checked", f"not asked (--checks {','.join(args.checks)})")
            continue
        say(title)
        began = time.perf_counter()
        record["checks"][i] = run()
        record["checks"][i]["seconds"] = round(time.perf_counter() - began, 1)  # budgets (gpu_window.py) read it
        record["elapsed_s"] = round(time.perf_counter() - start, 1)
        gc.save_record(record, out)  # after every check: a kill after check k leaves checks 1..k on disk
        if os.environ.get(KILL_AFTER) == str(i + 1):
            os.kill(os.getpid(), signal.SIGKILL)
    record["complete"] = True
    gc.save_record(record, out)
    try:
        gc.figure(record, out / "figure.png")
    except ImportError as exc:  # a GPU host's own environment may lack matplotlib: the record and table still stand
        say(f"figure not drawn: {exc}")
    for c in record["checks"]:
        say(f"{c['name']:<13} {c['status'].upper():<12} {c['reason'] or ''}")
    say(f"{record['elapsed_s']} s; record, table and figure in {out}")
    return gc.verdict(record["checks"])


if __name__ == "__main__":
    sys.exit(main())
