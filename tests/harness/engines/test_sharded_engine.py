"""ref-zenflow-fsdp2, ZenFlowAdamW over FSDP2's row shards, through the harness: at one rank the shards are
the whole parameters, so it must train as ref-zenflow does, step for step, and count the same bytes; its record says
how many ranks shared the work. The two-rank equality with one process is tests/core/test_fsdp.py's."""

from __future__ import annotations

import pytest

from zenflow.harness.runner import run_in_subprocess

pytestmark = pytest.mark.slow  # every test starts a run child (tests/README.md)

BLOCK = {"topk_ratio": 0.1, "update_interval": 2, "overlap_step": True, "full_warm_up_rounds": 1, "select_interval": 4}


@pytest.fixture(scope="module")
def records(tmp_path_factory, run_spec):
    out = tmp_path_factory.mktemp("fsdp2")
    done = {}
    for engine in ("ref-zenflow", "ref-zenflow-fsdp2"):
        spec = run_spec(engine, block=BLOCK, dtype="fp32", warmup_steps=2, timed_steps=8, telemetry=True, threads=1)
        spec.workload.update(device="cpu")
        done[engine] = run_in_subprocess(spec, out / f"{engine}.json")
        assert done[engine].status == "ok", done[engine].error
    return done


def test_at_one_rank_it_trains_as_ref_zenflow_step_for_step(records):
    losses = {e: [s["loss"] for s in records[e].steps] for e in records}
    assert len(losses["ref-zenflow"]) == 10 and losses["ref-zenflow-fsdp2"] == losses["ref-zenflow"]


def test_it_counts_the_same_link_bytes_and_host_state(records):
    key = "grad_param_bytes_per_step_over_model_bytes"
    assert records["ref-zenflow-fsdp2"].summary[key] == records["ref-zenflow"].summary[key] > 0
    held = {e: records[e].metrics["host_state_bytes"] for e in records}
    assert held["ref-zenflow-fsdp2"] == held["ref-zenflow"] > 0
