"""One command for a GPU host (≤ 10 minutes on one H100): environment, CUDA-vs-CPU differential, overlap memory vs
its bound, NVML PCIe counters vs ours, every engine on a small Llama. Writes gpu-check.json, table.md and figure.png
to results/gpu-check/<hardware-id>/ (docs/gpu-check.md). On a CPU machine it runs the CPU part and says, per check,
what it could not check and why.

    python reproduce/gpu_check.py                     # what `make gpu-check` runs
    python reproduce/gpu_check.py --smoke             # a few steps, two engines (the test suite runs this)
    python reproduce/gpu_check.py --llama7b-shapes    # also every engine at Llama-2-7B shapes (random weights)

Exit status: 0 all checks passed or could not run here, 1 a check failed, 2 NVML sees GPUs but torch cannot use CUDA.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from zenflow.harness import cli_checks as cc
from zenflow.harness import gpu_check as gc
from zenflow.harness.pcie_check import pcie_check
from zenflow.telemetry.environment import capture_environment

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = cc.ArgumentParser(description=__doc__.split("\n\n")[0])  # one-line errors, exit 2 (cli_checks)
    ap.add_argument("--smoke", action="store_true", help="8-step differential, two ref engines with 2+4 steps")
    ap.add_argument("--llama7b-shapes", action="store_true", help="also run every engine at Llama-2-7B shapes")
    ap.add_argument("--out", type=cc.out_folder, default=None, help="default: results/gpu-check/<hardware-id>")
    return ap.parse_args(argv)


def say(text: str) -> None:
    print(f"gpu-check: {text}", flush=True)


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
    notes = [f"{report['gpus_on_host']} GPUs on the host, this run uses {len(report['gpus'])}"] \
        if report["gpus_on_host"] > len(report["gpus"]) else []
    notes += [f"NVML cannot match: {e}" for e in report["mapping_errors"]]  # audit item 13: never guessed by index
    checks = [gc.check("environment", "pass", "; ".join(notes) or None) if cuda else gc.check(
        "environment", "not checked", f"no CUDA GPU (NVML: {report['nvml']}; torch CUDA build: "
                                      f"{report['torch_cuda_build']}): GPU facts and link not read")]

    say("differential" + (" (CUDA vs CPU)" if cuda else " (no CUDA: CPU-vs-CPU self-check)"))
    diff = gc.guarded("differential", gc.differential_check, cuda, steps=8 if args.smoke else 24)
    diff, diff_rows = diff if isinstance(diff, tuple) else (diff, [])
    checks.append(diff)
    say("device memory, overlap vs sync")
    small = {"widths": (1024,) * 3, "steps": 6} if args.smoke else {}  # a GPU host's `make test` stays short
    checks.append(gc.guarded("memory", gc.memory_check, cuda, **small))
    say("PCIe bytes, NVML vs ours")
    checks.append(gc.guarded("pcie", pcie_check, cuda, **small))
    plan = gc.engine_plan(cuda, args.smoke, args.llama7b_shapes)
    say(f"engines: {len(plan)} runs")
    engines = gc.guarded("engines", gc.run_engines, plan, out, cuda)
    engines, engine_rows = engines if isinstance(engines, tuple) else (engines, [])
    checks.append(engines)

    record = {"schema": gc.SCHEMA, "mode": "smoke" if args.smoke else "full", "cuda": cuda,
              "elapsed_s": round(time.perf_counter() - start, 1), "environment": report, "checks": checks,
              "differential": diff_rows, "engines": engine_rows, "full_environment": env}
    gc.write_json(out / "gpu-check.json", record)
    (out / "table.md").write_text(gc.markdown(record))
    try:
        gc.figure(record, out / "figure.png")
    except ImportError as exc:  # a GPU host's own environment may lack matplotlib: the record and table still stand
        say(f"figure not drawn: {exc}")
    for c in checks:
        say(f"{c['name']:<13} {c['status'].upper():<12} {c['reason'] or ''}")
    say(f"{record['elapsed_s']} s; record, table and figure in {out}")
    return gc.verdict(checks)


if __name__ == "__main__":
    sys.exit(main())
