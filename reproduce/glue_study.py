"""Is ZenFlow's GLUE deficit ZenFlow's or the budget's? Two studies beside the default GLUE parity runs:

- budget: ZeRO-Offload (ref-offload) and ZenFlow (ref-zenflow) on the same training subsets for 3 epochs instead of
  1 (3× the updates, the same examples: the budget changes, nothing else), seeds 0 1 2;
- knobs: ZenFlow at the default budget with the two knobs that set how stale the host part is moved one at a time,
  update interval 1, 2 (default 4) and topk ratio 0.05, 0.2 (default 0.1), seeds 0 1 2, against the default run's
  ZeRO-Offload records (results/glue/<hardware-id>/, `make reproduce-glue`).
- reproduce: seed 0 of the default run again (both engines), to show the committed default records still hold.

Each setting is its own result set, made by reproduce/glue.py, in results/glue/<hardware-id>/study/<setting>/; a
finished setting is kept, an unfinished one is resumed. The report (deficits with paired 95% intervals, a verdict
per setting, table.md/.csv and figure.png in study/) reads records only (zenflow/reports/glue_study.py, docs/glue.md).

    make reproduce-glue-study                                   # ≈75 min on a quiet 2-core machine
    python reproduce/glue_study.py --settings budget-3-epochs    # one setting
    python reproduce/glue_study.py --report-only
    python reproduce/glue_study.py --glue-args='--tasks MRPC --seeds 0 --train-examples 32' --out /tmp/s   # a smoke
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from glue import main as glue_main  # reproduce/glue.py (this script runs from reproduce/)

from zenflow.harness import cli
from zenflow.harness.records import read_records
from zenflow.harness.result_sets import PARTIAL
from zenflow.reports.glue_study import SETTINGS, study_report
from zenflow.telemetry.environment import capture_environment

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    ap.add_argument("--default-runs", type=cli.existing_folder("records folder"), default=None,
                    help="the default GLUE run's records (default: results/glue/<hardware-id>)")
    ap.add_argument("--out", type=cli.out_folder, default=None, help="default: <default-runs>/study")
    ap.add_argument("--glue-args", type=shlex.split, default=[], metavar="'ARGS'",
                    help="passed to every reproduce/glue.py run, e.g. --glue-args='--train-examples 64' (a quick look)")
    ap.add_argument("--report-only", action="store_true", help="remake the report from the records")
    args = ap.parse_args(argv)
    cli.distinct(ap, "--settings", args.settings)
    default_runs = args.default_runs or ROOT / "results" / "glue" / capture_environment()["hardware_id"]
    out = args.out or default_runs / "study"
    if not args.report_only:
        for name in args.settings:
            status = _run_setting(name, out / name, args.glue_args)
            if status:
                return status
    return _report(default_runs, out)


def _run_setting(name: str, folder: Path, glue_args: list[str]) -> int:
    """One setting's result set through reproduce/glue.py: kept when finished, resumed when unfinished."""
    if (folder / PARTIAL).is_dir():
        resume = ["--resume"]
    elif read_records(folder) if folder.is_dir() else []:
        print(f"{name}: kept ({folder} is a finished result set)", file=sys.stderr)
        return 0
    else:
        resume = []
    print(f"{name}: reproduce/glue.py {' '.join(SETTINGS[name] + glue_args)}", file=sys.stderr, flush=True)
    return glue_main([*SETTINGS[name], *glue_args, "--out", str(folder), *resume])


def _report(default_runs: Path, out: Path) -> int:
    default = read_records(default_runs) if default_runs.is_dir() else []
    settings = {name: read_records(out / name) for name in SETTINGS if (out / name).is_dir()}
    if not default or not any(settings.values()):
        return cli.refuse(f"argument --out: no study records in {str(out)!r} or no default records in "
                         f"{str(default_runs)!r}: expected `make reproduce-glue` and this script's runs first")
    study_report(default, {k: v for k, v in settings.items() if v}, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
