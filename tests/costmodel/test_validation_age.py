"""`make project` validates a calibration against runs of the same day.

A calibration is refused against runs more than MAX_AGE_H from it (either way) unless --allow-old-runs, and the
table then warns in its first line; the same-day sample is the verdict's points, interleaved, one repeat, within its
time budget as estimated from the committed records; an interrupted sample leaves nothing the validation reads.
Records and calibrations are the committed ones with chosen `taken_at` times, in a results tree under tmp_path; no
run, no calibration.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import re
import shutil
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import SimpleNamespace

import pytest

from zenflow.costmodel.validate import (
    MAX_AGE_H,
    SAMPLE,
    SAMPLE_BUDGET_S,
    SAMPLE_ENGINES,
    SAMPLE_REPEATS,
    VERDICT_SEQS,
    apart_h,
    plan,
    record_sets,
    run_validation,
    sample_seconds,
    span_of,
    validation,
    validation_dating,
)
from zenflow.harness.engines.registry import is_deepspeed
from zenflow.harness.records import RunRecord

ROOT = Path(__file__).resolve().parents[2]
HW = "cpu-scale-amd-epyc-2c"  # a committed folder whose validation has every sequence under validation/seqN/
COMMITTED = ROOT / "results" / "costmodel" / HW
T0 = datetime(2026, 11, 26, 9, 0, tzinfo=timezone.utc)


def _project():
    spec = importlib.util.spec_from_file_location("project_under_test", ROOT / "reproduce" / "project.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _iso(t: datetime) -> str:
    return t.isoformat(timespec="seconds")


def _results(root: Path, calibrated: datetime | None, runs_at: datetime | None) -> Path:
    """results/costmodel/<HW>/ under `root`: the committed calibration taken at `calibrated` (None: no calibration)
    and the committed full validation's records taken at `runs_at` (None: none)."""
    out = root / "results" / "costmodel" / HW
    out.mkdir(parents=True)
    if calibrated:
        cal = json.loads((COMMITTED / "calibration.json").read_text())
        (out / "calibration.json").write_text(json.dumps({**cal, "taken_at": _iso(calibrated)}))
    if runs_at:
        for path in sorted((COMMITTED / "validation").glob("seq*/*.json")):
            _stamped(path, out / "validation" / path.parent.name / path.name, runs_at)
    return out


def _stamped(src: Path, dest: Path, at: datetime) -> RunRecord:
    record = RunRecord.read(src)
    record.protocol["taken_at"] = _iso(at)
    dest.parent.mkdir(parents=True, exist_ok=True)
    record.write(dest)
    return record


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """reproduce/project.py on a results tree in tmp_path, on hardware HW, with no calibration, run or figure."""
    module = _project()
    monkeypatch.setattr(module, "ROOT", tmp_path)
    monkeypatch.setattr(module, "capture_environment", lambda: {"hardware_id": HW})
    for name in ("validation_figure", "projection_figure"):
        monkeypatch.setattr(module, name, lambda *a, **k: None)
    monkeypatch.setattr(module, "write_falsifiable", lambda *a, **k: {"rho_blog": 13.0, "projection_rho": 1.0})

    def no_measurement(*a, **k):
        raise AssertionError("a calibration or a run was started")
    monkeypatch.setattr(module, "subprocess", SimpleNamespace(run=no_measurement))
    monkeypatch.setattr(module, "run_validation", no_measurement)
    return module


# ---- the age rule ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("runs_after_h", [-(MAX_AGE_H + 1), MAX_AGE_H + 1], ids=["runs-older", "runs-newer"])
def test_runs_beyond_the_bound_are_refused_in_one_line_naming_the_flag(project, tmp_path: Path, runs_after_h: float,
                                                                       capsys: pytest.CaptureFixture) -> None:
    out = _results(tmp_path, T0, T0 + timedelta(hours=runs_after_h))
    assert project.main(["--no-calibrate", "--no-sample"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--allow-old-runs" in err and f"up to {abs(runs_after_h):.1f} h" in err, err
    assert not (out / "validation.md").exists()


def test_within_the_bound_it_validates_without_a_warning(project, tmp_path: Path) -> None:
    """The negative control of the refusal and of the warning: the same runs, 11 hours from the calibration."""
    out = _results(tmp_path, T0, T0 - timedelta(hours=MAX_AGE_H - 1))
    assert project.main(["--no-calibrate", "--no-sample"]) == 0
    lines = (out / "validation.md").read_text().splitlines()
    assert lines[0].startswith("# Cost model validation") and "Warning" not in "\n".join(lines[:4])
    assert lines[2].startswith("Taken: runs at 2026-11-25 22:00 UTC, calibration at 2026-11-26 09:00 UTC: at most "
                               "11.0 h apart (bound 12 h).")
    assert json.loads((out / "validation.json").read_text())["over_bound"] is False


def test_with_allow_old_runs_it_validates_and_the_first_line_warns(project, tmp_path: Path) -> None:
    out = _results(tmp_path, T0, T0 - timedelta(hours=30))
    assert project.main(["--no-calibrate", "--no-sample", "--allow-old-runs"]) == 0
    text = (out / "validation.md").read_text()
    assert text.startswith("> **Warning: runs and calibration up to 30.0 h apart, beyond the 12 h bound"), text[:200]
    assert "of 15 points within 15%" in text  # the verdict is still there, under the warning
    assert json.loads((out / "validation.json").read_text())["over_bound"] is True


def test_a_fresh_calibration_against_old_runs_is_refused_before_calibrating(project, tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture) -> None:
    """No calibration record here, so project.py would calibrate now: runs 13 hours old are refused first (the
    fixture fails any calibration or run). Control: runs of an hour ago get as far as calibrating."""
    _results(tmp_path, None, datetime.now(timezone.utc) - timedelta(hours=MAX_AGE_H + 1))
    assert project.main(["--no-sample"]) == 2
    assert "beyond the 12 h bound" in capsys.readouterr().err
    shutil.rmtree(tmp_path / "results")
    _results(tmp_path, None, datetime.now(timezone.utc) - timedelta(hours=1))
    with pytest.raises(AssertionError, match="a calibration or a run was started"):
        project.main(["--no-sample"])


def test_an_unknown_time_counts_as_beyond_the_bound(project, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Records without `taken_at` outside a git checkout cannot be dated: refused, saying so."""
    out = _results(tmp_path, T0, T0)
    for path in out.glob("validation/seq*/*.json"):
        record = RunRecord.read(path)
        del record.protocol["taken_at"]
        record.write(path)
    assert project.main(["--no-calibrate", "--no-sample"]) == 2
    assert "an unknown time from the calibration" in capsys.readouterr().err


def test_apart_is_the_longest_time_between_the_two_spans_either_way() -> None:
    h = timedelta(hours=1)
    assert apart_h((T0, T0), (T0 - 3 * h, T0 - h)) == pytest.approx(3)
    assert apart_h((T0, T0), (T0 + h, T0 + 5 * h)) == pytest.approx(5)
    assert apart_h((T0 - 2 * h, T0), (T0 + h, T0 + h)) == pytest.approx(3)  # a git window: its far end counts
    assert apart_h((T0, T0), (None, T0)) is None


def test_runs_taken_at_different_times_span_the_earliest_start_to_the_latest_end(tmp_path: Path) -> None:
    """Half the runs 13 h before the calibration, half 11 h: 13 h apart, over the bound (the latest start, 11 h,
    would pass them). The span of spans is the earliest start to the latest end."""
    h = timedelta(hours=1)
    assert span_of([(T0 - 13 * h, T0 - 12 * h), (T0 - 11 * h, T0 - 11 * h)]) == (T0 - 13 * h, T0 - 11 * h)
    out = _results(tmp_path, T0, T0 - 11 * h)
    records = sorted(out.glob("validation/seq*/*.json"))
    for path in records[::2]:
        _stamped(path, path, T0 - 13 * h)
    cal = json.loads((out / "calibration.json").read_text())
    when = validation_dating(cal, HW, tmp_path, "full")
    assert when["runs_taken"] == [_iso(T0 - 13 * h), _iso(T0 - 11 * h)]
    assert when["apart_h"] == pytest.approx(13.0) and when["over_bound"] is True


def test_hardware_id_remakes_an_old_folder_with_the_warning_instead_of_refusing(project, tmp_path: Path) -> None:
    """--hardware-id remakes what was validated then: runs 30 h from the calibration are stated and warned about,
    not refused (the refusal is for a validation being made now)."""
    out = _results(tmp_path, T0, T0 - timedelta(hours=30))
    assert project.main(["--hardware-id", HW]) == 0
    text = (out / "validation.md").read_text()
    assert text.startswith("> **Warning: runs and calibration up to 30.0 h apart, beyond the 12 h bound"), text[:200]
    assert json.loads((out / "validation.json").read_text())["over_bound"] is True


@pytest.mark.parametrize("folder", sorted(p.parent for p in (ROOT / "results" / "costmodel").glob("*/validation.md")),
                         ids=lambda p: p.name)
def test_every_committed_table_states_its_ages(folder: Path) -> None:
    """Each committed table says when its runs and calibration were taken (dated from git where they predate
    `taken_at`) and opens with the warning exactly when they may be further apart than the bound."""
    saved = json.loads((folder / "validation.json").read_text())
    assert None not in saved["runs_taken"] + saved["calibration_taken"], saved
    first, *rest = (folder / "validation.md").read_text().splitlines()
    assert first.startswith("> **Warning") is saved["over_bound"]
    assert any(line.startswith("Taken: runs ") and f"(bound {MAX_AGE_H:.0f} h)" in line for line in rest[:4])


# ---- the same-day sample -----------------------------------------------------------------------------------------
def _verdict_points(csv_path: Path) -> set[tuple[int, str]]:
    with open(csv_path) as f:
        return {(int(r["seq"]), r["engine"]) for r in csv.DictReader(f) if not is_deepspeed(r["engine"])}


def _interleaved(runs: list[tuple[int, int, str]]) -> bool:
    """No engine runs twice in a row, and each repeat runs every point before the next repeat starts."""
    repeats = [rep for rep, _, _ in runs]
    return all(a[2] != b[2] for a, b in zip(runs, runs[1:])) and repeats == sorted(repeats)


def test_the_sample_is_the_verdicts_points_interleaved_once_as_the_docstring_says() -> None:
    runs = plan(SAMPLE_ENGINES, SAMPLE_REPEATS, VERDICT_SEQS)
    points = {(seq, engine) for _, seq, engine in runs}
    assert SAMPLE_REPEATS == 1 and len(runs) == len(points) == 25 and _interleaved(runs)
    doc = " ".join(_project().__doc__.split())
    assert f"({', '.join(SAMPLE_ENGINES)}) at each sequence of its count ({', '.join(map(str, VERDICT_SEQS))})" in doc
    assert "interleaved: 25 runs" in doc
    for folder in sorted((ROOT / "results" / "costmodel").glob("*/validation.csv")):
        committed = _verdict_points(folder)
        assert len(committed) == 15 and committed <= points, folder  # the "of 15" of each committed table
    # negative controls: one engine left out misses points of the count; engine after engine is not interleaved
    assert not _verdict_points(COMMITTED / "validation.csv") <= {p for p in points if p[1] != "ref-offload"}
    assert not _interleaved(sorted(runs, key=lambda r: (r[2], r[1])))


@pytest.mark.parametrize("hw,minutes", [("cpu-scale-amd-epyc-2c", 6), ("cpu-scale-intel-xeon-2c", 7)])
def test_the_sample_fits_its_budget_as_estimated_from_the_committed_records(hw: str, minutes: int) -> None:
    estimate = sample_seconds(hw)
    assert estimate <= SAMPLE_BUDGET_S and round(estimate / 60) == minutes
    doc = " ".join(_project().__doc__.split())
    assert re.search(rf"≈{minutes} min on the {'AMD EPYC' if 'amd' in hw else 'Intel Xeon'} VM", doc)
    assert sample_seconds(hw, repeats=3) > SAMPLE_BUDGET_S  # control: the check can fail (three repeats do not fit)


def _fake_runner(interrupt_after: int | None = None, fail: str | None = None):
    """Stands in for the harness runner: the committed record of that run, instantly; raises KeyboardInterrupt
    (Ctrl-C) on run `interrupt_after` + 1, or marks engine `fail`'s runs failed."""
    calls = []

    def run(spec, path: Path) -> RunRecord:
        if interrupt_after is not None and len(calls) == interrupt_after:
            raise KeyboardInterrupt
        calls.append(spec.engine)
        src = COMMITTED / "validation" / f"seq{spec.workload['seq_len']}" / f"{spec.engine}-r0.json"
        record = RunRecord.read(src)
        record.status = "failed" if spec.engine == fail else record.status
        path.parent.mkdir(parents=True, exist_ok=True)
        record.write(path)
        return record
    return run


def _sample(root: Path, runner) -> bool:
    folder = root / "results" / "costmodel" / HW / SAMPLE
    return run_validation(folder, SAMPLE_ENGINES, SAMPLE_REPEATS, VERDICT_SEQS, max_wait_s=0, replace=True,
                          run=runner)


def test_an_interrupted_sample_leaves_nothing_the_validation_reads(tmp_path: Path) -> None:
    _results(tmp_path, datetime.now(timezone.utc), None)
    with pytest.raises(KeyboardInterrupt):
        _sample(tmp_path, _fake_runner(interrupt_after=7))
    assert record_sets(HW, tmp_path, "sample") == {}
    stage = tmp_path / "results" / "costmodel" / HW / f"{SAMPLE}.partial"
    assert len(list(stage.glob("seq*/*.json"))) == 7 and "7 of 25" in (stage / "PARTIAL").read_text()
    # control: the same runner, uninterrupted, publishes the whole sample, and the validation reads all of it
    assert _sample(tmp_path, _fake_runner()) is True and not stage.exists()
    assert sorted(record_sets(HW, tmp_path, "sample")) == list(VERDICT_SEQS)
    cal = json.loads((tmp_path / "results" / "costmodel" / HW / "calibration.json").read_text())
    rows = validation(cal, HW, tmp_path, "sample")
    assert len(rows) == 25 and all(r["runs"] == 1 for r in rows)
    when = validation_dating(cal, HW, tmp_path, "sample")  # every record stamped when it ran: no git needed
    assert when["over_bound"] is False and when["dated_by_git"] is False and when["runs"] == "sample"


def test_an_interrupted_or_failed_sample_keeps_the_last_complete_one(tmp_path: Path) -> None:
    _results(tmp_path, T0, None)
    assert _sample(tmp_path, _fake_runner())
    folder = tmp_path / "results" / "costmodel" / HW / SAMPLE
    before = {p: p.read_bytes() for p in folder.glob("seq*/*.json")}
    with pytest.raises(KeyboardInterrupt):
        _sample(tmp_path, _fake_runner(interrupt_after=20))
    assert {p: p.read_bytes() for p in folder.glob("seq*/*.json")} == before
    assert _sample(tmp_path, _fake_runner(fail="ds-zenflow")) is False
    assert {p: p.read_bytes() for p in folder.glob("seq*/*.json")} == before
    assert _sample(tmp_path, _fake_runner())  # control: a complete sample does replace it
    assert {p: p.read_bytes() for p in folder.glob("seq*/*.json")} != before


def test_make_project_validates_against_the_sample_it_took(project, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The default flow on a fake runner (the committed calibration, stamped now: --no-calibrate): the sample of
    the docstring is taken, published, and the table is made from it alone; interrupted, nothing is validated."""
    out = _results(tmp_path, datetime.now(timezone.utc), None)
    taken = []

    def sample(folder, engines, repeats, seqs, replace=False, interrupt_after=None):
        taken.append((folder.name, tuple(engines), repeats, seqs, replace))
        return run_validation(folder, engines, repeats, seqs, max_wait_s=0, replace=replace,
                              run=_fake_runner(interrupt_after))
    monkeypatch.setattr(project, "run_validation", lambda *a, **k: sample(*a, **k, interrupt_after=3))
    assert project.main(["--no-calibrate"]) == 130 and not (out / "validation.md").exists()
    monkeypatch.setattr(project, "run_validation", sample)
    assert project.main(["--no-calibrate"]) == 0
    assert taken[-1] == (SAMPLE, SAMPLE_ENGINES, SAMPLE_REPEATS, VERDICT_SEQS, True)
    saved = json.loads((out / "validation.json").read_text())
    assert saved["runs"] == "sample" and not saved["over_bound"] and not saved["dated_by_git"]
    text = (out / "validation.md").read_text()
    assert text.startswith("# Cost model validation") and "the same-day sample" in text
    with open(out / "validation.csv") as f:
        assert {(int(r["seq"]), r["engine"]) for r in csv.DictReader(f)} == set(
            (seq, engine) for _, seq, engine in plan(SAMPLE_ENGINES, SAMPLE_REPEATS, VERDICT_SEQS))
