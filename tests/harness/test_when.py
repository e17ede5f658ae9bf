"""When runs were made (zenflow/harness/when.py): the one answer that figure titles, the claims page and the cost
model's validation age share. A record's `taken_at` decides; an older record is dated by git, between the day of the
commit it ran at and the day its record was committed."""

from __future__ import annotations

import os
import subprocess
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from zenflow.harness import when
from zenflow.harness.records import RunRecord
from zenflow.harness.session import Session


def record(taken_at: str | None = None, commit: str | None = None, status: str = "ok") -> RunRecord:
    r = RunRecord(engine="ref-zenflow", label="t", status=status, environment={"git": {"commit": commit}})
    if taken_at:
        r.protocol["taken_at"] = taken_at
    return r


def git(folder: Path, *args: str, day: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_DATE": f"{day}T12:00:00+00:00", "GIT_COMMITTER_DATE": f"{day}T12:00:00+00:00",
           "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", "-C", str(folder), *args], check=True, capture_output=True, text=True,
                          env=env).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    git(tmp_path, "init", "-q", day="2026-11-20")
    (tmp_path / "code.py").write_text("x = 1\n")
    git(tmp_path, "add", "code.py", day="2026-11-20")
    git(tmp_path, "commit", "-q", "-m", "code", day="2026-11-20")
    return tmp_path


def test_stamped_records_give_their_utc_days(tmp_path: Path) -> None:
    one = [record("2026-11-24T23:50:00+00:00"), record("2026-11-24T08:00:00+00:00")]
    assert when.runs_day(one, tmp_path) == "2026-11-24"
    two = [record("2026-11-24T23:50:00+00:00"), record("2026-11-25T01:10:00+02:00")]  # 23:10 UTC: the same day
    assert when.runs_day(two, tmp_path) == "2026-11-24"
    two[1].protocol["taken_at"] = "2026-11-25T00:10:00+00:00"
    assert when.runs_day(two, tmp_path) == "2026-11-24 to 2026-11-25"


def test_failed_runs_do_not_date_the_set(tmp_path: Path) -> None:
    records = [record("2026-11-24T10:00:00+00:00"), record("2026-11-29T10:00:00+00:00", status="failed")]
    assert when.runs_day(records, tmp_path) == "2026-11-24"


def test_an_unstamped_record_outside_git_has_no_day(tmp_path: Path) -> None:
    records = [record("2026-11-24T10:00:00+00:00"), record(commit="0" * 40)]
    assert when.runs_day(records, tmp_path) == when.UNKNOWN
    assert when.runs_day([], tmp_path) == when.UNKNOWN


def test_an_unstamped_record_is_dated_from_its_commit_to_the_commit_of_its_record(repo: Path) -> None:
    ran_at = git(repo, "rev-parse", "HEAD", day="2026-11-20")
    folder = repo / "results"
    folder.mkdir()
    (folder / "run.json").write_text("{}")
    records = [record(commit=ran_at)]
    assert when.runs_day(records, folder) == "on or after 2026-11-20"  # its record not committed yet
    (folder / "table.md").write_text("remade later")
    git(repo, "add", "results/run.json", day="2026-11-22")
    git(repo, "commit", "-q", "-m", "runs", day="2026-11-22")
    git(repo, "add", "results/table.md", day="2026-11-26")
    git(repo, "commit", "-q", "-m", "a table remade", day="2026-11-26")
    assert when.runs_day(records, folder) == "2026-11-20 to 2026-11-22"  # the records' commit, not the table's
    assert when.commit_time(repo, ran_at).date().isoformat() == "2026-11-20"
    assert when.commit_time(repo, "f" * 40) is None


def test_a_subfolders_records_do_not_date_the_folder(repo: Path) -> None:
    """The folder's own records are committed on its last day, not the records of a subfolder (another
    set, e.g. deepspeed/) committed later."""
    ran_at = git(repo, "rev-parse", "HEAD", day="2026-11-20")
    folder = repo / "results"
    (folder / "deepspeed").mkdir(parents=True)
    (folder / "run.json").write_text("{}")
    git(repo, "add", "results/run.json", day="2026-11-22")
    git(repo, "commit", "-q", "-m", "runs", day="2026-11-22")
    (folder / "deepspeed" / "other.json").write_text("{}")
    git(repo, "add", "results/deepspeed/other.json", day="2026-11-26")
    git(repo, "commit", "-q", "-m", "another set's runs", day="2026-11-26")
    assert when.runs_day([record(commit=ran_at)], folder) == "2026-11-20 to 2026-11-22"


def test_a_span_is_unknown_when_any_part_is() -> None:
    t = when.taken(Path("x.json"), "2026-11-24T10:00:00+00:00", {}, {})
    assert t[0] == t[1] and t[0].day == 24
    assert when.span_of([t, (None, t[1])]) == (None, None)
    assert when.span_of([]) == (None, None)


def test_every_new_run_record_says_when_it_was_taken(run_spec, tiny_workload) -> None:
    """The session stamps the record when its run starts (protocol.taken_at), so no new record needs git."""
    spec = run_spec("no-offload", label="t", workload={**tiny_workload, "device": "cpu"}, warmup_steps=1,
                    timed_steps=1, telemetry=False, threads=1)
    before = datetime.now(timezone.utc)
    record = Session(spec).run()
    stamp = datetime.fromisoformat(record.protocol["taken_at"])
    assert record.status == "ok" and before - timedelta(seconds=1) <= stamp <= datetime.now(timezone.utc)
    assert when.runs_day([record], Path("/")) == f"{stamp:%Y-%m-%d}"


def test_a_record_rewritten_later_keeps_the_day_its_run_was_committed(repo: Path) -> None:
    """Packing a record's steps (records.py) rewrites its file in a later commit: git alone would date the run by
    that commit. stamp_committed writes the day of the last commit before the rewrite into the record, and that
    day dates it (the control: without the stamp, the rewrite's day)."""
    import json

    from zenflow.harness.records import packed

    ran_at = git(repo, "rev-parse", "HEAD", day="2026-11-20")
    (repo / "results").mkdir()
    r = record(commit=ran_at)
    r.steps = [{"step": i, "kind": "update", "period_ms": 1.0} for i in range(4)]
    r.write(repo / "results" / "run.json")
    git(repo, "add", "results/run.json", day="2026-11-22")
    git(repo, "commit", "-q", "-m", "runs", day="2026-11-22")
    (repo / "results" / "run.json").write_text(json.dumps(packed(r.to_dict() | {"steps": r.steps * 20}), indent=1))
    git(repo, "commit", "-qam", "records packed", day="2026-11-29")
    rewrite = git(repo, "rev-parse", "HEAD", day="2026-11-29")
    assert when.runs_day([r], repo / "results") == "2026-11-20 to 2026-11-29"  # the control: the rewrite's day
    assert when.stamp_committed(repo / "results", rewrite) == [repo / "results" / "run.json"]
    assert when.stamp_committed(repo / "results", rewrite) == []  # once
    assert RunRecord.read(repo / "results" / "run.json").protocol[when.RECORD_COMMITTED].startswith("2026-11-22")
    assert when.runs_day([r], repo / "results") == "2026-11-20 to 2026-11-22"
