"""Llama-2-7B fine-tuning scenario: ZeRO-Offload vs ZenFlow (DeepSpeed's and ours) side by side.

With a GPU: Llama-2-7B (or --model), bf16, Alpaca, sequence 512, DeepSpeedExamples settings (AdamW 2e-5, weight
decay 0.01, clipping 1.0, top-k 0.1, update interval 4, overlap on). Without one: the cpu-scale scenario of
DESIGN §5 (a ≈58M-parameter Llama built from LlamaConfig, the Llama SentencePiece tokenizer, real Alpaca records),
labelled "cpu-scale" everywhere. Output: records, table.md/.csv and figure.png in results/llama7b/<hardware-id>/.

    python reproduce/llama7b.py                      # what `make reproduce-llama7b` runs
    python reproduce/llama7b.py --model meta-llama/Llama-2-7b-hf --seq-len 512

Every argument is checked before any run, model load or DeepSpeed import (zenflow/harness/cli_checks.py): a bad one
gives one line naming the argument, the value and what is allowed, exit status 2, and nothing in --out. The plan's
records are written to <out>/.partial/ and move into <out>/ only when every run is ok or skipped; a failed or
interrupted plan leaves <out>/ as it was, with its records and a PARTIAL file in <out>/.partial/, which --resume
continues (zenflow/harness/result_sets.py, docs/records.md).
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial
from pathlib import Path

import torch

from zenflow.harness import cli_checks as cc
from zenflow.harness.configs import DEEPSPEED_EXAMPLES_BLOCK, ENGINES, TINY_LLAMA_SHAPE
from zenflow.harness.engines import deepspeed_config
from zenflow.harness.plans import PlannedRun, execute, report_existing
from zenflow.harness.preflight import PreflightError, check_async_io, check_build_locks, check_cuda_usable
from zenflow.harness.report import scenario_report
from zenflow.harness.session import RunSpec
from zenflow.telemetry.environment import capture_environment

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Every argument is checked here, before any run (cli_checks): a bad one exits 2 with one line on stderr."""
    gpu = torch.cuda.is_available()
    ap = cc.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=cc.model_or_builtin("cpu-scale"), default=os.environ.get("MODEL") or None,
                    help="'cpu-scale', a hub id or a local folder; default: $MODEL, else Llama-2-7B on a GPU host "
                    "(cpu-scale with --smoke or without a GPU)")
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "fp16"])
    ap.add_argument("--seq-len", type=cc.int_at_least(1), default=None, help="default: 512 on a GPU host, 16 otherwise")
    ap.add_argument("--micro-batch", type=cc.int_at_least(1), default=1)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                    help="where the engines train: auto = CUDA when torch can use it, else the CPU")
    ap.add_argument("--nproc", "--num-gpus", dest="nproc", type=cc.int_at_least(1),
                    default=int(os.environ.get("NPROC") or 1),
                    help="ranks per run, every engine (default $NPROC, else 1): one per GPU on a GPU host, a share of "
                    "the cores each here (torchrun + gloo; DeepSpeed on GPUs: its launcher); one table per world size")
    ap.add_argument("--nvme-path", type=cc.out_folder, default=None,
                    help="ds-zero-infinity offloads parameters and optimizer to NVMe in this folder (default: the "
                    "host's memory); needs DeepSpeed's async_io op (libaio)")
    ap.add_argument("--data", type=cc.data_source, default="auto", help="Alpaca JSON path, 'synthetic', or 'auto'")
    ap.add_argument("--repeats", type=cc.int_at_least(1), default=2, help="rounds; engines interleaved within each")
    ap.add_argument("--warmup-steps", type=cc.int_at_least(0), default=8)
    ap.add_argument("--timed-steps", type=cc.int_at_least(1), default=16, help="rounded up to whole update cycles")
    ap.add_argument("--out", type=cc.out_folder, default=None,
                    help="default: results/llama7b/<hardware-id> (with --nproc N > 1: its nproc-N subfolder)")
    ap.add_argument("--resume", action="store_true", help="continue the unfinished plan in --out (<out>/.partial/): "
                    "keep the ok records of the same runs, rerun the rest")
    ap.add_argument("--no-overhead-check", action="store_true", help="skip the run without telemetry")
    ap.add_argument("--smoke", action="store_true", help="a tiny model and 4+4 steps (for the test suite)")
    ap.add_argument("--report-only", action="store_true", help="remake table and figure from the records in --out")
    args = ap.parse_args(argv)
    small = args.smoke or not gpu  # the smoke run is the tiny cpu-scale shape on every host
    args.model = args.model or ("cpu-scale" if small else "meta-llama/Llama-2-7b-hf")
    args.seq_len = args.seq_len or (16 if small else 512)
    cc.distinct(ap, "--engines", args.engines)
    on_gpus = gpu and args.device != "cpu"
    most = torch.cuda.device_count() if on_gpus else len(os.sched_getaffinity(0))
    if args.nproc > most:
        ap.error(f"argument --nproc: {args.nproc} is not allowed: expected at most the {most} "
                 + ("CUDA GPU(s) torch can use here" if on_gpus else "cores this process may use (one rank each)"))
    if args.device == "cuda" and not gpu:
        ap.error("argument --device: 'cuda' is not allowed: torch cannot use CUDA here (expected 'auto' or 'cpu')")
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except SystemExit as exc:  # argparse: one line and 2 on bad input, 0 after --help; returned to the caller
        return exc.code
    env = capture_environment()
    out = args.out or ROOT / "results" / "llama7b" / env["hardware_id"] / (f"nproc-{args.nproc}" if args.nproc > 1
                                                                           else "")
    report = partial(scenario_report, env=env)
    if args.report_only:
        problem = report_existing(out, report)
        return cc.refuse(problem) if problem else 0
    problem = cc.folder_problem(out) or cc.unfinished_problem(out, args.resume)
    if problem:
        return cc.refuse(f"argument --out: {str(out)!r} {problem}")
    try:  # a GPU host whose torch cannot use CUDA would silently train on the CPU under the GPU's hardware id
        check_cuda_usable()
        if any(e.startswith("ds-") for e in args.engines):
            check_build_locks()  # a stale DeepSpeed op-build lock would hang every ds run with no output
        if args.nvme_path and "ds-zero-infinity" in args.engines:
            check_async_io()  # without libaio every ZeRO-Infinity run would fail at its first swap
    except PreflightError as exc:
        return cc.refuse(str(exc))
    return execute(out, plan(args), cc.command_line("reproduce/llama7b.py", argv), report, resume=args.resume)


def plan(args: argparse.Namespace) -> list[PlannedRun]:
    """Every (repeat, engine) with telemetry, engines interleaved within a repeat; then ref-zenflow without it."""
    workload = {"model": args.model, "dtype": args.dtype, "seq_len": args.seq_len, "micro_batch": args.micro_batch,
                "data": args.data, "device": args.device, **(TINY_LLAMA_SHAPE if args.smoke else {})}
    steps = (4, 4) if args.smoke else (args.warmup_steps, args.timed_steps)
    runs = [(r, e, True) for r in range(args.repeats) for e in args.engines]
    if "ref-zenflow" in args.engines and not args.no_overhead_check:
        runs += [(r, "ref-zenflow", False) for r in range(args.repeats)]
    planned = []
    for rep, engine, telemetry in runs:
        cfg = deepspeed_config(engine, DEEPSPEED_EXAMPLES_BLOCK, args.dtype, args.micro_batch, lr=2e-5,
                               weight_decay=0.01, clipping=1.0, cuda=torch.cuda.is_available() and args.device != "cpu",
                               nvme_path=str(args.nvme_path) if args.nvme_path else None)
        spec = RunSpec(engine=engine, label="llama7b", workload=workload, ds_config=cfg, telemetry=telemetry,
                       num_gpus=args.nproc, extra={"repeat": rep}, warmup_steps=steps[0], timed_steps=steps[1])
        protocol = {"warmup_steps": spec.warmup_steps, "timed_steps": -(-spec.timed_steps // spec.cycle) * spec.cycle,
                    "telemetry": telemetry, "repeat": rep}  # timed steps: whole update cycles, as the run rounds
        planned.append(PlannedRun(f"{engine}{'' if telemetry else '-no-telemetry'}-r{rep}.json", spec, protocol))
    return planned


if __name__ == "__main__":
    sys.exit(main())
