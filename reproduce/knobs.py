"""The knobs study: does ZenFlow's "auto" find what the best fixed setting finds? ref-zenflow at
update interval 1, 2, 4, 8 and "auto", topk 0.05, 0.1, 0.2 and select interval fixed or "auto", beside
ZeRO-Offload (ref-offload) and DeepSpeed's ZenFlow at "auto", on the Llama convergence workload (time to
ref-offload's final smoothed loss) and on GLUE SST-2 (time to ref-offload's final accuracy), 3 seeds, interleaved.

    make reproduce-knobs                                  # both workloads, each within --budget-min 60
    python reproduce/knobs.py --workloads llama --seeds 5 --budget-min 90
    python reproduce/knobs.py --report-only               # remake knobs.md/.csv, verdict.json and the figures
    python reproduce/knobs.py --smoke --out /tmp/knobs    # a tiny version (< 60 s), what the test runs

Every run is a run of reproduce/llama7b.py --convergence or of reproduce/glue.py --eval-every 16: their plan()
builds it from the setting's block and plans.execute runs it in a child of its own and writes its record, as theirs
do. One result set per workload in results/knobs/<hardware-id>/<workload>/; DeepSpeed's runs in its deepspeed/
subfolder, so that a run of theirs that fails (on GLUE its "auto" writes NaN at step 1: docs/design.md §7 A) does
not hold ours back: that failed record is the finding, kept in deepspeed/.partial/ and reported. Seed s of every
setting runs before seed s + 1 of any.

Time: before any run the runs still to do are estimated from the committed records (wall time per run of the same
engine, the median: results/llama7b/<hw>/convergence/, results/glue/<hw>/curve/, this machine's where it has them,
else another machine's, said so). Settings are dropped from the end of SETTINGS (their priority order) until each
workload fits --budget-min; a study that cannot hold ref-offload, one fixed setting and update-interval-auto is
refused before any run. Resumable: a run with an ok record here is not rerun (plans.execute --resume), nor one of
DeepSpeed's with a failed record (unless --rerun-failed). The report: zenflow/reports/knobs.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import glue  # reproduce/glue.py, reproduce/llama7b.py (this script runs from reproduce/)
import llama7b
import torch

from zenflow.harness import cli, local_inputs
from zenflow.harness.configs import DEEPSPEED_EXAMPLES_BLOCK, GLUE_BLOCK
from zenflow.harness.engines.registry import is_deepspeed
from zenflow.harness.glue.data import GlueError
from zenflow.harness.glue.workload import check_inputs
from zenflow.harness.plans import PlannedRun, execute
from zenflow.harness.preflight import PreflightError, check_build_locks
from zenflow.harness.records import RecordError, RunRecord, read_records
from zenflow.harness.result_sets import PARTIAL
from zenflow.harness.workloads import WorkloadError
from zenflow.reports.knobs import knobs_report
from zenflow.telemetry.environment import capture_environment

ROOT = Path(__file__).resolve().parents[1]


class Refused(Exception):
    """A study that cannot start (inputs missing, a budget too small): one line, exit status 2, before any run."""


@dataclass(frozen=True)
class Setting:
    name: str
    engine: str
    knobs: dict[str, Any]  # over the workload's own block (DEEPSPEED_EXAMPLES_BLOCK, GLUE_BLOCK)


# In priority order: a budget drops settings from the end; the first ESSENTIAL are the least study that judges "auto".
SETTINGS = (Setting("ref-offload", "ref-offload", {}),
            Setting("update-interval-4", "ref-zenflow", {}),  # the default block: topk 0.1, select interval fixed
            Setting("update-interval-auto", "ref-zenflow", {"update_interval": "auto"}),
            Setting("select-interval-auto", "ref-zenflow", {"select_interval": "auto"}),
            Setting("ds-update-interval-auto", "ds-zenflow", {"update_interval": "auto"}),
            Setting("update-interval-2", "ref-zenflow", {"update_interval": 2}),
            Setting("update-interval-8", "ref-zenflow", {"update_interval": 8}),
            Setting("update-interval-1", "ref-zenflow", {"update_interval": 1}),
            Setting("topk-ratio-0.05", "ref-zenflow", {"topk_ratio": 0.05}),
            Setting("topk-ratio-0.2", "ref-zenflow", {"topk_ratio": 0.2}))
ESSENTIAL = 3
SMOKE_SETTINGS = ("ref-offload", "update-interval-4", "update-interval-auto")
WORKLOADS = {"llama": "llama", "glue": "glue-sst2"}  # --workloads name -> folder
ESTIMATED_FROM = {"llama": "results/llama7b/{hw}/convergence", "glue": "results/glue/{hw}/curve"}
GLUE_EVAL_EVERY = 16  # as the committed curve (docs/glue.md): 8 points over 128 steps
SMOKE_STEPS = 16  # timed steps of a smoke run: "auto"'s cap (16) puts at least one host update in its trace


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=None,
                    help="default: both (--smoke: llama)")
    ap.add_argument("--settings", nargs="+", choices=[s.name for s in SETTINGS], default=None,
                    help="default: all (--smoke: " + " ".join(SMOKE_SETTINGS) + ")")
    ap.add_argument("--seeds", type=cli.int_at_least(1), default=None, help="seeds per setting (default 3; --smoke 1)")
    ap.add_argument("--budget-min", type=cli.float_at_least(0, strict=True), default=60.0,
                    help="minutes per workload the runs still to do may take, estimated from the committed records "
                    "(default %(default)s): settings are dropped from the end of the priority order to fit")
    ap.add_argument("--out", type=cli.out_folder, default=None,
                    help="default: results/knobs/<hardware-id> (with --placement split: its placement-split/)")
    cli.add_placement(ap)
    ap.add_argument("--smoke", action="store_true", help="a tiny Llama, 4+16 steps, 1 seed, 3 settings (< 60 s)")
    ap.add_argument("--rerun-failed", action="store_true", help="rerun DeepSpeed's runs whose record says failed")
    ap.add_argument("--resume", action="store_true", help="accepted, always on: a run whose record is here is kept")
    ap.add_argument("--report-only", action="store_true", help="remake the report from the records in --out")
    args = ap.parse_args(argv)
    for option in ("--workloads", "--settings"):
        cli.distinct(ap, option, getattr(args, option[2:]) or [])
    args.workloads = args.workloads or (["llama"] if args.smoke else list(WORKLOADS))
    names = args.settings or (list(SMOKE_SETTINGS) if args.smoke else [s.name for s in SETTINGS])
    args.settings = [s for s in SETTINGS if s.name in names]  # priority order
    args.seeds = args.seeds or (1 if args.smoke else 3)
    if not args.report_only:
        cli.check_placement_args(ap, args, cuda=torch.cuda.is_available())
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except SystemExit as exc:  # one line and 2 on bad input, 0 after --help
        return exc.code
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed's CPU accelerator, without its warning
    env = capture_environment()
    out = args.out or ROOT / "results" / "knobs" / env["hardware_id"] / cli.placement_name(args.placement)
    status = 0 if args.report_only else study(out, args, env["hardware_id"], argv)
    if status in (2, 130):  # refused before any run, or interrupted (the same command continues)
        return status
    by_workload = {w: study_records(out / WORKLOADS[w]) for w in WORKLOADS if (out / WORKLOADS[w]).is_dir()}
    by_workload = {w: r for w, r in by_workload.items() if r}
    if not by_workload:
        return cli.refuse(f"argument --out: no knobs records in {str(out)!r}: expected this script's runs first")
    knobs_report(by_workload, out, env)  # labelled by the records' own hardware
    return status


def study(out: Path, args: argparse.Namespace, hw: str, argv: list[str] | None) -> int:
    """Plan, fit the budget (refused: 2, before any run), then run round by round (run_rounds' status)."""
    problem = next((f"argument --out: {str(out / WORKLOADS[w])!r} {p}" for w in args.workloads
                    if (p := cli.placement_problem(out / WORKLOADS[w], args.placement))), None)
    if problem:  # two placements never share a study
        return cli.refuse(problem)
    try:
        plans = {w: plan(w, args) for w in args.workloads}
        chosen = {w: fit(w, plans[w], out / WORKLOADS[w], args, hw) for w in args.workloads}
    except (GlueError, WorkloadError, PreflightError, Refused) as exc:
        return cli.refuse(str(exc))
    return run_rounds(out, chosen, args, argv)


def plan(workload: str, args: argparse.Namespace) -> list[tuple[Setting, PlannedRun]]:
    """Every (setting, seed) run of `workload`, built by reproduce/llama7b.py's or reproduce/glue.py's plan() from
    the setting's block, named <setting>-s<seed>.json; checked before any run as those scripts check theirs."""
    smoke = ["--smoke"] if args.smoke else []
    placed = ["--placement", args.placement]  # every run of the study at the study's placement
    if workload == "llama":
        base = llama7b.parse_args(["--convergence", "--no-overhead-check", "--repeats", str(args.seeds), *smoke,
                                   *placed])
        problem = local_inputs.problem(base.model, base.data, base.allow_download)
        if problem:
            raise Refused(problem)
        default, build = DEEPSPEED_EXAMPLES_BLOCK, llama7b.plan
    else:
        tiny = ["--train-examples", "32", "--eval-examples", "32", "--seq-len", "32"] if args.smoke else []
        every = "2" if args.smoke else str(GLUE_EVAL_EVERY)
        base = glue.parse_args(["--tasks", "SST-2", "--seeds", *map(str, range(args.seeds)), "--eval-every", every,
                                *tiny, *placed])
        tasks, model = check_inputs(base.tasks, base.glue_dir, base.model)
        default, build = GLUE_BLOCK, lambda a: glue.plan(a, tasks, model)
    if any(is_deepspeed(s.engine) for s in args.settings):
        check_build_locks()  # a stale DeepSpeed op-build lock would hang every ds run with no output
    runs = []
    for setting in args.settings:
        their = argparse.Namespace(**{**vars(base), "engines": [setting.engine], "block": {**default, **setting.knobs}})
        for run in build(their):
            runs.append((setting, renamed(run, setting, smoke=bool(args.smoke) and workload == "llama")))
    order = [s.name for s in args.settings]  # interleaved: every setting's seed s before any seed s + 1
    return sorted(runs, key=lambda sr: (sr[1].spec.workload["seed"], order.index(sr[0].name)))


def renamed(run: PlannedRun, setting: Setting, smoke: bool) -> PlannedRun:
    """The run as <setting>-s<seed>.json; a Llama smoke run gets SMOKE_STEPS timed steps instead of 4."""
    if smoke:
        spec = dataclasses.replace(run.spec, timed_steps=SMOKE_STEPS)
        run = dataclasses.replace(run, spec=spec, protocol={**run.protocol, "timed_steps": SMOKE_STEPS})
    return dataclasses.replace(run, name=f"{setting.name}-s{run.spec.workload['seed']}.json")


def folder_of(out: Path, setting: Setting) -> Path:
    """Ours in the workload's folder, DeepSpeed's in its deepspeed/ subfolder (its failures are findings)."""
    return out / "deepspeed" if is_deepspeed(setting.engine) else out


def recorded(folder: Path, run: PlannedRun, failed_too: bool) -> bool:
    """Is there a record of this very run (same engine, config asked for and workload) in `folder` or its stage:
    an ok one, or with `failed_too` any?"""
    for where in (folder, folder / PARTIAL):
        try:
            old = RunRecord.read(where / run.name)
        except RecordError:
            continue
        same = (old.engine == run.spec.engine and old.protocol.get("spec_config", old.config) == run.spec.ds_config
                and all(old.workload.get(k) == v for k, v in run.spec.workload.items()))
        if same and (old.status == "ok" or failed_too):
            return True
    return False


def to_do(out: Path, runs: list[tuple[Setting, PlannedRun]], rerun_failed: bool,
          ok_too: bool = True) -> list[tuple[Setting, PlannedRun]]:
    """The runs without a record to keep: an ok one (unless not `ok_too`: plans.execute keeps those itself), or one
    of DeepSpeed's that failed (unless `rerun_failed`)."""
    def kept(s: Setting, r: PlannedRun) -> bool:
        failed = is_deepspeed(s.engine) and not rerun_failed and recorded(folder_of(out, s), r, failed_too=True)
        return failed or (ok_too and recorded(folder_of(out, s), r, failed_too=False))
    return [(s, r) for s, r in runs if not kept(s, r)]


def run_seconds(workload: str, hw: str) -> tuple[dict[str, float], str]:
    """engine -> the median wall time of its committed runs of this workload (this machine's, else the first other
    machine's that has them), and the folder it came from."""
    pattern = ESTIMATED_FROM[workload]
    for folder in [ROOT / pattern.format(hw=hw), *sorted(ROOT.glob(pattern.format(hw="*")))]:
        walls: dict[str, list[float]] = {}
        for r in read_records(folder) if folder.is_dir() else []:
            if r.status == "ok" and r.metrics.get("wall_seconds") and r.workload.get("task", "SST-2") == "SST-2":
                walls.setdefault(r.engine, []).append(r.metrics["wall_seconds"])
        if walls:
            return {e: statistics.median(w) for e, w in walls.items()}, str(folder.relative_to(ROOT))
    return {}, ""


def fit(workload: str, runs: list[tuple[Setting, PlannedRun]], out: Path, args: argparse.Namespace,
        hw: str) -> list[tuple[Setting, PlannedRun]]:
    """The runs of the settings that fit --budget-min (a prefix of the priority order), said in words; a study
    too small to judge "auto" is refused (ValueError) before any run."""
    remaining = to_do(out, runs, args.rerun_failed)
    if args.smoke:
        print(f"{workload}: smoke, {len(remaining)} tiny runs to do (no estimate)", file=sys.stderr)
        return runs
    seconds, source = run_seconds(workload, hw)
    missing = sorted({s.engine for s, _ in remaining} - set(seconds))
    if missing:
        raise Refused(f"argument --budget-min: no committed {ESTIMATED_FROM[workload].format(hw='<hw>')} records of "
                         f"{', '.join(missing)} to estimate from: expected that folder for some machine")
    budget, total, kept = args.budget_min * 60, 0.0, []
    for setting in args.settings:
        cost = sum(seconds[s.engine] for s, _ in remaining if s is setting)
        if total + cost > budget:
            break
        total, kept = total + cost, kept + [setting]
    dropped = [s.name for s in args.settings if s not in kept]
    need = [s for s in SETTINGS[:ESSENTIAL] if s in args.settings]
    if any(s not in kept for s in need):
        least = sum(seconds[s.engine] for s, _ in remaining if s in need) / 60
        raise Refused(f"argument --budget-min: {args.budget_min:g} min for {workload} does not hold "
                         f"{', '.join(s.name for s in need)} × {args.seeds} seeds (≈{least:.0f} min estimated from "
                         f"{source}): expected --budget-min {math.ceil(least)} or more")
    print(f"{workload}: {len([r for s, r in remaining if s in kept])} runs to do, ≈{total / 60:.0f} min (the median "
          f"wall time per engine of {source}{'' if hw in source else ', another machine'}) within "
          f"{args.budget_min:g} min" + (f"; dropped to fit: {', '.join(dropped)}" if dropped else "; every setting"),
          file=sys.stderr, flush=True)
    return [(s, r) for s, r in runs if s in kept]


def run_rounds(out: Path, chosen: dict[str, list[tuple[Setting, PlannedRun]]], args: argparse.Namespace,
               argv: list[str] | None) -> int:
    """Round by round (each workload's r-th seed), that seed's runs through plans.execute: ours, then DeepSpeed's
    folder; ok records are kept by execute's --resume, failed ones of DeepSpeed's are left out here."""
    command, failed = cli.command_line("reproduce/knobs.py", argv), []
    seeds = {w: sorted({r.spec.workload["seed"] for _, r in runs}) for w, runs in chosen.items()}
    for round_ in range(max(map(len, seeds.values()), default=0)):
        for workload, runs in chosen.items():
            if round_ >= len(seeds[workload]):
                continue
            folder, seed = out / WORKLOADS[workload], seeds[workload][round_]
            todo = [sr for sr in to_do(folder, runs, args.rerun_failed, ok_too=False)
                    if sr[1].spec.workload["seed"] == seed]
            for where in dict.fromkeys(folder_of(folder, s) for s, _ in todo):
                mine = [r for s, r in todo if folder_of(folder, s) == where]
                status = execute(where, mine, command, lambda records, at: None, resume=True)
                if status == 130:
                    return status
                failed += [where] if status else []
    for where in dict.fromkeys(failed):
        print(f"failed runs in {where} (their records: {where / PARTIAL}); "
              + ("DeepSpeed's: reported as they are, not rerun" if where.name == "deepspeed" else
                 "the same command reruns them"), file=sys.stderr)
    return 1 if any(w.name != "deepspeed" for w in failed) else 0


def study_records(folder: Path) -> list[RunRecord]:
    """A workload's records: its result set and its stage, and DeepSpeed's folder and stage (a name once)."""
    found: dict[str, RunRecord] = {}
    for where in (folder, folder / PARTIAL, folder / "deepspeed", folder / "deepspeed" / PARTIAL):
        for path in sorted(where.glob("*.json")) if where.is_dir() else []:
            key = f"{where.parent.name if where.name == PARTIAL else where.name}/{path.name}"
            if key not in found and not path.name.startswith("."):
                found[key] = RunRecord.read(path)
    return list(found.values())


if __name__ == "__main__":
    sys.exit(main())
