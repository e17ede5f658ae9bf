"""The checks a GPU host must pass, the rows of zenflow/harness/checks/gpu.py's CHECKS in order. Writes
gpu-check.json and table.md after every check (atomically: a command killed midway leaves the checks it finished),
each check's seconds in the record, and figure.png at the end, to results/gpu-check/<hardware-id>/
(docs/gpu-check.md). On a CPU machine it runs the CPU part and says, per check, what it could not check and why.

    python reproduce/gpu_check.py                     # what `make gpu-check` runs
    python reproduce/gpu_check.py --smoke             # a few steps, two engines (the test suite runs this)
    python reproduce/gpu_check.py --checks environment,memory   # only these (gpu_window.py: the rows marked window)

Exit status: 0 all checks passed or could not run here, 1 a check failed, 2 NVML sees GPUs but torch cannot use CUDA.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import torch

from zenflow.harness import cli
from zenflow.harness.checks import gpu, render
from zenflow.harness.checks.verdict import check, verdict
from zenflow.telemetry.environment import capture_environment

ROOT = Path(__file__).resolve().parents[1]
# Test hook (tests/harness/checks/test_gpu_check.py): SIGKILL this process right after the record holds this many
# checks, as a command's time limit would.
KILL_AFTER = "ZENFLOW_GPU_CHECK_KILL_AFTER"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = cli.ArgumentParser(description=__doc__.split("\n\n")[0])  # one-line errors, exit 2 (harness/cli.py)
    ap.add_argument("--smoke", action="store_true", help="8-step differential, two ref engines with 2+4 steps")
    ap.add_argument("--checks", type=cli.names_from(gpu.CHECK_NAMES), default=list(gpu.CHECK_NAMES),
                    help="the checks to run, comma-separated (default: all of " + ",".join(gpu.CHECK_NAMES) + "); the "
                    "others say 'not checked: not asked'")
    ap.add_argument("--out", type=cli.out_folder, default=None, help="default: results/gpu-check/<hardware-id>")
    return ap.parse_args(argv)


def say(text: str) -> None:
    print(f"gpu-check: {text}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    env = capture_environment()
    report = gpu.environment_report(env)
    for key, value in report.items():
        say(f"{key}: {value}")
    stop = gpu.cuda_unusable(env)
    if stop:  # fail fast: everything after this would measure the CPU under a GPU's name
        print(f"gpu-check: STOP: {stop}", file=sys.stderr)
        return 2
    cuda = torch.cuda.is_available()
    out = args.out or ROOT / "results" / "gpu-check" / env["hardware_id"]
    problem = cli.folder_problem(out)  # the default folder (an --out was checked while parsing)
    if problem:
        return cli.refuse(f"argument --out: {str(out)!r} {problem}")
    mode = "smoke" if args.smoke else "full"
    record = gpu.new_record(mode, cuda, report, env)
    context = gpu.Context(cuda, args.smoke, out, record, say)
    for i, row in enumerate(gpu.CHECKS):
        if row.name not in args.checks:  # said, never silently left out
            record["checks"][i] = check(row.name, "not checked", f"not asked (--checks {','.join(args.checks)})")
            continue
        say(row.title)
        began = time.perf_counter()
        record["checks"][i] = gpu.run_check(row, context)
        record["checks"][i]["seconds"] = round(time.perf_counter() - began, 1)  # budgets (gpu_window.py) read it
        record["elapsed_s"] = round(time.perf_counter() - start, 1)
        gpu.save_record(record, out)  # after every check: a kill after check k leaves checks 1..k on disk
        if os.environ.get(KILL_AFTER) == str(i + 1):
            os.kill(os.getpid(), signal.SIGKILL)
    record["complete"] = True
    gpu.save_record(record, out)
    try:
        render.figure(record, out / "figure.png")
    except ImportError as exc:  # a GPU host's own environment may lack matplotlib: the record and table still stand
        say(f"figure not drawn: {exc}")
    for c in record["checks"]:
        say(f"{c['name']:<13} {c['status'].upper():<12} {c['reason'] or ''}")
    say(f"{record['elapsed_s']} s; record, table and figure in {out}")
    return verdict(record["checks"])


if __name__ == "__main__":
    sys.exit(main())
