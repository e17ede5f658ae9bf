"""The stepped engine child (zenflow/harness/stepper.py) that bench/test_train_step.py times."""

from __future__ import annotations

from pathlib import Path

import pytest

from zenflow.harness.engines.build import deepspeed_config
from zenflow.harness.records import RunRecord
from zenflow.harness.runner import RunSpec
from zenflow.harness.stepper import SteppedEngine, StepperError

TINY = {"model": "cpu-scale", "dtype": "fp32", "seq_len": 8, "data": "synthetic", "hidden": 32, "layers": 1,
        "intermediate": 64, "heads": 2}


def spec(engine: str, workload: dict) -> RunSpec:
    cfg = deepspeed_config(engine, {"topk_ratio": 0.5, "update_interval": 2}, "fp32", 1, lr=1e-3, weight_decay=0.0,
                           clipping=0.0, cuda=False)
    return RunSpec(engine=engine, label="test", workload=workload, ds_config=cfg, warmup_steps=2, timed_steps=4,
                   threads=1, progress=False)


def test_rounds_of_steps_end_in_a_complete_record(tmp_path: Path) -> None:
    with SteppedEngine(spec("ref-zenflow", TINY), tmp_path / "r.json") as child:
        for _ in range(3):
            child.steps(2)
        record = child.finish()
    assert record.status == "ok" and record.protocol["stepped"] and record.protocol["timed_steps"] == 4
    assert [s["kind"] for s in record.steps] == ["warmup", "warmup", "accumulate", "update", "accumulate", "update"]
    assert all(s["period_ms"] > 0 for s in record.steps) and record.summary["cycles"] == 2


def test_a_child_failure_carries_its_traceback_and_leaves_a_failed_record(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    with pytest.raises(StepperError, match="dtype"):
        with SteppedEngine(spec("ref-offload", {**TINY, "dtype": "fp8"}), out):
            pass
    record = RunRecord.read(out)
    assert record.status == "failed" and "WorkloadError" in record.error
