"""Cost model: calibrate on this machine, validate against cpu-scale runs of the same day, project to GPUs.

    python reproduce/project.py                   # what `make project` runs: calibrate, sample, validate, project
    python reproduce/project.py --no-sample       # validate against the committed full validation instead
    python reproduce/project.py --run-validation  # rerun the full validation (2 runs per point, ≈30 min) instead
    python reproduce/project.py --no-calibrate    # reuse results/costmodel/<hardware-id>/calibration.json
    python reproduce/project.py --hardware-id ID  # remake a committed folder's tables (no run, no calibration)

The same-day sample (docs/cost-model.md, "Same-day validation"): after calibrating, one run of each engine of the
verdict (no-offload, ref-offload, ref-zenflow, ds-zero-offload, ds-zenflow) at each sequence of its count (4, 16, 64,
256, 512), interleaved: 25 runs into results/costmodel/<hardware-id>/validation-sample/seqN/, published only when all
are done (an interrupted sample leaves the folder as it was). Estimated from the committed records (their steps, plus a
run child's start-up measured in the records that note their wall time: `validate.sample_seconds`): ≈6 min on the AMD
EPYC VM, ≈7 min on the Intel Xeon VM, within a 15-minute budget that leaves room for waits on a busy machine (two
repeats, --repeats 2: ≈11 and ≈14 min). The calibration is validated against the sample alone, seq 16 included.

Age: this VM's speed changes between days, so a calibration is validated only against runs taken within 12 hours of
it (validate.MAX_AGE_H), either way; beyond that, or when a time is unknown, it is refused in one line before any
run, unless --allow-old-runs (then the table's first line warns). Every validation.md states when its runs and its
calibration were taken. --hardware-id remakes what was validated then (against the runs its validation.json names)
and states the ages, warning where they exceed the bound, without refusing.

Output in results/costmodel/<hardware-id>/: calibration.json, validation.md/.csv/.json/.png (predicted vs measured;
the .json: which runs, when taken), projection.md/.csv/.png (PROJECTED GPU step times beside the paper's Figure 1
values), projection-band.md/.csv (the projection as a band over host assumptions, and at the same update
frequency), inverse.md/.json (the inputs the published step times imply) and sensitivity.png (speedup against the
host/compute ratio, published points on it). host-adam.json (DeepSpeed's CPU Adam beside torch's, `python -m
zenflow.costmodel.host_adam`) is read when present. The logic lives in zenflow/costmodel/ (validate.py,
projection.py, inverse.py, sensitivity.py); its tables and figures in zenflow/reports/costmodel.py.
"""

from __future__ import annotations

import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from zenflow.costmodel.presets import load_calibration
from zenflow.costmodel.projection import projection
from zenflow.costmodel.validate import (
    EXTRA_SEQS,
    MAX_AGE_H,
    SAMPLE,
    SAMPLE_ENGINES,
    SAMPLE_REPEATS,
    VERDICT_SEQS,
    calibration_span,
    dating,
    record_sets,
    run_validation,
    runs_span,
    validation,
    validation_dating,
)
from zenflow.harness import cli
from zenflow.harness.configs import ENGINES
from zenflow.reports.costmodel import (
    committed_runs,
    projection_figure,
    span_text,
    validation_figure,
    write_falsifiable,
    write_projection,
    write_validation,
)
from zenflow.telemetry.environment import capture_environment

ROOT = Path(__file__).resolve().parents[1]
FULL_REPEATS = 2


def main(argv: list[str] | None = None) -> int:
    ap = cli.ArgumentParser(description=__doc__.split("\n\n")[0])  # every argument checked before any run
    ap.add_argument("--no-calibrate", action="store_true", help="reuse the committed calibration record")
    ap.add_argument("--no-sample", action="store_true",
                    help="take no same-day sample: validate against the committed full validation")
    ap.add_argument("--run-validation", action="store_true",
                    help="rerun the full validation at --seqs first and validate against it (no sample)")
    ap.add_argument("--allow-old-runs", action="store_true",
                    help=f"validate against runs more than {MAX_AGE_H:.0f} h from the calibration (the table warns)")
    ap.add_argument("--engines", nargs="+", default=list(SAMPLE_ENGINES), choices=ENGINES,
                    help="engines of the sample or of --run-validation")
    ap.add_argument("--repeats", type=cli.int_at_least(1), default=None,
                    help=f"runs per engine and sequence (default: the sample {SAMPLE_REPEATS}, --run-validation "
                    f"{FULL_REPEATS})")
    ap.add_argument("--seqs", type=cli.int_at_least(1), nargs="+", default=None,
                    help=f"sequences (default: the sample {' '.join(map(str, VERDICT_SEQS))}, --run-validation "
                    f"{' '.join(map(str, EXTRA_SEQS))})")
    ap.add_argument("--hardware-id", default=None,
                    help="remake the validation and projection of a committed results/costmodel/<id>/ from its own "
                    "calibration and records (another machine's; implies --no-calibrate, takes no run)")
    args = ap.parse_args(argv)
    cli.distinct(ap, "--engines", args.engines)
    cli.distinct(ap, "--seqs", args.seqs or [])
    hw = args.hardware_id or capture_environment()["hardware_id"]
    out = ROOT / "results" / "costmodel" / hw
    if args.hardware_id:
        if args.run_validation:
            ap.error("argument --run-validation: measures this machine; it cannot go with --hardware-id")
        if not (out / "calibration.json").exists():
            ap.error(f"argument --hardware-id: {hw}: no results/costmodel/{hw}/calibration.json (have: "
                     + ", ".join(sorted(p.name for p in out.parent.glob("*/"))) + ")")
        args.no_calibrate = True
    problem = cli.folder_problem(out)
    if problem:
        ap.error(f"results folder {str(out)!r} {problem}")
    sampling = not (args.hardware_id or args.no_sample or args.run_validation)
    runs = "sample" if sampling else "full"
    if args.hardware_id and not args.no_sample:
        runs = committed_runs(out)  # remade against the runs it was validated against then
    calibrating = not args.no_calibrate or not (out / "calibration.json").exists()
    if not (args.hardware_id or args.allow_old_runs):  # refused before minutes of calibration and runs
        old = _too_old(hw, runs, fresh_calibration=calibrating, fresh_runs=sampling or args.run_validation)
        if old:
            return cli.refuse(old)
    try:
        if args.run_validation and not run_validation(out / "validation", args.engines, args.repeats or FULL_REPEATS,
                                                      tuple(args.seqs or EXTRA_SEQS)):
            return 1  # a failed run: validation/ is as it was
        if calibrating:
            done = subprocess.run([sys.executable, "-m", "zenflow.costmodel.calibrate"])
            if done.returncode:  # refused (spread beyond its bound: it said why) or failed; the committed one stays
                return done.returncode
            # DeepSpeed's CPU Adam beside torch's (the band's second kernel, the inverse check's per-core facts)
            subprocess.run([sys.executable, "-m", "zenflow.costmodel.host_adam"], check=True)
        if sampling and not run_validation(out / SAMPLE, args.engines, args.repeats or SAMPLE_REPEATS,
                                           tuple(args.seqs or VERDICT_SEQS), replace=True):
            return 1  # a failed run: the sample is not published, nothing is validated against part of it
    except KeyboardInterrupt:
        print(f"interrupted: nothing of this sitting was validated; {out} keeps its last complete sets of runs",
              file=sys.stderr)
        return 130
    cal = load_calibration(out / "calibration.json", hw)
    when = validation_dating(cal, hw, ROOT, runs)
    if when["over_bound"] and record_sets(hw, ROOT, runs) and not (args.hardware_id or args.allow_old_runs):
        return cli.refuse(_age_message(when))
    val, proj = validation(cal, hw, ROOT, runs), projection(cal)
    if val:
        print(write_validation(val, out, cal, when), "\n")
        validation_figure(val, out, hw)
    else:
        print(f"no validation records for {hw}: run `python reproduce/project.py` (a sample) or --run-validation\n")
    print(write_projection(proj, out, cal))
    projection_figure(proj, out)
    inv = write_falsifiable(cal, val, out)
    print(f"\ninverse check, band and sensitivity figure (PROJECTED): {out}/inverse.md, projection-band.md, "
          f"sensitivity.png; the blog's ρ {inv['rho_blog']:.0f} against our projection's {inv['projection_rho']:.2f}")
    return 0


def _too_old(hw: str, runs: str, fresh_calibration: bool, fresh_runs: bool) -> str | None:
    """Before any run: would the calibration (now, when it is taken in this sitting) and the runs (now, likewise)
    be more than MAX_AGE_H apart? The refusal's line, or None."""
    if (fresh_calibration and fresh_runs) or (not fresh_runs and not record_sets(hw, ROOT, runs)):
        return None  # both of today, or no runs to validate against (said later)
    now = datetime.now(timezone.utc)
    path = ROOT / "results" / "costmodel" / hw / "calibration.json"
    cal = ((now, now), False) if fresh_calibration else calibration_span(load_calibration(path, hw), path)
    ran = ((now, now), False) if fresh_runs else runs_span(hw, ROOT, runs)
    when = dating(cal, ran, runs)
    return _age_message(when) if when["over_bound"] else None


def _age_message(when: dict[str, Any]) -> str:
    apart = f"up to {when['apart_h']:.1f} h" if when["apart_h"] is not None else "an unknown time"
    return (f"the {when['runs']} validation's runs (taken {span_text(when['runs_taken'])}) are {apart} from the "
            f"calibration (taken {span_text(when['calibration_taken'])}), beyond the {MAX_AGE_H:.0f} h bound: take a "
            "same-day sample (leave out --no-sample and --no-calibrate), or pass --allow-old-runs to validate anyway "
            "(the table's first line then warns)")


if __name__ == "__main__":
    sys.exit(main())
