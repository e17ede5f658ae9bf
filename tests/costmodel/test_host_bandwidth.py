"""zenflow.costmodel.host_bandwidth: the record's arithmetic, its table and its CLI. Tiny buffers:
what the numbers are, not how fast (the bench and `python -m zenflow.costmodel.host_bandwidth` measure)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zenflow.costmodel import host_bandwidth as hb


def test_fractions_are_each_parts_rate_over_the_triad_and_the_inplace_stream() -> None:
    record = hb.measure({"tiny": 8192}, steps=1, bound_numel=8192)
    assert record["bound_gbps"] == record["stream_gbps"]["triad"]
    size = record["sizes"]["tiny"]
    assert set(size["part_gbps"]) == set(hb.PART_BYTES)
    for part, gbps in size["part_gbps"].items():
        assert gbps > 0
        assert size["fraction_of_bound"][part] == pytest.approx(gbps / record["bound_gbps"])
        assert size["fraction_of_inplace"][part] == pytest.approx(gbps / record["stream_gbps"]["inplace_add"])
    text = hb.table(record)
    assert text.count("\n") == 1 + len(hb.STREAM_BYTES) + len(hb.PART_BYTES)  # header, rule, one row each
    assert "the bound" in text


def test_goal_column_marks_below_and_above() -> None:
    """The verdict is the number's, not a constant: a part at 0.5 of the bound is below, at 0.9 meets."""
    parts = dict.fromkeys(hb.PART_BYTES, 1.0)
    record = {"bound_numel": 8192, "bound_gbps": 2.0, "stream_gbps": {"copy": 1.5, "triad": 2.0, "inplace_add": 3.0},
              "sizes": {"s": {"numel": 8192, "part_gbps": parts,
                              "fraction_of_bound": {**dict.fromkeys(parts, 0.5), "adamw": 0.9},
                              "fraction_of_inplace": dict.fromkeys(parts, 0.3)}}}
    rows = {line.split("|")[3].strip(): line for line in hb.table(record).splitlines()[2:]}
    assert "meets ≥ 0.8" in rows["adamw"] and "below 0.8" in rows["accumulate"]
    assert "0.8" not in rows["cast_upload"].split("|")[-2]  # no goal for the other parts


def test_elements_are_whole_rows() -> None:
    assert hb.elements(10_000) == 2 * 4096 and hb.elements(5000) == 4096 and hb.elements(4096) == 4096


def test_cli_writes_the_record_whole_and_refuses_bad_sizes(tmp_path: Path, capsys) -> None:
    out = tmp_path / "bw.json"
    assert hb.main(["--numel", "8192", "--steps", "1", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["schema"] == hb.SCHEMA and [p.name for p in tmp_path.iterdir()] == [out.name]
    for argv, message in ((["--numel", "10"], "--numel: 10"), (["--steps", "0"], "--steps: 0")):
        with pytest.raises(SystemExit) as exc:
            hb.main(argv)
        assert exc.value.code == 2 and message in capsys.readouterr().err
