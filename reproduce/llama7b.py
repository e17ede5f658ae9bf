"""Llama-2-7B fine-tuning scenario: ZeRO-Offload vs ZenFlow (DeepSpeed's and ours) side by side.

With a GPU: Llama-2-7B (or --model), bf16, Alpaca, sequence 512, DeepSpeedExamples settings (AdamW 2e-5, weight
decay 0.01, clipping 1.0, top-k 0.1, update interval 4, overlap on). Without one: the cpu-scale scenario of
docs/design.md §5 (a ≈58M-parameter Llama from LlamaConfig, the Llama SentencePiece tokenizer, real Alpaca records),
labelled "cpu-scale" everywhere. Output: records, table.md/.csv and figure.png in results/llama7b/<hardware-id>/.

    python reproduce/llama7b.py                      # what `make reproduce-llama7b` runs
    python reproduce/llama7b.py --model meta-llama/Llama-2-7b-hf --seq-len 512
    python reproduce/llama7b.py --shape llama2-7b --layers 8 --plan   # the memory plan only: nothing runs
    python reproduce/llama7b.py --convergence        # loss against wall time, 5 rounds (convergence/)
    python reproduce/llama7b.py --cores-ablation     # ZenFlow at each pt_reserved_cores_perc (cores/)
    python reproduce/llama7b.py --convergence --update-interval auto   # another ZenFlow block: its own subfolder
    python reproduce/gpu_window.py --out OUT         # one command on a GPU host: checks + 4 layers (docs/gpu-window.md)

`--shape llama2-7b --layers N`: random weights at Llama-2-7B's layer shapes, N of its 32 layers (the default on a
GPU host without local Llama-2-7B weights, at the largest N the memory plan admits). Before any run the parent
checks that model, tokenizer and data are on this host (local_inputs.py) and plans every engine's memory
(memory_plan.py): an engine that cannot fit gets a `skipped` record saying what it needs, in seconds.

Every argument is checked before any run, model load or DeepSpeed import (zenflow/harness/cli.py): a bad
one
gives one line naming the argument, the value and what is allowed, exit status 2, and nothing in --out. The plan's
records are written to <out>/.partial/ and move into <out>/ only when every run is ok or skipped; a failed or
interrupted plan leaves <out>/ as it was, with its records and a PARTIAL file in <out>/.partial/, which --resume
continues (zenflow/harness/result_sets.py, docs/records.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial
from pathlib import Path

import torch

from zenflow.harness import cli, local_inputs, scale_plan
from zenflow.harness import memory_plan as mp
from zenflow.harness.configs import (
    CONVERGENCE_ENGINES,
    CORE_ENGINES,
    DEEPSPEED_EXAMPLES_BLOCK,
    DEFAULT_ENGINES,
    ENGINES,
    OVERHEAD_ENGINE,
    SHAPES,
    TINY_LLAMA_SHAPE,
)
from zenflow.harness.engines.build import deepspeed_config
from zenflow.harness.engines.registry import ASKED, is_deepspeed, needs_async_io, zenflow_engines
from zenflow.harness.plans import PlannedRun, execute, report_existing
from zenflow.harness.preflight import PreflightError, check_async_io, check_build_locks, check_cuda_usable
from zenflow.harness.session import RunSpec
from zenflow.reports.cores import FRACTIONS, cores_report, planned_split
from zenflow.reports.scenario import scenario_report
from zenflow.telemetry.environment import capture_environment

ROOT = Path(__file__).resolve().parents[1]
HUB_DEFAULT = "meta-llama/Llama-2-7b-hf"
# --convergence: 160 timed steps, where the issue-24 nanoGPT trial saw AdamW, ZenFlow sync and overlap and the
# every-4th-step control apart (2.51 / 2.74 / 2.95 / 2.92); 40 update cycles at U 4. Its engines:
# configs.CONVERGENCE_ENGINES.
CONVERGENCE_STEPS = 160
# Repeats per cell: at least 5 here and 3 on a GPU, for a 95% interval of every step time and ratio. At
# cpu-scale every engine's run costs ~6.5 s of process start, model build and DeepSpeed set-up plus its steps, so 5
# rounds of 14 engines fit 15 minutes on the 2-core VM with 4 warm-up + 8 timed steps (2 whole update cycles at U 4;
# the first boundary and the overlap's first wait fall in the warm-up). --shape on a GPU host keeps 1 round: its
# 10-minute command windows (docs/llama7b-gpu.md).
CPU_REPEATS, GPU_REPEATS, BASE_SEED, OVERHEAD_CHECK_REPEATS = 5, 3, 1234, 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Every argument is checked here, before any run (harness/cli.py): a bad one exits 2, one line on stderr."""
    gpu = torch.cuda.is_available()
    ap = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=cli.model_or_builtin("cpu-scale"), default=os.environ.get("MODEL") or None,
                    help="'cpu-scale', a hub id or a local folder; default: $MODEL, else on a GPU host Llama-2-7B "
                    "when its weights are local and --shape llama2-7b otherwise (cpu-scale with --smoke or without "
                    "a GPU)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None,
                    help="random weights at this model's layer shapes (with --layers): no download")
    ap.add_argument("--layers", type=cli.int_at_least(1), default=None,
                    help="with --shape: layers of that shape (default: the most the memory plan admits, at most "
                    "the model's own)")
    ap.add_argument("--freeze-embedding", action="store_true",
                    help="freeze the input embedding in every engine: the host-to-compute ratio of N layers is then "
                    "exactly the full model's (docs/llama7b-gpu.md)")
    ap.add_argument("--plan", action="store_true", help="print every engine's memory and time estimate against this "
                    "host and run nothing")
    ap.add_argument("--host-memory-gib", type=cli.float_at_least(0, strict=True), default=None,
                    help="plan for this much host memory instead of what this host has available now (its GPU "
                    "and /dev/shm stay measured unless --device-memory-gib: a microVM's RAM grows as it is used)")
    ap.add_argument("--device-memory-gib", type=cli.float_at_least(0, strict=True), default=None,
                    help="plan for a GPU with this much memory (default: this host's GPU; none: the CPU)")
    ap.add_argument("--allow-download", action="store_true",
                    help="let the runs fetch a model or data that is not on this host (refused otherwise)")
    ap.add_argument("--engines", nargs="+", default=list(DEFAULT_ENGINES), choices=ENGINES,
                    help="default: every engine but the opt-in ones (configs.DEFAULT_ENGINES)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "fp16"])
    ap.add_argument("--seq-len", type=cli.int_at_least(1), default=None,
                    help="default: 512 on a GPU host, 16 otherwise")
    ap.add_argument("--micro-batch", type=cli.int_at_least(1), default=1)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                    help="where the engines train: auto = CUDA when torch can use it, else the CPU")
    ap.add_argument("--nproc", "--num-gpus", dest="nproc", type=cli.int_at_least(1),
                    default=int(os.environ.get("NPROC") or 1),
                    help="ranks per run, every engine (default $NPROC, else 1): one per GPU on a GPU host, a share of "
                    "the cores each here (torchrun + gloo; DeepSpeed on GPUs: its launcher); one table per world size")
    ap.add_argument("--nvme-path", type=cli.out_folder, default=None,
                    help="ds-zero-infinity offloads parameters and optimizer to NVMe in this folder (default: the "
                    "host's memory); needs DeepSpeed's async_io op (libaio)")
    ap.add_argument("--data", type=cli.data_source, default="auto", help="Alpaca JSON path, 'synthetic', or 'auto'")
    ap.add_argument("--repeats", type=cli.int_at_least(1), default=None,
                    help=f"rounds; engines interleaved within each, one seed per round (default {CPU_REPEATS} here, "
                    f"{GPU_REPEATS} on a GPU, 1 with --shape or --convergence)")
    ap.add_argument("--seed", type=cli.int_at_least(0), default=BASE_SEED,
                    help=f"round r's seed is SEED + r: model init and data order, shared by its engines (default "
                    f"{BASE_SEED})")
    ap.add_argument("--warmup-steps", type=cli.int_at_least(0), default=None,
                    help="default 4 here and with --shape, 8 on a GPU and with --convergence")
    ap.add_argument("--timed-steps", type=cli.int_at_least(1), default=None,
                    help="rounded up to whole update cycles; default 8 here and with --shape, 16 on a GPU")
    ap.add_argument("--out", type=cli.out_folder, default=None,
                    help="default: results/llama7b/<hardware-id> (with --nproc N > 1: its nproc-N subfolder)")
    ap.add_argument("--resume", action="store_true", help="continue the unfinished plan in --out (<out>/.partial/): "
                    "keep the ok records of the same runs, rerun the rest")
    ap.add_argument("--no-overhead-check", action="store_true", help="skip the run without telemetry")
    ap.add_argument("--deadline-s", type=cli.float_at_least(0, strict=True), default=None,
                    help="start a run only when the memory plan's estimate of it, corrected by the runs done, ends "
                    "within this many seconds of the start; the rest get 'skipped: out of time' records and rows "
                    "(--resume runs them later; reproduce/gpu_window.py)")
    ap.add_argument("--convergence", action="store_true",
                    help=f"loss against wall time: {CONVERGENCE_STEPS} timed steps, the engines that differ in what a "
                    "step computes (default --engines: " + " ".join(CONVERGENCE_ENGINES) + "), into the convergence/ "
                    f"subfolder ({CPU_REPEATS} rounds here: ≈35 min)")
    ap.add_argument("--cores-ablation", nargs="*", type=cli.float_between(0, 1), default=None, metavar="P",
                    help="the ZenFlow engines (default --engines: ref-zenflow ds-zenflow) at each "
                    "pt_reserved_cores_perc P, the share of the cores kept for PyTorch compute (default: "
                    + " ".join(f"{f:g}" for f in FRACTIONS) + "), into the cores/ subfolder (≈8 min here)")
    cli.add_knobs(ap, DEEPSPEED_EXAMPLES_BLOCK)  # a setting other than the default gets an output folder of its own
    cli.add_placement(ap)  # split: its own placement-split/ subfolder
    ap.add_argument("--smoke", action="store_true", help="a tiny model and 4+4 steps (for the test suite)")
    ap.add_argument("--report-only", action="store_true", help="remake table and figure from the records in --out")
    args = ap.parse_args(argv)
    args.until = None if args.deadline_s is None else time.time() + args.deadline_s
    args.block = cli.knobs_block(ap, args, DEEPSPEED_EXAMPLES_BLOCK)
    small = args.smoke or not gpu  # the smoke run is the tiny cpu-scale shape on every host
    if args.shape and args.model:
        ap.error("argument --shape: not allowed with --model (or $MODEL): expected one of them")
    if (args.layers or args.freeze_embedding) and not args.shape:
        ap.error("argument --layers/--freeze-embedding: only with --shape (expected --shape llama2-7b)")
    if not args.model and not args.shape and not small:  # a GPU host: the real model if it is here
        args.shape = None if local_inputs.problem(HUB_DEFAULT, "auto") is None else "llama2-7b"
        args.model = HUB_DEFAULT if args.shape is None else None
    args.model = args.model or ("llama2-7b-shape" if args.shape else "cpu-scale")
    args.seq_len = args.seq_len or (16 if small and not args.shape else 512)
    shaped = bool(args.shape)
    short = (shaped or small) and not args.convergence  # the 15-minute budgets: see CPU_REPEATS
    args.warmup_steps = args.warmup_steps if args.warmup_steps is not None else (4 if short else 8)
    args.timed_steps = args.timed_steps or (CONVERGENCE_STEPS if args.convergence else 8 if short else 16)
    args.repeats = args.repeats or (1 if shaped else CPU_REPEATS if small else GPU_REPEATS)
    if args.convergence and args.engines == list(DEFAULT_ENGINES):
        args.engines = list(CONVERGENCE_ENGINES)
    if args.cores_ablation is not None:
        cores_ablation_args(ap, args)
    cli.distinct(ap, "--engines", args.engines)
    on_gpus = gpu and args.device != "cpu"
    most = torch.cuda.device_count() if on_gpus else len(os.sched_getaffinity(0))
    if args.nproc > most:
        ap.error(f"argument --nproc: {args.nproc} is not allowed: expected at most the {most} "
                 + ("CUDA GPU(s) torch can use here" if on_gpus else "cores this process may use (one rank each)"))
    if args.device == "cuda" and not gpu:
        ap.error("argument --device: 'cuda' is not allowed: torch cannot use CUDA here (expected 'auto' or 'cpu')")
    if args.placement == "split" and args.cores_ablation is not None:
        ap.error("argument --placement: 'split' is not allowed with --cores-ablation (expected one core layout per "
                 "run)")
    cli.check_placement_args(ap, args, on_gpus, args.nproc)
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except SystemExit as exc:  # argparse: one line and 2 on bad input, 0 after --help; returned to the caller
        return exc.code
    problem = local_inputs.problem(args.model, args.data, args.allow_download)
    if problem:  # checked once here, not once per run
        return cli.refuse(problem)
    host = base = None
    if args.shape and args.layers is None:  # the most layers that fit: the output folder is named after them
        host, base, cuda = host_and_base(args)
        shape = mp.ModelShape.from_workload(workload(args, SHAPES[args.shape]["layers"]))
        args.layers = mp.largest_layers(args.engines, shape, host, 2 if args.dtype != "fp32" else 4, cuda,
                                        args.block, args.seq_len, args.micro_batch, base, shape.layers)
    env = capture_environment()
    scenario = f"{args.shape}-{args.layers}L{'-frozen-embedding' if args.freeze_embedding else ''}" if args.shape \
        else ""
    out = args.out or ROOT / "results" / "llama7b" / env["hardware_id"] / scenario / (
        f"nproc-{args.nproc}" if args.nproc > 1 else "") / (
        "convergence" if args.convergence else "cores" if args.cores_ablation else "") / cli.setting_name(
        args.block, DEEPSPEED_EXAMPLES_BLOCK) / cli.placement_name(args.placement)  # e.g. update-interval-auto/:
    # two settings (or placements) never share a folder
    report = partial(cores_report if args.cores_ablation else scenario_report, env=env)
    if args.report_only:  # records only: no plan, no probe
        problem = report_existing(out, report)
        return cli.refuse(problem) if problem else 0
    if host is None:
        host, base, cuda = host_and_base(args)
    shape, needs = memory_needs(args, base, cuda)
    if args.plan:
        if shape is None:
            return cli.refuse(f"argument --plan: the shape of {args.model!r} is not on this host (no config.json)")
        print(mp.render(needs, host, args.warmup_steps + args.timed_steps, shape, base))
        print("\n" + scale_plan.render(base + (0 if cuda else mp.CUDA_CONTEXT)))  # 13B and 70B on 1-8 GPUs
        return 0
    problem = (cli.folder_problem(out) or cli.unfinished_problem(out, args.resume)
               or cli.setting_problem(out, args.block) or cli.placement_problem(out, args.placement))
    if problem:
        return cli.refuse(f"argument --out: {str(out)!r} {problem}")
    try:  # a GPU host whose torch cannot use CUDA would silently train on the CPU under the GPU's hardware id
        check_cuda_usable()
        if any(is_deepspeed(e) for e in args.engines):
            check_build_locks()  # a stale DeepSpeed op-build lock would hang every ds run with no output
        if args.nvme_path and needs_async_io(args.engines, str(args.nvme_path)):
            check_async_io()  # without libaio every ZeRO-Infinity run would fail at its first swap
    except PreflightError as exc:
        return cli.refuse(str(exc))
    skips = {n.engine: mp.fits(n, host) for n in needs}
    for engine, why in skips.items():
        if why:
            print(f"memory plan: {engine} is skipped: {why}", file=sys.stderr)
    steps = args.warmup_steps + args.timed_steps
    estimates = {n.engine: n.run_s(steps) for n in needs}
    return execute(out, plan(args, skips, estimates), cli.command_line("reproduce/llama7b.py", argv), report,
                   resume=args.resume, until=args.until)


def cores_ablation_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--cores-ablation: its fractions (FRACTIONS when none are given) and engines (those that split the cores)."""
    if args.convergence:
        ap.error("argument --cores-ablation: not allowed with --convergence (expected one study per run)")
    args.cores_ablation = args.cores_ablation or list(FRACTIONS)
    cli.distinct(ap, "--cores-ablation", args.cores_ablation)
    splitting = [s.name for s in zenflow_engines() if s.zenflow_block == ASKED]
    if args.engines == list(DEFAULT_ENGINES):
        args.engines = [e for e in splitting if e in CORE_ENGINES]  # ours first, then DeepSpeed's
    other = [e for e in args.engines if e not in splitting]
    if other:
        ap.error(f"argument --engines: {', '.join(other)} not allowed with --cores-ablation: expected engines that "
                 f"split the cores ({', '.join(splitting)})")
    args.no_overhead_check = True  # a study of one setting, not the scenario's cells


def workload(args: argparse.Namespace, layers: int | None = None) -> dict:
    """The runs' workload: the model and its shape (--shape, --smoke's tiny one), data, dtype, device."""
    shape = {}
    if args.shape:
        shape = {**{k: v for k, v in SHAPES[args.shape].items() if k != "layers"},
                 "layers": layers or args.layers, "freeze_embedding": args.freeze_embedding}
    elif args.smoke:
        shape = dict(TINY_LLAMA_SHAPE)
    return {"model": args.model, "dtype": args.dtype, "seq_len": args.seq_len, "micro_batch": args.micro_batch,
            "data": args.data, "device": args.device, **shape}


def host_and_base(args: argparse.Namespace) -> tuple[mp.Host, int, bool]:
    """What the runs may use (this host, or the simulated one), the measured base of a run child, and whether the
    plan is for a GPU."""
    real_cuda = torch.cuda.is_available() and args.device != "cpu"
    cuda = real_cuda or bool(args.device_memory_gib)
    if args.device_memory_gib:  # another machine: nothing of this one's but its free memory (unless stated)
        host = mp.Host.simulated(args.host_memory_gib or mp.Host.measure(False).available / mp.GiB,
                                 args.device_memory_gib)
    elif args.host_memory_gib:  # this machine, its memory as stated (a microVM's grows as it is used)
        host = mp.Host.stated(args.host_memory_gib, mp.Host.measure(real_cuda))
    else:
        host = mp.Host.measure(cuda)
    # measured here; a simulated GPU on a CPU host adds a stated estimate of the CUDA context's host memory
    base = mp.process_base_bytes(args.engines, real_cuda) + (mp.CUDA_CONTEXT if cuda and not real_cuda else 0)
    return host, base, cuda


def memory_needs(args: argparse.Namespace, base: int, cuda: bool) -> tuple[mp.ModelShape | None, list[mp.Need]]:
    """The model's shape and every engine's estimate (a hub model's shape from its local config.json)."""
    try:
        shape = mp.ModelShape.from_workload(workload(args))
    except (FileNotFoundError, KeyError) as exc:  # --allow-download of a model not here: nothing to plan from
        print(f"memory plan: not made ({exc})", file=sys.stderr)
        return None, []
    return shape, mp.plan(args.engines, shape, 2 if args.dtype != "fp32" else 4, cuda, args.block,
                          args.seq_len, args.micro_batch, base)


def plan(args: argparse.Namespace, skips: dict[str, str | None] | None = None,
         estimates: dict[str, float] | None = None) -> list[PlannedRun]:
    """Every (repeat, engine) with telemetry, engines interleaved within a repeat, seed SEED + repeat; then
    configs.OVERHEAD_ENGINE without telemetry (OVERHEAD_CHECK_REPEATS rounds: the overhead check, not a cell).
    `estimates`: the memory plan's seconds per engine's run (--deadline-s reads them)."""
    skips, estimates = skips or {}, estimates or {}
    steps = (4, 4) if args.smoke else (args.warmup_steps, args.timed_steps)
    fractions = args.cores_ablation or [None]  # None: the block as DeepSpeedExamples sets it
    runs = [(r, e, True, f) for r in range(args.repeats) for f in fractions for e in args.engines]
    if OVERHEAD_ENGINE in args.engines and not args.no_overhead_check:
        runs += [(r, OVERHEAD_ENGINE, False, None) for r in range(min(args.repeats, OVERHEAD_CHECK_REPEATS))]
    planned = []
    for rep, engine, telemetry, fraction in runs:
        block = args.block if fraction is None else {**args.block, "pt_reserved_cores_perc": float(fraction)}
        cfg = deepspeed_config(engine, block, args.dtype, args.micro_batch, lr=2e-5,
                               weight_decay=0.01, clipping=1.0, cuda=torch.cuda.is_available() and args.device != "cpu",
                               nvme_path=str(args.nvme_path) if args.nvme_path else None)
        # the split this fraction makes of these cores, for the ablation's table (reports/cores.py)
        split = {} if fraction is None else {"split": planned_split(engine, fraction)}
        spec = RunSpec(engine=engine, label="llama7b", workload={**workload(args), "seed": args.seed + rep},
                       ds_config=cfg, telemetry=telemetry, num_gpus=args.nproc, extra={"repeat": rep, **split},
                       warmup_steps=steps[0], timed_steps=steps[1], placement=args.placement)
        protocol = {"warmup_steps": spec.warmup_steps, "timed_steps": -(-spec.timed_steps // spec.cycle) * spec.cycle,
                    "telemetry": telemetry, "repeat": rep}  # timed steps: whole update cycles, as the run rounds
        setting = "" if fraction is None else f"-cores{fraction:g}"
        planned.append(PlannedRun(f"{engine}{setting}{'' if telemetry else '-no-telemetry'}-r{rep}.json", spec,
                                  protocol, skip=skips.get(engine), estimate_s=estimates.get(engine)))
    return planned


if __name__ == "__main__":
    sys.exit(main())
