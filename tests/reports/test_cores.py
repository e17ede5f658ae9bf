"""The host worker's share of the cores (reports/cores.py, llama7b --cores-ablation): the split each
engine makes of a host's cores, rows per (engine, fraction) with the speedup over the default paired by repeat, and
a real ablation run end to end at smoke size."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import psutil
import pytest

from zenflow.harness.records import RunRecord
from zenflow.reports.cores import DEFAULT, cores_report, cores_rows, planned_split

ROOT = Path(__file__).resolve().parents[2]


def run(engine: str, fraction: float | None, repeat: int, cycle_ms: float) -> RunRecord:
    block = {"topk_ratio": 0.1} | ({} if fraction is None else {"pt_reserved_cores_perc": fraction})
    return RunRecord(engine=engine, status="ok", config={"zero_optimization": {"zenflow": block}},
                     protocol={"telemetry": True, "repeat": repeat, "split": "1 + 1"},
                     summary={"cycle_mean_ms": cycle_ms, "stall_ms": cycle_ms / 10})


@pytest.mark.parametrize(("cores", "fraction", "ours", "deepspeeds"), [
    (16, 0.25, "4 + 12", "4 + 12"),
    (16, 0.75, "12 + 4", "12 + 4"),
    (16, 1.0, "shared (16)", "shared (16)"),
    (2, 0.75, "1 + 1", "shared (2)"),   # ours keeps a core for the worker; DeepSpeed's ceil takes both: shared
    (2, 0.25, "1 + 1", "1 + 1"),
    (2, 0.0, "1 + 1", "shared (2)"),    # ours keeps a core for compute; DeepSpeed's reserve of none: shared
])
def test_each_engine_splits_a_hosts_cores_by_its_own_rounding(monkeypatch, cores, fraction, ours, deepspeeds):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: cores)
    assert planned_split("ref-zenflow", fraction) == ours
    assert planned_split("ds-zenflow", fraction) == deepspeeds


def test_deepspeed_splits_physical_cores_only(monkeypatch):
    """16 logical cores, 8 physical: DeepSpeed binds the 8 (zenflow_utils) and splits those."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: 16 if logical else 8)
    assert planned_split("ds-zenflow", 0.5) == "4 + 4" and planned_split("ref-zenflow", 0.5) == "8 + 8"


def test_rows_pair_each_fraction_with_the_default_by_repeat():
    """At 0.25 every repeat is 20% slower than the same repeat at the default, though the repeats differ among
    themselves by far more: paired, the speedup is 1/1.2 with a narrow interval. The block without the field is the
    default. The negative control: at 1.0 the runs scatter around the default and the interval includes 1."""
    base = {0: 100.0, 1: 140.0, 2: 80.0}
    records = [run("ref-zenflow", None, rep, ms) for rep, ms in base.items()]
    records += [run("ref-zenflow", 0.25, rep, ms * 1.2 * (1 + 0.01 * rep)) for rep, ms in base.items()]
    records += [run("ref-zenflow", 1.0, rep, ms * f) for (rep, ms), f in zip(base.items(), (0.9, 1.1, 1.02))]
    rows = {r["fraction"]: r for r in cores_rows(records)}
    assert set(rows) == {0.25, DEFAULT, 1.0} and rows[DEFAULT]["speedup"] == pytest.approx(1.0)
    slow = rows[0.25]
    assert slow["speedup"] == pytest.approx(1 / 1.2, rel=0.02) and slow["speedup_high"] < 1.0
    assert rows[1.0]["speedup_low"] < 1.0 < rows[1.0]["speedup_high"]
    assert rows[0.25]["runs"] == 3 and rows[0.25]["split"] == "1 + 1"


def test_report_writes_table_csv_and_figure(tmp_path):
    records = [run("ref-zenflow", f, rep, 100.0 + rep + 10 * (f or 0)) for f in (None, 1.0) for rep in range(2)]
    text = cores_report(records, tmp_path, {"cpu": {"model": "Test CPU", "allowed_cores": 2}})
    assert "2-core Test CPU" in text
    assert "1.00× (default)" in text and "| ref-zenflow " in text
    assert {p.name for p in tmp_path.iterdir()} == {"cores.md", "cores.csv", "cores.png"}


@pytest.mark.script
def test_the_ablation_runs_end_to_end_at_smoke_size(tmp_path):
    """reproduce/llama7b.py --cores-ablation: every (repeat, fraction) of ref-zenflow is a record whose block holds
    its fraction and whose protocol names its split; the table has a row per fraction."""
    sys.path.insert(0, str(ROOT / "reproduce"))
    import llama7b

    code = llama7b.main(["--smoke", "--repeats", "2", "--cores-ablation", "0.5", "1.0", "--engines", "ref-zenflow",
                         "--out", str(tmp_path)])
    assert code == 0
    records = [RunRecord.read(p) for p in sorted(tmp_path.glob("*.json"))]
    assert sorted(p.name for p in tmp_path.glob("*.json")) == [
        f"ref-zenflow-cores{f}-r{rep}.json" for f in ("0.5", "1") for rep in (0, 1)]
    for record in records:
        fraction = record.config["zero_optimization"]["zenflow"]["pt_reserved_cores_perc"]
        assert record.status == "ok" and record.protocol["split"] == planned_split("ref-zenflow", fraction)
    text = (tmp_path / "cores.md").read_text()
    assert "| ref-zenflow | 0.5 " in text and "| ref-zenflow | 1 " in text
