"""The step-time trace (reports/step_trace.py): step-trace.csv's numbers on records whose answers
are worked out by hand, and what step-trace.png draws (read back from the figure's artists, no pixel parsing)."""

from __future__ import annotations

import csv
import struct
from pathlib import Path

import pytest

from zenflow.harness.records import RunRecord
from zenflow.reports import step_trace as st

WARMUP, CYCLES, U = 2, 2, 4


def run(engine: str, accumulate_ms: float, update_ms: float, repeat: int = 0, overlap: bool | None = True,
        every_step: bool = False) -> RunRecord:
    """WARMUP warm-up steps, then CYCLES update cycles of U steps (U − 1 accumulate, 1 update; every step an update
    for an offload engine), each kind at its period."""
    kinds = ["warmup"] * WARMUP + (["update"] * U if every_step else ["accumulate"] * (U - 1) + ["update"]) * CYCLES
    ms = {"warmup": 1000.0, "accumulate": accumulate_ms, "update": update_ms}
    config = {"zero_optimization": {"zenflow": {"overlap_step": overlap}}} if overlap is not None else {}
    return RunRecord(engine=engine, protocol={"telemetry": True, "repeat": repeat}, config=config,
                     steps=[{"step": i, "kind": k, "period_ms": ms[k]} for i, k in enumerate(kinds)])


def offload(engine: str, ms: float, repeat: int = 0) -> RunRecord:
    return run(engine, ms, ms, repeat, overlap=None, every_step=True)


def rows_by_engine(records: list[RunRecord]) -> dict[str, dict]:
    return {(r["engine"], r["mode"]): r for r in st.trace_rows(records)}


def test_accumulate_100_update_300_offload_500_is_3x_with_half_the_update_hidden() -> None:
    """1 − (300 − 100) / (500 − 100) = 0.5: the update step costs half of ZeRO-Offload's extra time."""
    records = [run("ref-zenflow", 100.0, 300.0, rep) for rep in range(3)]
    records += [offload("ref-offload", 500.0, rep) for rep in range(3)]
    row = rows_by_engine(records)[("ref-zenflow", "overlap")]
    assert (row["accumulate_ms"], row["update_ms"], row["offload_engine"], row["offload_ms"]) == (
        100.0, 300.0, "ref-offload", 500.0)
    assert row["update_over_accumulate"] == pytest.approx(3.0)
    assert row["hidden_share"] == pytest.approx(0.5)
    assert (row["runs"], row["paired_runs"], row["source"]) == (3, 3, "records")


def test_the_hidden_share_pairs_each_repeat_with_its_own_offload_run() -> None:
    """Repeat 0: offload 500, share 0.5; repeat 1: offload 300, share 1 − 200/200 = 0. Paired: the mean, 0.25;
    from the medians (offload 400) it would be 1 − 200/300 = 0.33."""
    records = [run("ref-zenflow", 100.0, 300.0, 0), run("ref-zenflow", 100.0, 300.0, 1),
               offload("ref-offload", 500.0, 0), offload("ref-offload", 300.0, 1)]
    row = rows_by_engine(records)[("ref-zenflow", "overlap")]
    assert row["hidden_share"] == pytest.approx(0.25)
    assert row["hidden_share_low"] < 0.25 < row["hidden_share_high"]  # two runs: a t interval (12.7 × the SEM)
    assert row["paired_runs"] == 2


def test_ds_zenflow_is_measured_against_ds_zero_offload_and_sync_runs_get_their_own_row() -> None:
    records = [run("ds-zenflow", 200.0, 400.0), offload("ds-zero-offload", 1000.0), offload("ref-offload", 10.0),
               run("ref-zenflow", 100.0, 200.0, overlap=False)]
    rows = rows_by_engine(records)
    assert rows[("ds-zenflow", "overlap")]["offload_engine"] == "ds-zero-offload"
    assert rows[("ds-zenflow", "overlap")]["hidden_share"] == pytest.approx(1 - 200 / 800)
    sync = rows[("ref-zenflow", "sync")]
    assert sync["offload_ms"] == 10.0 and sync["hidden_share"] is None  # offload ≤ accumulate: no share
    assert ("ref-zenflow", "overlap") not in rows


def test_the_csv_has_the_stable_columns_and_the_readme_row_last(tmp_path: Path) -> None:
    records = [run("ref-zenflow", 100.0, 300.0), offload("ref-offload", 500.0)]
    st.step_trace_report(records, tmp_path, "test host")
    with open(tmp_path / st.CSV, newline="") as f:
        lines = list(csv.DictReader(f))
    assert tuple(lines[0]) == st.COLUMNS
    example = lines[-1]
    assert example["engine"] == st.EXAMPLE_ENGINE and example["source"] == st.EXAMPLE_SOURCE
    # the README: ~700 ms, 2–2.2 s (2.1), nearly 4 s
    assert float(example["update_over_accumulate"]) == pytest.approx(3.0)
    assert float(example["hidden_share"]) == pytest.approx(1 - 1400 / 3300)


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from the PNG header (IHDR), not from the pixels."""
    return struct.unpack(">II", path.read_bytes()[16:24])


def test_the_figure_marks_every_step_by_its_kind_and_names_the_absent_engines(tmp_path: Path) -> None:
    records = [run("ref-zenflow", 100.0, 300.0, rep) for rep in range(2)] + [offload("ref-offload", 500.0)]
    drawn = st.step_trace_report(records, tmp_path, "test host")
    panels = {p["name"]: p for p in drawn["panels"]}
    assert list(panels) == ["ref-offload", "ref-zenflow (overlap)"]
    assert panels["ref-zenflow (overlap)"]["kinds"] == [s["kind"] for s in records[0].steps]
    assert panels["ref-offload"]["kinds"] == ["warmup"] * WARMUP + ["update"] * U * CYCLES
    assert panels["ref-zenflow (overlap)"]["ms"][WARMUP:WARMUP + U] == [100.0, 100.0, 100.0, 300.0]
    for absent in ("ds-zero-offload", "ds-zenflow", "ref-zenflow-da"):
        assert absent in drawn["caption"] and not any(name.startswith(absent) for name in panels)
    assert "No ZenFlow sync runs" in drawn["caption"]
    assert drawn["size_px"][0] <= 1200 and png_size(tmp_path / st.PNG) == drawn["size_px"]


def test_at_most_max_steps_are_drawn(tmp_path: Path) -> None:
    records = [run("ref-zenflow", 100.0, 300.0), offload("ref-offload", 500.0)]
    drawn = st.step_trace_report(records, tmp_path, "test host", max_steps=5)
    assert all(p["steps"] == [1, 2, 3, 4, 5] for p in drawn["panels"])
    assert "the first 5 steps" in drawn["title"]


def test_the_title_says_the_day_the_records_were_taken(tmp_path: Path) -> None:
    records = [run("ref-zenflow", 100.0, 300.0), offload("ref-offload", 500.0)]
    records[0].protocol["taken_at"] = "2026-11-24T23:50:00+00:00"
    records[1].protocol["taken_at"] = "2026-11-25T00:10:00+00:00"
    assert "runs of 2026-11-24 to 2026-11-25" in st.step_trace_report(records, tmp_path, "test host")["title"]
    del records[1].protocol["taken_at"]  # no stamp, and tmp_path is no git checkout: git cannot date it either
    assert "runs of day unknown" in st.step_trace_report(records, tmp_path, "test host")["title"]


@pytest.mark.parametrize("bad", [0, -3, 2.5])
def test_a_bad_max_steps_is_refused_in_one_line_before_anything_is_written(tmp_path: Path, bad: object) -> None:
    with pytest.raises(ValueError, match=r"^max_steps = .* is not allowed: expected an integer ≥ 1") as info:
        st.step_trace_report([run("ref-zenflow", 100.0, 300.0)], tmp_path, "test host", max_steps=bad)
    assert "\n" not in str(info.value) and not any(tmp_path.iterdir())


def test_a_folder_without_the_trace_engines_gets_no_files(tmp_path: Path) -> None:
    assert st.step_trace_report([offload("no-offload", 50.0)], tmp_path, "test host") is None
    assert not any(tmp_path.iterdir())
