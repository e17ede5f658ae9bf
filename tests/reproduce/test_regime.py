"""The regime study (reproduce/regime.py, zenflow/reports/regime.py): ρ and the speedups read from the records as the
cost model defines them, one row per point, the point nearest the paper's ρ, no mixing of placements; and the script
end to end on the tiny model (every record split, each point's own tables, the figure)."""

from __future__ import annotations

import csv
import json
import os
import sys
from pathlib import Path

import pytest
from helpers import synthetic_calibration

from zenflow.costmodel.sensitivity import ideal_speedup
from zenflow.harness.placement import phases_apart
from zenflow.harness.records import RunRecord, read_records
from zenflow.reports.regime import by_point, measured_rho, nearest_point, point_row
from zenflow.reports.scenario import MixedPlacementError

ROOT = Path(__file__).resolve().parents[2]
BLOCK = {"zero_optimization": {"zenflow": {"update_interval": 4, "topk_ratio": 0.1}}}


def _rec(engine: str, tokens: int, rep: int, cycle: float, compute: float = 100.0, stall: float = 0.0,
         io: float = 0.0, placement: str = "split") -> RunRecord:
    return RunRecord(engine=engine, status="ok", config=BLOCK, workload={"seq_len": tokens, "micro_batch": 1},
                     protocol={"repeat": rep, "placement": placement},
                     summary={"step_ms": {"median": cycle}, "cycle_mean_ms": cycle, "compute_ms": compute,
                              "stall_ms": stall, "io_ms": io})


def _point(tokens: int, offload: list[float], zenflow: list[float]) -> list[RunRecord]:
    """ref-offload with 100 ms compute, 30 ms stall and 10 ms exposed copies (ρ = 0.4); ref-zenflow's cycles."""
    return ([_rec("ref-offload", tokens, r, c, stall=30.0, io=10.0) for r, c in enumerate(offload)]
            + [_rec("ref-zenflow", tokens, r, c, compute=c) for r, c in enumerate(zenflow)])


def test_rho_is_zero_offloads_host_stall_and_copies_over_its_compute_and_speedups_pair_by_round():
    row = point_row(8, _point(8, [140.0, 150.0, 130.0], [100.0, 100.0, 100.0]))
    assert row["tokens"] == 8 and row["rho"] == pytest.approx(0.4)
    # geometric mean of the paired ratios 1.4, 1.5, 1.3
    assert row["ref-zenflow/ref-offload"] == pytest.approx((1.4 * 1.5 * 1.3) ** (1 / 3))
    assert row["ref-zenflow/ref-offload_low"] < row["ref-zenflow/ref-offload"] < row["ref-zenflow/ref-offload_high"]
    assert row["ideal"] == pytest.approx(ideal_speedup(0.4, 4, 0.1)) == pytest.approx(1.4)
    assert row["ref-zenflow/ds-zero-offload"] is None  # not run: no cell, no guess
    assert measured_rho({"compute_ms": 0.0, "stall_ms": 1.0}) is None


def test_points_are_the_tokens_per_step_and_placements_never_mix():
    records = _point(2, [100.0], [50.0]) + _point(16, [300.0], [280.0])
    assert list(by_point(records)) == [2, 16]
    with pytest.raises(MixedPlacementError):
        point_row(2, _point(2, [100.0], [50.0]) + [_rec("ref-zenflow", 2, 1, 60.0, placement="shared")])


def test_the_analog_verdict_is_read_at_the_point_nearest_the_papers_rho():
    rows = [{"tokens": t, "rho": rho} for t, rho in ((2, 3.5), (8, 1.1), (32, 0.3))]
    paper = {"h100": {"rho_ranges": [[2.3, 3.2]]}}
    assert nearest_point(rows, paper)["tokens"] == 2
    assert nearest_point(rows, {"h100": {"rho_ranges": [[0.2, 0.5]]}})["tokens"] == 32
    assert nearest_point(rows, None) is None and nearest_point([], paper) is None


@pytest.mark.deepspeed
@pytest.mark.script
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a split needs two cores; this runner has one")
def test_reproduce_regime_smoke_runs_every_point_split_and_writes_its_tables(tmp_path):
    sys.path.insert(0, str(ROOT / "reproduce"))
    import regime

    code = regime.main(["--smoke", "--engines", "ref-offload", "ref-zenflow", "ds-zero-offload",
                        "--out", str(tmp_path)])
    assert code == 0
    records = read_records(tmp_path)
    assert len(records) == 2 * 3 and {r.status for r in records} == {"ok"}
    assert all(r.protocol["placement"] == "split" for r in records)
    assert phases_apart(next(r for r in records if r.engine == "ref-offload").protocol["cores"])
    text = (tmp_path / "regime.md").read_text()
    assert "placement split (GPU analog)" in text.splitlines()[0]
    with open(tmp_path / "regime.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["tokens"]) for r in rows] == list(regime.SMOKE_TOKENS)  # one row per point
    assert all(float(r["rho"]) > 0 and float(r["ref-zenflow/ref-offload"]) > 0 for r in rows)
    for tokens in regime.SMOKE_TOKENS:
        assert (tmp_path / f"tokens-{tokens}" / "table.md").is_file()
    assert (tmp_path / "regime.png").is_file()
    assert "Measured ρ from" in text
    assert "Cost model: not validated" in text  # --smoke takes no calibration: the table says so, it never guesses
    # with the day's calibration beside the runs, the report validates the model at every point and engine
    hardware_id = records[0].environment["hardware_id"]
    (tmp_path / "costmodel").mkdir()
    (tmp_path / "costmodel" / "calibration.json").write_text(json.dumps(synthetic_calibration(hardware_id)))
    assert regime.main(["--report-only", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "costmodel" / "validation.csv", newline="") as f:
        validated = {(int(r["seq"]), r["engine"]) for r in csv.DictReader(f)}
    assert validated == {(t, e) for t in regime.SMOKE_TOKENS for e in ("ref-offload", "ref-zenflow", "ds-zero-offload")}
    assert "points of our engines within 15%" in (tmp_path / "regime.md").read_text()
    assert (tmp_path / "costmodel" / "validation.png").is_file()
    assert [r.engine for r in read_records(tmp_path)] == [r.engine for r in records]  # no report file read as a run
    # C6 in the analog: the convergence runs at the point regime.csv marks (here: marked by hand, the first), split
    rows = [{**r, "analog_point": "False"} for r in rows]
    _write_rows(tmp_path / "regime.csv", rows)
    assert regime.main(["--convergence", "--smoke", "--out", str(tmp_path)]) == 2  # none marked: refused
    rows[0]["analog_point"] = "True"
    _write_rows(tmp_path / "regime.csv", rows)
    assert regime.main(["--convergence", "--smoke", "--engines", "ref-offload", "ref-zenflow",
                        "--out", str(tmp_path)]) == 0
    runs = read_records(tmp_path / "convergence")
    assert {r.engine for r in runs} == {"ref-offload", "ref-zenflow"} and {r.status for r in runs} == {"ok"}
    assert all(r.protocol["placement"] == "split" and r.workload["seq_len"] == int(rows[0]["tokens"]) for r in runs)
    assert (tmp_path / "convergence" / "convergence.csv").is_file()


def _write_rows(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
