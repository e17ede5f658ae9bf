"""Cost model: calibrate on this machine, validate against the committed cpu-scale runs, project to GPUs.

    python reproduce/project.py                   # what `make project` runs: calibrate, validate, project
    python reproduce/project.py --no-calibrate    # reuse results/costmodel/<hardware-id>/calibration.json
    python reproduce/project.py --run-validation  # also (re)run the cpu-scale validation runs (≈30 min)

Output in results/costmodel/<hardware-id>/: calibration.json, validation.md/.csv/.png (predicted vs measured),
projection.md/.csv/.png (PROJECTED GPU step times beside the paper's Figure 1 values), projection-band.md/.csv (the
projection as a band over host assumptions, and at the same update frequency), inverse.md/.json (the inputs the
published step times imply) and sensitivity.png (speedup against the host/compute ratio, published points on it).
host-adam.json (DeepSpeed's CPU Adam beside torch's, `python -m zenflow.costmodel.host_adam`) is read when present.
The logic lives in zenflow/costmodel/ (validate.py, projection.py, inverse.py,
sensitivity.py); its tables and figures in zenflow/reports/costmodel.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from zenflow.costmodel.presets import load_calibration
from zenflow.costmodel.projection import projection
from zenflow.costmodel.validate import EXTRA_SEQS, run_validation, validation
from zenflow.harness.checks import arguments as cc
from zenflow.harness.configs import ENGINES
from zenflow.reports.costmodel import (
    projection_figure,
    validation_figure,
    write_falsifiable,
    write_projection,
    write_validation,
)
from zenflow.telemetry.environment import capture_environment

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = cc.ArgumentParser(description=__doc__.split("\n\n")[0])  # every argument checked before any run
    ap.add_argument("--no-calibrate", action="store_true", help="reuse the committed calibration record")
    ap.add_argument("--run-validation", action="store_true", help="rerun the cpu-scale runs at --seqs first")
    ap.add_argument("--engines", nargs="+", default=["no-offload", "ref-offload", "ref-zenflow", "ds-zero-offload",
                                                     "ds-zenflow"], choices=ENGINES, help="engines of --run-validation")
    ap.add_argument("--repeats", type=cc.int_at_least(1), default=2,
                    help="runs per engine and sequence (--run-validation)")
    ap.add_argument("--seqs", type=cc.int_at_least(1), nargs="+", default=list(EXTRA_SEQS),
                    help="sequences (--run-validation)")
    ap.add_argument("--hardware-id", default=None,
                    help="remake the validation and projection of a committed results/costmodel/<id>/ from its own "
                    "calibration and records (another machine's; implies --no-calibrate)")
    args = ap.parse_args(argv)
    cc.distinct(ap, "--engines", args.engines)
    cc.distinct(ap, "--seqs", args.seqs)
    hw = args.hardware_id or capture_environment()["hardware_id"]
    out = ROOT / "results" / "costmodel" / hw
    if args.hardware_id:
        if args.run_validation:
            ap.error("argument --run-validation: measures this machine; it cannot go with --hardware-id")
        if not (out / "calibration.json").exists():
            ap.error(f"argument --hardware-id: {hw}: no results/costmodel/{hw}/calibration.json (have: "
                     + ", ".join(sorted(p.name for p in out.parent.glob("*/"))) + ")")
        args.no_calibrate = True
    problem = cc.folder_problem(out)
    if problem:
        ap.error(f"results folder {str(out)!r} {problem}")
    if args.run_validation:
        run_validation(out / "validation", args.engines, args.repeats, tuple(args.seqs))
    if not args.no_calibrate or not (out / "calibration.json").exists():
        done = subprocess.run([sys.executable, "-m", "zenflow.costmodel.calibrate"])
        if done.returncode:  # refused (spread beyond its bound: it said why) or failed; the committed one stays
            return done.returncode
        # DeepSpeed's CPU Adam beside torch's (the band's second kernel, the inverse check's per-core facts)
        subprocess.run([sys.executable, "-m", "zenflow.costmodel.host_adam"], check=True)
    cal = load_calibration(out / "calibration.json", hw)
    val, proj = validation(cal, hw), projection(cal)
    if val:
        print(write_validation(val, out, cal), "\n")
        validation_figure(val, out, hw)
    else:
        print(f"no validation records for {hw}: run `python reproduce/project.py --run-validation`\n")
    print(write_projection(proj, out, cal))
    projection_figure(proj, out)
    inv = write_falsifiable(cal, val, out)
    print(f"\ninverse check, band and sensitivity figure (PROJECTED): {out}/inverse.md, projection-band.md, "
          f"sensitivity.png; the blog's ρ {inv['rho_blog']:.0f} against our projection's {inv['projection_rho']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
