"""Scaling across ranks: one table and figure from the run records of the Llama scenario at several world sizes.

    make reproduce-llama7b NPROC=2                                       # the runs at 2 ranks (results/.../nproc-2)
    make reproduce-llama7b ARGS="--out results/llama7b/<hw>/nproc-1"     # the same session's 1-rank runs
    python reproduce/scaling.py                                          # table.md, figure.png in results/scaling/<hw>/

Reads records only (zenflow/reports/scaling.py); runs nothing. docs/distributed.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

from zenflow.harness import cli
from zenflow.harness.records import read_records
from zenflow.reports.scaling import scaling_report
from zenflow.telemetry.environment import capture_environment

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", nargs="+", type=cli.existing_folder("records folder"), default=None,
                    help="folders of run records (default: results/llama7b/<hardware-id>/nproc-*)")
    ap.add_argument("--out", type=cli.out_folder, default=None, help="default: results/scaling/<hardware-id>")
    args = ap.parse_args(argv)
    env = capture_environment()
    folders = args.runs or sorted((ROOT / "results" / "llama7b" / env["hardware_id"]).glob("nproc-*"))
    records = [r for folder in folders for r in read_records(folder)]
    if not records:
        return cli.refuse(f"argument --runs: no run records in {', '.join(map(str, folders)) or 'nproc-* folders'}: "
                         "expected the folders of make reproduce-llama7b NPROC=N runs")
    scaling_report(records, args.out or ROOT / "results" / "scaling" / env["hardware_id"], env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
