"""The stepped engine child (zenflow/harness/stepper.py) that bench/test_train_step.py times."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from zenflow.harness.placement import phases_apart
from zenflow.harness.records import RunRecord
from zenflow.harness.runner import RunSpec
from zenflow.harness.stepper import SteppedEngine, StepperError

pytestmark = pytest.mark.slow  # every test starts a run child (tests/README.md)


@pytest.fixture
def spec(run_spec, tiny_workload):
    """This file's runs: topk 0.5, U 2, no clipping, 2 warm-up and 4 timed steps on one thread, synthetic data;
    `over`: keys over that workload."""
    def make(engine: str, **over) -> RunSpec:
        return run_spec(engine, block={"topk_ratio": 0.5, "update_interval": 2}, clipping=0.0,
                        workload={**tiny_workload, "data": "synthetic", **over}, warmup_steps=2, timed_steps=4,
                        threads=1)

    return make


def test_rounds_of_steps_end_in_a_complete_record(spec, tmp_path: Path) -> None:
    with SteppedEngine(spec("ref-zenflow"), tmp_path / "r.json") as child:
        for _ in range(3):
            child.steps(2)
        record = child.finish()
    assert record.status == "ok" and record.protocol["stepped"] and record.protocol["timed_steps"] == 4
    assert [s["kind"] for s in record.steps] == ["warmup", "warmup", "accumulate", "update", "accumulate", "update"]
    assert all(s["period_ms"] > 0 for s in record.steps) and record.summary["cycles"] == 2


def test_a_child_failure_carries_its_traceback_and_leaves_a_failed_record(spec, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    with pytest.raises(StepperError, match="dtype"):
        with SteppedEngine(spec("ref-offload", dtype="fp8"), out):
            pass
    record = RunRecord.read(out)
    assert record.status == "failed" and "WorkloadError" in record.error


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a split needs two cores")
@pytest.mark.parametrize("placement", ["split", "shared"])
def test_the_benchs_train_step_places_its_phases_as_asked(run_spec, tiny_workload, placement: str,
                                                          tmp_path: Path) -> None:
    """ZENFLOW_BENCH_PLACEMENT=split reaches the stepped child: ref-offload's host phase and its device phase ran on
    different cores; shared, the control, runs them on the same ones."""
    spec = run_spec("ref-offload", block={"topk_ratio": 0.0, "update_interval": 1},
                    workload={**tiny_workload, "data": "synthetic"}, warmup_steps=1, timed_steps=2,
                    placement=placement)
    with SteppedEngine(spec, tmp_path / "r.json") as child:
        child.steps(3)
        record = child.finish()
    assert record.status == "ok" and record.protocol["placement"] == placement
    assert phases_apart(record.protocol.get("cores") or {}) == (placement == "split")
