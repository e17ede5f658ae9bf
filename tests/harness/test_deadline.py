"""The pieces of the one-command GPU window that need no window: the deadline's arithmetic and its skips
in a real plan, the archive's manifest and its checks, the commit of a tree copied without .git."""

from __future__ import annotations

import io
import json
import tarfile
import time
from pathlib import Path

import pytest

from zenflow.harness import plans
from zenflow.harness.deadline import OUT_OF_TIME, Deadline
from zenflow.harness.evidence import MANIFEST, EvidenceError, pack, unpack
from zenflow.harness.records import RunRecord, read_records
from zenflow.harness.session import RunSpec
from zenflow.reports.scenario import skipped_cell
from zenflow.telemetry import environment


def test_estimates_are_corrected_by_the_runs_done():
    d = Deadline(time.time() + 100, {"a": 10.0, "b": 20.0, "c": 40.0})
    assert d.expected("b") == 20.0 and d.refusal("b") is None  # nothing done yet: the plan's figure
    d.observe("a", 30.0)  # the host is 3x slower than the plan's rates
    assert d.correction() == pytest.approx(3.0) and d.expected("c") == pytest.approx(120.0)
    why = d.refusal("c")
    assert why.startswith(OUT_OF_TIME) and "~120 s" in why and "x 3.00" in why
    assert d.refusal("b") is None  # 60 s fits the ~100 left
    assert Deadline(time.time() + 5, {}).refusal("unknown") is None  # no estimate, no run done: 0 s, it fits
    past = Deadline(time.time() - 1, {})
    past.observe("x", 2.0)
    assert past.refusal("y").startswith(OUT_OF_TIME)  # the mean of the runs done, against no time left


def test_the_correction_is_total_measured_over_total_estimated_seconds():
    """The docstring's (measured seconds) / (estimated seconds) of the runs so far, not a mean of ratios
    (which weighs a 10 s run as much as a 100 s one)."""
    d = Deadline(time.time() + 1000, {"a": 10.0, "b": 100.0, "c": 200.0})
    d.observe("a", 30.0)
    d.observe("b", 100.0)
    assert d.correction() == pytest.approx((30 + 100) / (10 + 100))
    assert d.expected("c") == pytest.approx(200 * 130 / 110)


def fake_run(spec: RunSpec, out: Path, timeout_s: float = 0) -> RunRecord:
    time.sleep(0.3)
    record = RunRecord(engine=spec.engine, status="ok", steps=[{"kind": "update", "period_ms": 100.0}],
                       summary={"cycle_mean_ms": 100.0}, protocol={"telemetry": True})
    record.write(out)
    return record


def test_a_plan_under_a_deadline_runs_what_fits_and_skips_the_rest_out_of_time(tmp_path, monkeypatch):
    monkeypatch.setattr(plans, "run_in_subprocess", fake_run)
    spec = lambda e: RunSpec(engine=e, label="t", workload={}, ds_config={})  # noqa: E731
    plan = [plans.PlannedRun(f"{e}.json", spec(e), estimate_s=0.1) for e in ("ref-zenflow", "ref-offload", "x-3")]
    # each run takes 0.3 s where the plan said 0.1: after the first, the others are expected at 0.3 s
    code = plans.execute(tmp_path, plan, "cmd", lambda records, out: None, until=time.time() + 0.5)
    assert code == 0  # skipped is complete: the set moves into place
    records = {r.engine: r for r in read_records(tmp_path)}
    assert records["ref-zenflow"].status == "ok" and records["x-3"].status == "skipped"
    assert records["x-3"].error.startswith(OUT_OF_TIME) and skipped_cell(records["x-3"].error) == \
        "skipped: out of time"
    ok = records["ref-zenflow"].metrics
    assert ok["wall_seconds"] >= 0.3 and ok["fixed_seconds"] == pytest.approx(ok["wall_seconds"] - 0.1)
    # the control: the same plan without a deadline runs everything
    again = tmp_path / "again"
    plans.execute(again, plan, "cmd", lambda records, out: None)
    assert all(r.status == "ok" for r in read_records(again))


def test_the_archive_is_checked_against_its_manifest(tmp_path):
    work = tmp_path / "work"
    (work / "a" / ".partial").mkdir(parents=True)
    (work / "a" / ".partial" / "r.json").write_text("{}")
    (work / "b.txt").write_text("hello")
    (work / ".x.tmp").write_text("half-written")  # an atomic write in progress is not packed
    archive = tmp_path / "e.tar.gz"
    manifest = pack(work, archive, {"hardware_id": "gpu-x"})
    assert set(manifest["files"]) == {"work/a/.partial/r.json", "work/b.txt"}
    assert unpack(archive, tmp_path / "ok")["hardware_id"] == "gpu-x"
    assert (tmp_path / "ok" / "work" / "a" / ".partial" / "r.json").read_text() == "{}"
    # a member that differs from the manifest (a copy that went wrong), and one the manifest lists but is missing
    with tarfile.open(archive) as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    for name, data in (("work/b.txt", b"HELLO"), ("work/b.txt", None)):
        bad = tmp_path / f"bad{data is None}.tar.gz"
        with tarfile.open(bad, "w:gz") as tar:
            for member, content in {**members, name: data}.items():
                if content is not None:
                    info = tarfile.TarInfo(member)
                    info.size = len(content)
                    tar.addfile(info, io.BytesIO(content))
        with pytest.raises(EvidenceError, match="incomplete: 1 of 2 files"):
            unpack(bad, tmp_path / f"x{data is None}")
    no_manifest = tmp_path / "nm.tar.gz"
    with tarfile.open(no_manifest, "w:gz") as tar:
        tar.add(work / "b.txt", arcname="work/b.txt")
    with pytest.raises(EvidenceError, match=f"no {MANIFEST}"):
        unpack(no_manifest, tmp_path / "nm")


def rewritten(archive, out, members):
    """A copy of `archive` with `members` (name -> bytes) put in place of, or beside, its own."""
    with tarfile.open(archive) as tar:
        kept = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    with tarfile.open(out, "w:gz") as tar:
        for name, content in {**kept, **members}.items():
            info = tarfile.TarInfo(name)
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
    return out


def test_an_archive_whose_manifest_has_no_schema_is_refused(tmp_path):
    """A manifest that does not say it is a window's ('gpu-evidence/1') is not one: refused."""
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "b.txt").write_text("hello")
    archive = tmp_path / "e.tar.gz"
    manifest = pack(tmp_path / "work", archive, {})
    unpack(archive, tmp_path / "ok")  # the control: the same archive with its schema is accepted
    del manifest["schema"]
    bad = rewritten(archive, tmp_path / "bad.tar.gz", {MANIFEST: json.dumps(manifest).encode()})
    with pytest.raises(EvidenceError, match="schema None is not allowed: expected 'gpu-evidence/1'"):
        unpack(bad, tmp_path / "bad")


def test_an_archive_member_outside_the_destination_is_refused_and_not_written(tmp_path):
    """Unpack extracts with the 'data' filter: a member named ../x is refused before it is written."""
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "b.txt").write_text("hello")
    archive = tmp_path / "e.tar.gz"
    pack(tmp_path / "work", archive, {})
    hostile = rewritten(archive, tmp_path / "hostile.tar.gz", {"../escaped.txt": b"out"})
    (tmp_path / "into").mkdir()
    with pytest.raises(EvidenceError, match="not a readable gpu-evidence archive"):
        unpack(hostile, tmp_path / "into")
    assert not (tmp_path / "escaped.txt").exists()


def test_a_tree_copied_without_git_takes_its_commit_from_the_environment(tmp_path, monkeypatch):
    """The device copies the tree without .git; the records must still name the commit."""
    monkeypatch.delenv(environment.GIT_COMMIT_VAR, raising=False)
    assert environment._git(tmp_path)["commit"] is None  # noqa: SLF001  (the control: nothing to tell)
    monkeypatch.setenv(environment.GIT_COMMIT_VAR, "abc123")
    got = environment._git(tmp_path)  # noqa: SLF001
    assert got["commit"] == "abc123" and got["dirty"] is None and environment.GIT_COMMIT_VAR in got["error"]
