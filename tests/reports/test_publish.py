"""What a GPU window's scenario folder publishes (zenflow/reports/publish.py, `_scenario`): records of runs that
ended (ok, skipped, failed), not those interrupted mid-way, and of a name present twice the staged (.partial/) one,
the newer. The table itself is scenario_report's (tested there): here it only receives the kept records."""

from __future__ import annotations

from zenflow.harness.records import RunRecord
from zenflow.harness.result_sets import PARTIAL
from zenflow.reports import publish


def scenario_folder(root):
    """An ok record; an interrupted one staged; one name twice: 'skipped' in the folder, 'ok' staged (newer)."""
    folder = root / "llama2-7b-4L"
    (folder / PARTIAL).mkdir(parents=True)
    RunRecord(engine="ref-offload", status="ok").write(folder / "ref-offload-r0.json")
    RunRecord(engine="ref-zenflow", status="failed", error=f"{publish.INTERRUPTED}: SIGTERM").write(
        folder / PARTIAL / "ref-zenflow-r0.json")
    RunRecord(engine="ds-offload", status="skipped", error="out of time").write(folder / "ds-offload-r0.json")
    RunRecord(engine="ds-offload", status="ok").write(folder / PARTIAL / "ds-offload-r0.json")
    return folder


def published(tmp_path, monkeypatch):
    made = []
    monkeypatch.setattr(publish, "scenario_report", lambda records, dest, labels: made.extend(records))
    line = publish._scenario(scenario_folder(tmp_path), tmp_path / "dest", {})  # noqa: SLF001
    files = {p.name: RunRecord.read(p) for p in (tmp_path / "dest").glob("*.json")}
    return line, files, made


def test_interrupted_records_are_left_out_of_what_is_published(tmp_path, monkeypatch):
    """publish.py: "Records of runs that were interrupted mid-way are left out"; ok, skipped and failed are kept."""
    line, files, made = published(tmp_path, monkeypatch)
    assert set(files) == {"ref-offload-r0.json", "ds-offload-r0.json"}
    assert sorted(r.engine for r in made) == ["ds-offload", "ref-offload"]
    assert "of 2 records" in line


def test_a_staged_record_wins_over_the_folders_record_of_the_same_name(tmp_path, monkeypatch):
    """A record staged in .partial/ is the newer one of its name: the folder's older 'skipped' one is not published."""
    _, files, made = published(tmp_path, monkeypatch)
    assert files["ds-offload-r0.json"].status == "ok"
    assert [r.status for r in made if r.engine == "ds-offload"] == ["ok"]
