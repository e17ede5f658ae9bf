"""no-offload-fp32, the comparable no-offload baseline: AdamW on the device from an fp32 master and fp32 moments.
In fp32 it is plain no-offload (torch's fused AdamW) to rounding; nothing crosses to the host."""

from __future__ import annotations

import pytest

from zenflow.harness.configs import DEEPSPEED_EXAMPLES_BLOCK, TINY_LLAMA_SHAPE
from zenflow.harness.runner import run_in_subprocess

pytestmark = pytest.mark.slow  # every test starts a run child (tests/README.md)


@pytest.fixture
def run(run_spec):
    """`run(engine, dtype, tmp_path)`: the record of a short run (DeepSpeedExamples' block) in a child process."""
    def make(engine: str, dtype: str, tmp_path) -> object:
        workload = {"model": "cpu-scale", "dtype": dtype, "seq_len": 16, "device": "cpu", "data": "synthetic",
                    **TINY_LLAMA_SHAPE}
        spec = run_spec(engine, block=DEEPSPEED_EXAMPLES_BLOCK, dtype=dtype, weight_decay=0.01, workload=workload,
                        label="fp32-bound", warmup_steps=2, timed_steps=6)
        record = run_in_subprocess(spec, tmp_path / f"{engine}-{dtype}.json")
        assert record.status == "ok", record.error
        return record

    return make


def test_fp32_master_baseline_equals_plain_adamw_in_fp32_and_moves_nothing(run, tmp_path):
    plain, master = run("no-offload", "fp32", tmp_path), run("no-offload-fp32", "fp32", tmp_path)
    assert [s["loss"] for s in master.steps] == pytest.approx([s["loss"] for s in plain.steps], rel=1e-5)
    moved = [(s["step"], kind) for s in master.steps for kind, n in (s["bytes"] or {}).items() if n]
    assert moved == [(0, "d2h_indices")]  # the one selection (every column) says so; no gradient or parameter moves
    assert master.metrics["host_state_bytes"] == 0


def test_in_bf16_the_two_baselines_are_different_runs(run, tmp_path):
    """Negative control of the comparison above: in bf16 the fp32 master changes the trajectory (no-offload's
    updates below half a bf16 ulp round away), so equality in fp32 is not a vacuous pass."""
    plain, master = run("no-offload", "bf16", tmp_path), run("no-offload-fp32", "bf16", tmp_path)
    assert [s["loss"] for s in master.steps] != [s["loss"] for s in plain.steps]
