"""The claims in the regime they are about: every engine at the split placement (the GPU analog: the device's work on
the device cores, the host's on the host cores, docs/design.md §3), swept over the tokens per step, so that the
measured ρ (ZeRO-Offload's host work over its compute) runs from compute-bound as far towards the paper's as the
machine reaches; the cost model, calibrated first in the same sitting, predicts every cell (costmodel/).

    python reproduce/regime.py                    # what `make reproduce-regime` runs: results/regime/<hardware-id>/
    python reproduce/regime.py --tokens 2 32      # other points (a sequence of N tokens, micro-batch 1)
    python reproduce/regime.py --report-only      # remake regime.md/.csv, regime.png, each point's tables, costmodel/
    python reproduce/regime.py --convergence      # C6 in the analog: Llama convergence at the analog point
    python reproduce/regime.py --smoke --out DIR  # the test suite's: the tiny model, two points, one round

Rounds interleave every point and engine (round r: seed SEED + r for all of them), so a drift of the machine's
speed lands on every cell alike. The records are written to <out>/.partial/ and move into <out>/ only when every run
is ok or skipped (--resume continues a failed or interrupted plan), as reproduce/llama7b.py's. An engine that cannot
be placed (or run here) gets a skipped record that says why. cpu-scale only: on a GPU the device is the GPU.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import llama7b  # reproduce/llama7b.py (this script runs from reproduce/)

from zenflow.harness import cli, local_inputs
from zenflow.harness.configs import DEEPSPEED_EXAMPLES_BLOCK, ENGINES, TINY_LLAMA_SHAPE
from zenflow.harness.engines.build import deepspeed_config
from zenflow.harness.engines.registry import is_deepspeed
from zenflow.harness.plans import PlannedRun, execute, report_existing
from zenflow.harness.preflight import PreflightError, check_build_locks
from zenflow.harness.session import RunSpec
from zenflow.harness.tables import read_csv
from zenflow.reports.regime import analog_row, regime_report
from zenflow.reports.regime_validation import calibration_path
from zenflow.telemetry.environment import capture_environment

ROOT = Path(__file__).resolve().parents[1]
# The engines: ours, the same-frequency control, device accumulation, the bound, and DeepSpeed's pair as its
# authors intended ZenFlow to run (ds-zenflow as shipped re-views the weights: docs/design.md §7 G).
REGIME_ENGINES = ("ref-offload", "ref-offload-gas", "ref-zenflow", "ref-zenflow-da", "no-offload", "ds-zero-offload",
                  "ds-zenflow-intended")
# Tokens per step (sequence length, micro-batch 1). Two is the least a causal LM learns from (one next token): the
# host-bound end. On the 2-core AMD VM (2026-11-29) the device's own floor sets ρ's ceiling: forward + backward at 2
# tokens still writes every weight's dense gradient (58M elements; 365 ms in bf16, 205 ms in fp32 on one core)
# against the host's ~170 ms, so ρ peaks near 0.35 there and falls ~4x per 8x tokens; 3 rounds of 7 engines at
# 2, 4 and 16 tokens fit the 30 minutes (a point at 32 tokens costs ~65 s a run, 128 ~200 s). --tokens adds points.
TOKENS = (2, 4, 16)
SMOKE_TOKENS = (2, 8)
REPEATS, BASE_SEED, WARMUP, TIMED = 3, 1234, 4, 8
# --convergence: C6's Llama half at the analog point. ds-zero-offload sets the target (C6's rule), ref-offload is our
# own baseline beside it; 5 rounds of 168 steps (≈30 min at 2 tokens on the 2-core AMD VM).
CONVERGENCE_ENGINES, CONVERGENCE_REPEATS = ("ds-zero-offload", "ref-offload", "ref-zenflow"), 5
# The calibration's sequence lengths for the sweep: its points lie at 2-16 tokens, below and beside these; the cost
# model's default third point (128) would take most of the calibration's time here (a 1-thread bf16 step of ~1 s on
# the AMD VM: ~10 min a round) and only shapes the line above 32.
CALIBRATION_SEQS = (8, 32)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", nargs="+", type=cli.int_at_least(2), default=list(TOKENS),
                    help="tokens per step of each point: a sequence this long, micro-batch 1 (default: "
                    + " ".join(map(str, TOKENS)) + ")")
    ap.add_argument("--engines", nargs="+", choices=ENGINES, default=list(REGIME_ENGINES),
                    help="default: " + " ".join(REGIME_ENGINES))
    ap.add_argument("--repeats", type=cli.int_at_least(1), default=None,
                    help=f"rounds, every point and engine interleaved in each (default {REPEATS}; 1 with --smoke)")
    ap.add_argument("--seed", type=cli.int_at_least(0), default=BASE_SEED, help="round r's seed is SEED + r")
    ap.add_argument("--warmup-steps", type=cli.int_at_least(0), default=WARMUP)
    ap.add_argument("--timed-steps", type=cli.int_at_least(1), default=TIMED,
                    help="rounded up to whole update cycles")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"],
                    help="the model's dtype (default bf16, the paper's; fp32 where this CPU computes bf16 slowly, "
                    "which moves ρ down the axis: its own output folder)")
    ap.add_argument("--data", type=cli.data_source, default="auto", help="Alpaca JSON path, 'synthetic', or 'auto'")
    ap.add_argument("--placement", choices=("split",), default="split",
                    help="split only: the study of the GPU analog (reproduce/llama7b.py runs either)")
    ap.add_argument("--out", type=cli.out_folder, default=None, help="default: results/regime/<hardware-id>")
    ap.add_argument("--resume", action="store_true", help="continue the unfinished plan in --out")
    ap.add_argument("--no-calibrate", action="store_true",
                    help="skip the cost model's calibration before the runs (≈12 min; what the sweep's validation "
                    "predicts from: --out's costmodel/calibration.json); --smoke and a --resume that has one skip it")
    ap.add_argument("--smoke", action="store_true", help="the tiny model, two points, one round, 2+4 steps")
    ap.add_argument("--report-only", action="store_true", help="remake the report from the records in --out")
    ap.add_argument("--convergence", action="store_true",
                    help="C6 in the analog: Llama convergence (reproduce/llama7b.py --convergence, split placement, "
                    f"{' '.join(CONVERGENCE_ENGINES)}) at the sweep's analog point (regime.csv in --out) into "
                    "--out/convergence/; --repeats rounds (default 5), --resume continues it")
    args = ap.parse_args(argv)
    cli.distinct(ap, "--engines", args.engines)
    cli.distinct(ap, "--tokens", args.tokens)
    if args.smoke and args.tokens == list(TOKENS):
        args.tokens = list(SMOKE_TOKENS)
    args.tokens = sorted(args.tokens)
    args.repeats = args.repeats or (1 if args.smoke else CONVERGENCE_REPEATS if args.convergence else REPEATS)
    if not args.report_only:
        cli.check_placement_args(ap, args, cuda=False)
    return args


def workload(args: argparse.Namespace, tokens: int, seed: int) -> dict:
    return {"model": "cpu-scale", "dtype": args.dtype, "seq_len": tokens, "micro_batch": 1, "data": args.data,
            "device": "cpu", "seed": seed, **(TINY_LLAMA_SHAPE if args.smoke else {})}


def plan(args: argparse.Namespace) -> list[PlannedRun]:
    """Round by round, every point, every engine: t<tokens>-<engine>-r<round>.json."""
    steps = (2, 4) if args.smoke else (args.warmup_steps, args.timed_steps)
    planned = []
    for rep in range(args.repeats):
        for tokens in args.tokens:
            for engine in args.engines:
                cfg = deepspeed_config(engine, DEEPSPEED_EXAMPLES_BLOCK, args.dtype, 1, lr=2e-5, weight_decay=0.01,
                                       clipping=1.0, cuda=False)
                spec = RunSpec(engine=engine, label=f"regime t{tokens}", workload=workload(args, tokens,
                                                                                           args.seed + rep),
                               ds_config=cfg, warmup_steps=steps[0], timed_steps=steps[1], placement=args.placement,
                               extra={"repeat": rep})
                protocol = {"warmup_steps": spec.warmup_steps, "repeat": rep,
                            "timed_steps": -(-spec.timed_steps // spec.cycle) * spec.cycle}
                planned.append(PlannedRun(f"t{tokens:04d}-{engine}-r{rep}.json", spec, protocol))
    return planned


def calibrate(out: Path) -> None:
    """The day's calibration for the sweep's cost-model validation, taken before the runs on the same machine (a
    refused one, too unstable to keep, leaves the validation to say it has none; the runs go ahead). A process of
    its own: its contention probe re-pins threads and sets torch's thread count, which this one should not inherit."""
    path = calibration_path(out)
    print(f"regime: calibrating the cost model first ({path}); started {time.strftime('%H:%M:%S')}", file=sys.stderr)
    done = subprocess.run([sys.executable, "-m", "zenflow.costmodel.calibrate", "--out", str(path), "--seqs",
                           *map(str, CALIBRATION_SEQS)], cwd=ROOT)
    if done.returncode:
        print(f"regime: no calibration kept (exit {done.returncode}); the runs go ahead, the sweep's validation "
              "will say it has none", file=sys.stderr)


def analog_tokens(out: Path) -> int | None:
    """The tokens per step of the sweep's analog point, as `out`'s regime.csv marks it (None without one)."""
    path = out / "regime.csv"
    row = analog_row(read_csv(path)) if path.is_file() else None
    return None if row is None else int(row["tokens"])


def convergence(args: argparse.Namespace, out: Path) -> int:
    """reproduce/llama7b.py --convergence at the analog point, every engine split, into <out>/convergence/."""
    tokens = analog_tokens(out)
    if tokens is None:
        return cli.refuse(f"argument --convergence: {out / 'regime.csv'} marks no analog point (run the sweep "
                          "first, or --report-only to remake it)")
    engines = list(CONVERGENCE_ENGINES) if args.engines == list(REGIME_ENGINES) else args.engines
    command = ["--convergence", "--placement", "split", "--seq-len", str(tokens), "--dtype", args.dtype, "--data",
               str(args.data), "--engines", *engines, "--repeats", str(args.repeats), "--out", str(out / "convergence"),
               *(["--resume"] if args.resume else []), *(["--smoke"] if args.smoke else [])]
    print(f"regime: Llama convergence at the analog point ({tokens} tokens per step): reproduce/llama7b.py "
          f"{' '.join(command)}", file=sys.stderr)
    return llama7b.main(command)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except SystemExit as exc:
        return exc.code
    env = capture_environment()
    out = args.out or ROOT / "results" / "regime" / env["hardware_id"] / ("" if args.dtype == "bf16" else args.dtype)
    report = partial(regime_report, env=env)
    if args.report_only:
        problem = report_existing(out, report)
        return cli.refuse(problem) if problem else 0
    if args.convergence:
        return convergence(args, out)
    problem = local_inputs.problem("cpu-scale", args.data, False)
    if problem:
        return cli.refuse(problem)
    problem = (cli.folder_problem(out) or cli.unfinished_problem(out, args.resume)
               or cli.placement_problem(out, args.placement))
    if problem:
        return cli.refuse(f"argument --out: {str(out)!r} {problem}")
    try:
        if any(is_deepspeed(e) for e in args.engines):
            check_build_locks()  # a stale DeepSpeed op-build lock would hang every ds run with no output
    except PreflightError as exc:
        return cli.refuse(str(exc))
    if not (args.smoke or args.no_calibrate or (args.resume and calibration_path(out).is_file())):
        calibrate(out)
    runs = plan(args)
    print(f"regime: {len(runs)} runs ({args.repeats} rounds × {len(args.tokens)} points × {len(args.engines)} "
          f"engines), placement {args.placement}, {len(os.sched_getaffinity(0))} cores; started "
          f"{time.strftime('%H:%M:%S')}", file=sys.stderr)
    return execute(out, runs, cli.command_line("reproduce/regime.py", argv), report, resume=args.resume)


if __name__ == "__main__":
    sys.exit(main())
