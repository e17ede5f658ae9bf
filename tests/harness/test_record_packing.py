"""Run records with many steps store them packed (zenflow/harness/records.py): read back exactly,
every other field readable JSON, a few steps left as they are, and the tree that travels to a GPU host under its
limit."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

from zenflow.harness.records import PACK_STEPS_AT, PACKED, RecordError, RunRecord, pack_folder, unpack_steps

ROOT = Path(__file__).resolve().parents[2]
TRAVEL_LIMIT_MIB = 40  # of the device tool's 64 MiB: room for the records of days to come
WHEELS_ALLOWANCE_MIB = 16  # the .whl/ set travels too (reproduce/gpu_wheels.py: LIMIT_BYTES)


def _steps(n: int) -> list[dict]:
    return [{"step": i, "kind": "update", "period_ms": 553.1458180048503 + i / 3, "loss": math.pi / (i + 1),
             "bytes": {"d2h_grads": 90731520}, "blocks_ms": None} for i in range(n)]


def test_many_steps_are_packed_and_read_back_exactly(tmp_path: Path):
    record = RunRecord(engine="ref-zenflow", steps=_steps(PACK_STEPS_AT), summary={"cycle_mean_ms": 1.0})
    record.write(tmp_path / "r.json")
    raw = json.loads((tmp_path / "r.json").read_text())
    assert raw["steps"]["packed"] == PACKED and raw["steps"]["count"] == PACK_STEPS_AT
    assert raw["summary"] == {"cycle_mean_ms": 1.0}  # the rest stays readable
    assert RunRecord.read(tmp_path / "r.json").steps == record.steps  # floats exactly
    assert (tmp_path / "r.json").stat().st_size < len(json.dumps(record.to_dict(), indent=1)) / 4


def test_a_few_steps_stay_as_they_are(tmp_path: Path):
    RunRecord(engine="ref-zenflow", steps=_steps(PACK_STEPS_AT - 1)).write(tmp_path / "r.json")
    assert isinstance(json.loads((tmp_path / "r.json").read_text())["steps"], list)


def test_packing_a_folder_keeps_every_other_field_and_packs_only_records(tmp_path: Path):
    record = RunRecord(engine="ref-zenflow", steps=_steps(100)).to_dict() | {"field_of_tomorrow": [1, 2]}
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "r.json").write_text(json.dumps(record, indent=1))
    (tmp_path / "other.json").write_text(json.dumps({"steps": list(range(100))}))  # not a run record
    assert pack_folder(tmp_path) == [tmp_path / "sub" / "r.json"] and pack_folder(tmp_path) == []  # once
    raw = json.loads((tmp_path / "sub" / "r.json").read_text())
    assert raw["field_of_tomorrow"] == [1, 2] and unpack_steps(raw["steps"]) == record["steps"]
    assert json.loads((tmp_path / "other.json").read_text())["steps"] == list(range(100))


def test_an_unknown_packing_is_refused_in_one_line():
    with pytest.raises(RecordError, match="steps packed as 'zstd': expected 'gzip\\+base64'"):
        unpack_steps({"packed": "zstd", "data": ""})


def test_the_tree_that_travels_to_a_gpu_host_stays_under_its_limit():
    """What the device tool copies: the tracked files (plus the wheel set's allowance). At 48 of 64 MiB (2026-11-28)
    a day of result commits from refusal; packed records brought it to about 34."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, timeout=60)
    if listed.returncode != 0:
        if os.environ.get("CI"):
            pytest.fail("CI must measure the tracked tree: git ls-files failed")
        pytest.skip("not a git checkout: no tracked files to measure")
    sizes = [os.path.getsize(ROOT / name) for name in listed.stdout.decode().split("\0") if name and
             (ROOT / name).is_file()]
    mib = sum(sizes) / 2**20 + WHEELS_ALLOWANCE_MIB
    assert mib <= TRAVEL_LIMIT_MIB, f"the tree that travels: {mib:.1f} MiB (tracked + wheels), limit {TRAVEL_LIMIT_MIB}"
