"""The 7B-class sequence for one GPU host, in commands that each fit a device window (docs/llama7b-gpu.md).

GPU time often comes in short windows (a CI job, a borrowed node: commands of at most 10 minutes, about 40 minutes
in all). This script cuts the N-layer Llama-2-7B-shape scenario (reproduce/llama7b.py --shape llama2-7b) into such
commands: every engine, the same-frequency controls and the peers, grouped by the memory plan's run-time estimates,
each command wrapped in `timeout -s TERM` and continuing with --resume, all into one output folder that a warm
machine keeps (build/, ignored by git); the last step merges the records into one table (--report-only).

    python reproduce/gpu_7b.py --list            # the commands, numbered (nothing runs)
    python reproduce/gpu_7b.py --step 2          # run command 2 (a killed command: run the same step again)
    python reproduce/gpu_7b.py                   # every command in order (make gpu-7b)
    python reproduce/gpu_7b.py --publish results/llama7b/<hardware-id>/llama2-7b-8L   # copy records and table there

`--rehearsal` is the CPU dress rehearsal of the same sequence at a tiny shape (tests/reproduce/test_gpu_7b_sequence.py).
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from any folder

from zenflow.costmodel import host_ceiling  # noqa: E402
from zenflow.harness import memory_plan as mp  # noqa: E402
from zenflow.harness.checks import arguments as cc  # noqa: E402
from zenflow.harness.configs import DEEPSPEED_EXAMPLES_BLOCK, ENGINES, SHAPES  # noqa: E402
from zenflow.harness.engines.registry import is_deepspeed  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 360  # the estimated work packed into one command: the plan's times are rough, --resume absorbs overruns
DS_BUILD_S = 150  # DeepSpeed's CPU Adam op build, the first time on a fresh machine
REHEARSAL_ENGINES = ["no-offload", "ref-offload", "ref-zenflow"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = cc.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=cc.int_at_least(1), default=None,
                    help="Llama-2-7B layers (default: the most the memory plan admits on this host)")
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    ap.add_argument("--out", type=cc.out_folder, default=None, help="default: build/llama7b/llama2-7b-<N>L")
    ap.add_argument("--list", action="store_true", help="print the numbered commands and run nothing")
    ap.add_argument("--step", type=cc.int_at_least(1), default=None, help="run only this command")
    ap.add_argument("--budget-s", type=cc.int_at_least(1), default=BUDGET_S,
                    help="estimated seconds of runs packed into one command")
    ap.add_argument("--publish", type=cc.out_folder, default=None,
                    help="copy the merged records, table and figure into this folder (e.g. results/...)")
    ap.add_argument("--rehearsal", action="store_true", help="the CPU dress rehearsal: a tiny model (--smoke)")
    ap.add_argument("--python", type=interpreter, default=sys.executable, help="the interpreter of every command")
    return ap.parse_args(argv)


def interpreter(value: str) -> str:
    """A `type=` for --python: an executable on this host (a path, or a name on PATH)."""
    found = shutil.which(value)
    if found is None:
        raise argparse.ArgumentTypeError(f"{value!r} is not allowed: expected an executable Python interpreter")
    return found


def common_args(args: argparse.Namespace) -> list[str]:
    if args.rehearsal:
        return ["--smoke", "--device", "cpu", "--repeats", "1"]
    return ["--shape", "llama2-7b", "--layers", str(args.layers)]


def chunks(engines: list[str], seconds: dict[str, float], budget_s: float) -> list[list[str]]:
    """Engines in table order, packed greedily into groups whose estimated run time stays within `budget_s` (an
    engine that alone exceeds it gets a group of its own; a run killed mid-way reruns on the step's second try)."""
    groups: list[list[str]] = []
    total = budget_s + 1
    for engine in engines:
        if total + seconds[engine] > budget_s:
            groups.append([])
            total = 0.0
        groups[-1].append(engine)
        total += seconds[engine]
    return groups


def llama2_7b(layers: int) -> mp.ModelShape:
    """The shape llama7b.py's --shape llama2-7b builds, at `layers` layers."""
    return mp.ModelShape.from_workload({"model": "llama2-7b-shape", **SHAPES["llama2-7b"], "layers": layers})


def run_seconds(args: argparse.Namespace) -> dict[str, float]:
    """Each engine's estimated time in the sequence: its run (plus the run without telemetry for ref-zenflow and the
    op build for the first DeepSpeed engine), from the memory plan's rough rates."""
    if args.rehearsal:
        return {e: 30.0 for e in args.engines}
    # a GPU host's rates (cuda=True), whatever runs this
    needs = mp.plan(args.engines, llama2_7b(args.layers), 2, True, DEEPSPEED_EXAMPLES_BLOCK, 512, 1, 0)
    seconds = {n.engine: n.run_s(12) * (2 if n.engine == "ref-zenflow" else 1) for n in needs}
    first_ds = next((e for e in args.engines if is_deepspeed(e)), None)
    if first_ds:
        seconds[first_ds] += DS_BUILD_S
    return seconds


def commands(args: argparse.Namespace) -> list[list[str]]:
    """The sequence: the plan, one command per group of engines, the merged report."""
    script = [args.python, str(ROOT / "reproduce" / "llama7b.py"), *common_args(args)]
    out = ["--out", str(args.out)]
    ceiling = [args.python, "-m", "zenflow.costmodel.host_ceiling", "--out", str(args.out),
               *(["--numel", str(2**20)] if args.rehearsal else [])]  # the host's rates, beside the speedup
    sequence = [[*script, "--plan"], ceiling]
    seconds = run_seconds(args)
    args.estimates = [0.0, 60.0]
    for group in chunks(args.engines, seconds, args.budget_s):
        args.estimates.append(sum(seconds[e] for e in group))
        sequence.append(["timeout", "-s", "TERM", str(mp.WINDOW_S), *script, "--engines", *group, *out, "--resume"])
    sequence.append([*script, *out, "--report-only"])
    args.estimates.append(0.0)
    return sequence


def resolve_layers(args: argparse.Namespace) -> int:
    """The most layers the memory plan admits here (what llama7b.py's --shape picks by itself), fixed once so that
    every command of the sequence runs the same model."""
    cuda = torch.cuda.is_available()
    host = mp.Host.measure(cuda)
    base = mp.process_base_bytes(args.engines, cuda)
    shape = llama2_7b(SHAPES["llama2-7b"]["layers"])
    return mp.largest_layers(args.engines, shape, host, 2, cuda, DEEPSPEED_EXAMPLES_BLOCK, 512, 1, base,
                             shape.layers)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except SystemExit as exc:
        return exc.code
    if args.rehearsal:
        args.engines = [e for e in args.engines if e in REHEARSAL_ENGINES]  # table order
    elif args.layers is None:
        args.layers = resolve_layers(args)
    args.out = args.out or ROOT / "build" / "llama7b" / ("rehearsal" if args.rehearsal else
                                                         f"llama2-7b-{args.layers}L")
    sequence = commands(args)
    if args.list:
        for i, (cmd, estimate) in enumerate(zip(sequence, args.estimates), 1):
            print(f"{i}. {shlex.join(cmd)}" + (f"    # ~{estimate / 60:.1f} min (rough)" if estimate else ""))
        return 0
    if args.step is not None and args.step > len(sequence):
        return cc.refuse(f"argument --step: {args.step} is not allowed: expected 1..{len(sequence)}")
    chosen = [sequence[args.step - 1]] if args.step else sequence
    for cmd in chosen:
        print(f"$ {shlex.join(cmd)}", file=sys.stderr, flush=True)
        code = subprocess.run(cmd, cwd=ROOT).returncode
        if code in (124, 130, 143):
            print(f"stopped (exit {code}): run the same step again to continue (--resume keeps its finished runs)",
                  file=sys.stderr)
            return code
        if code:
            return code
    if args.publish and (args.step is None or args.step == len(sequence)):
        publish(args.out, args.publish)
    return 0


def publish(out: Path, dest: Path) -> None:
    """Copy the merged result set (records, table, figure, the host's rates; no .partial) into `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    for path in sorted(out.iterdir()):
        if path.is_file() and not path.name.startswith("."):
            shutil.copy2(path, dest / path.name)
        elif path.is_dir() and path.name == Path(host_ceiling.FILE).parent.name:
            shutil.copytree(path, dest / path.name, dirs_exist_ok=True)
    print(f"published {out} -> {dest}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
