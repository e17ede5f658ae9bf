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
import signal
import statistics
import sys
from pathlib import Path

import torch

from zenflow.harness import cli_checks as cc
from zenflow.harness.engines import ENGINES, deepspeed_config
from zenflow.harness.preflight import PreflightError, check_build_locks, check_cuda_usable
from zenflow.harness.records import RunRecord, read_records
from zenflow.harness.report import engine_rows, figure, runs_hardware_label, table, write_csv
from zenflow.harness.result_sets import StagedPlan
from zenflow.harness.runner import RunSpec, run_in_subprocess
from zenflow.telemetry.environment import capture_environment

ROOT = Path(__file__).resolve().parents[1]
ZENFLOW_BLOCK = {"topk_ratio": 0.1, "update_interval": 4, "full_warm_up_rounds": 0, "overlap_step": True,
                 "select_strategy": "step", "select_interval": 64}
SMOKE_SHAPE = {"hidden": 64, "layers": 2, "intermediate": 128, "heads": 4}


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
    ap.add_argument("--num-gpus", type=cc.int_at_least(1), default=1,
                    help="GPUs (ranks) per run: > 1 needs --engines ds-zero-offload ds-zenflow (DeepSpeed launcher, "
                    "one table per world size); our reference engines are single-GPU")
    ap.add_argument("--data", type=cc.data_source, default="auto", help="Alpaca JSON path, 'synthetic', or 'auto'")
    ap.add_argument("--repeats", type=cc.int_at_least(1), default=2, help="rounds; engines interleaved within each")
    ap.add_argument("--warmup-steps", type=cc.int_at_least(0), default=8)
    ap.add_argument("--timed-steps", type=cc.int_at_least(1), default=16, help="rounded up to whole update cycles")
    ap.add_argument("--out", type=cc.out_folder, default=None, help="default: results/llama7b/<hardware-id>")
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
    ours = [e for e in args.engines if not e.startswith("ds-")]
    if args.num_gpus > 1 and ours:
        ap.error(f"argument --num-gpus: {args.num_gpus} with {', '.join(ours)}: our reference engines run on one GPU "
                 "and a table never mixes world sizes; for a multi-GPU DeepSpeed run pass "
                 "--engines ds-zero-offload ds-zenflow")
    if args.num_gpus > max(1, torch.cuda.device_count()):
        ap.error(f"argument --num-gpus: {args.num_gpus} is not allowed: expected at most the "
                 f"{torch.cuda.device_count()} CUDA GPU(s) torch can use here")
    if args.device == "cuda" and not gpu:
        ap.error("argument --device: 'cuda' is not allowed: torch cannot use CUDA here (expected 'auto' or 'cpu')")
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except SystemExit as exc:  # argparse: one line and 2 on bad input, 0 after --help; returned to the caller
        return exc.code
    env = capture_environment()
    out = args.out or ROOT / "results" / "llama7b" / env["hardware_id"]
    if args.report_only:
        records = read_records(out) if out.is_dir() else []
        if not records:
            return cc.refuse(f"argument --report-only: no run records in {str(out)!r}: expected the --out of a run")
        report(records, out, env)
        return 0
    problem = cc.folder_problem(out) or cc.unfinished_problem(out, args.resume)
    if problem:
        return cc.refuse(f"argument --out: {str(out)!r} {problem}")
    try:  # a GPU host whose torch cannot use CUDA would silently train on the CPU under the GPU's hardware id
        check_cuda_usable()
        if any(e.startswith("ds-") for e in args.engines):
            check_build_locks()  # a stale DeepSpeed op-build lock would hang every ds run with no output
    except PreflightError as exc:
        return cc.refuse(str(exc))
    workload = {"model": args.model, "dtype": args.dtype, "seq_len": args.seq_len, "micro_batch": args.micro_batch,
                "data": args.data, "device": args.device, **(SMOKE_SHAPE if args.smoke else {})}
    steps = dict(warmup_steps=4, timed_steps=4) if args.smoke else dict(warmup_steps=args.warmup_steps,
                                                                        timed_steps=args.timed_steps)
    plan = [(r, e, True) for r in range(args.repeats) for e in args.engines]
    if "ref-zenflow" in args.engines and not args.no_overhead_check:
        plan += [(r, "ref-zenflow", False) for r in range(args.repeats)]
    names = [f"{engine}{'' if telemetry else '-no-telemetry'}-r{rep}.json" for rep, engine, telemetry in plan]
    staged = StagedPlan(out, names, command=cc.command_line("reproduce/llama7b.py", argv))
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops the current child too, as Ctrl-C does
    try:
        records = run_plan(args, list(zip(plan, names)), staged, workload, steps)
    except KeyboardInterrupt:
        staged.stop()
        print(f"interrupted: {out} is as it was; the records so far are in {staged.stage} (its PARTIAL file lists "
              "the rest); --resume continues", file=sys.stderr)
        return 130
    complete = staged.finish()  # all ok or skipped: the records move into `out`
    report(records, out if complete else staged.stage, env)
    if not complete:
        print(f"failed runs: {out} is as it was; this plan's records and table are in {staged.stage}; --resume "
              "reruns the failed runs", file=sys.stderr)
    return 0 if complete else 1


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_plan(args: argparse.Namespace, plan: list, staged: StagedPlan, workload: dict, steps: dict) -> list[RunRecord]:
    """Each (repeat, engine, telemetry) in its own process, its record staged; --resume keeps ok records."""
    records = []
    for i, ((rep, engine, telemetry), name) in enumerate(plan):
        cfg = deepspeed_config(engine, ZENFLOW_BLOCK, args.dtype, args.micro_batch, lr=2e-5, weight_decay=0.01,
                               clipping=1.0, cuda=torch.cuda.is_available() and args.device != "cpu")
        spec = RunSpec(engine=engine, label="llama7b", workload=workload, ds_config=cfg, telemetry=telemetry,
                       num_gpus=args.num_gpus, extra={"repeat": rep}, **steps)
        protocol = {"warmup_steps": spec.warmup_steps, "timed_steps": -(-spec.timed_steps // spec.cycle) * spec.cycle,
                    "telemetry": telemetry, "repeat": rep}  # timed steps: whole update cycles, as the run rounds
        kept = staged.reuse(name, spec, protocol) if args.resume else None
        print(f"[{i + 1}/{len(plan)}] {name}{' (kept: --resume)' if kept else ''}", file=sys.stderr, flush=True)
        record = kept or run_in_subprocess(spec, staged.path(name))  # no DeepSpeed: a "skipped" record
        staged.done(name, record)
        if record.status != "ok":
            word = "SKIPPED" if record.status == "skipped" else "FAILED"
            print(f"  {word}: {record.error.strip().splitlines()[-1] if record.error else '?'}", file=sys.stderr)
        records.append(record)
    return records


def report(records: list[RunRecord], out: Path, env: dict) -> str:
    timed = [r for r in records if r.protocol.get("telemetry", True)]
    rows = engine_rows(timed)  # refuses records of different world sizes
    label = runs_hardware_label(records, env)
    first = next((r for r in records if r.status == "ok"), records[0])  # a skipped record has no model facts
    w, params = first.workload, first.model.get("parameters", 0) / 1e6
    gpus = max((r["world_size"] or 1 for r in rows), default=1)
    text = [f"# Llama-2-7B scenario — {label}", "",
            f"Model: {w.get('model')} ({params:.1f}M params, {w.get('dtype')}), sequence {w.get('seq_len')}, "
            f"micro-batch {w.get('micro_batch')}, data: {w.get('data_source')}. World size {gpus} "
            f"({'one process per GPU, DeepSpeed launcher' if gpus > 1 else 'every engine on one device'}).",
            f"ZenFlow block: {ZENFLOW_BLOCK}. Step times are means over whole update cycles; medians of the runs.",
            "", table(rows), ""]
    text += regime_notes(rows, records)
    (out / "table.md").write_text("\n".join(text) + "\n")
    write_csv(rows, out / "table.csv")
    if any(r["cycle_mean_ms"] for r in rows):
        figure(rows, out / "figure.png", "ZenFlow vs ZeRO-Offload, Llama scenario",
               f"{label}; {params:.0f}M params, {w.get('dtype')}, seq {w.get('seq_len')}")
    print("\n".join(text))
    return "\n".join(text)


def regime_notes(rows: list[dict], records: list[RunRecord]) -> list[str]:
    """Which regime this is (host optimizer vs compute) and the telemetry overhead, in plain words."""
    notes = []
    index = {r["engine"]: r for r in rows}
    offload = index.get("ref-offload")
    if offload and offload["compute_ms"]:
        ratio = offload["stall_ms"] / offload["compute_ms"]
        notes.append("- Regime: host optimizer (ref-offload stall: host accumulation + CPU AdamW of every column) / "
                     f"compute = {ratio:.2f}" + (" — the host optimizer costs as much as compute or more." if ratio >= 1
                                       else " — the host optimizer costs about as much as compute." if ratio >= 0.9
                                       else " — compute dominates."))
    zen, bound, ds = index.get("ref-zenflow"), index.get("no-offload"), index.get("ds-zenflow")
    if zen and bound and zen["cycle_mean_ms"] and bound["cycle_mean_ms"]:
        notes.append(f"- ref-zenflow / no-offload = {zen['cycle_mean_ms'] / bound['cycle_mean_ms']:.2f} (target ≤ 1.5)")
    if zen and ds and zen["cycle_mean_ms"] and ds["cycle_mean_ms"]:
        notes.append(f"- ref-zenflow / ds-zenflow = {zen['cycle_mean_ms'] / ds['cycle_mean_ms']:.2f} (target ≤ 0.5)")
    own = [r.summary["telemetry_ms"] / r.summary["cycle_mean_ms"] for r in records if r.status == "ok"
           and r.engine == "ref-zenflow" and r.summary.get("telemetry_ms") is not None and r.summary["cycle_mean_ms"]]
    if own:
        notes.append(f"- Telemetry overhead, measured directly (time inside the timeline's callbacks / step time, "
                     f"ref-zenflow): {100 * statistics.median(own):.4f}% (target ≤ 1%)")
    with_t = [r.summary["cycle_mean_ms"] for r in records if r.status == "ok" and r.engine == "ref-zenflow"
              and r.protocol.get("telemetry", True)]
    without = [r.summary["cycle_mean_ms"] for r in records if r.status == "ok" and r.engine == "ref-zenflow"
               and not r.protocol.get("telemetry", True)]
    if with_t and without:
        overhead = statistics.median(with_t) / statistics.median(without) - 1
        notes.append(f"- Same run with vs without the optimizer observer (ref-zenflow, median of runs): "
                     f"{100 * overhead:+.1f}% (separate runs: this includes the run-to-run noise of a shared "
                     "machine; the direct measurement above isolates the telemetry itself)")
    failed = [f"{r.engine}" for r in records if r.status not in ("ok", "skipped")]
    if failed:
        notes.append(f"- FAILED runs (see their records): {', '.join(failed)}")
    skipped = sorted({r.engine for r in records if r.status == "skipped"})
    if skipped:
        notes.append(f"- Not run: {', '.join(skipped)} (DeepSpeed is not installed in this environment)")
    return notes


if __name__ == "__main__":
    sys.exit(main())
