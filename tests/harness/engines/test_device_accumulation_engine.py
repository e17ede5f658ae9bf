"""ref-zenflow-da, the engine of ZenFlowAdamW(accumulate_on="device"): through the harness it trains as
ref-zenflow does, step for step, and its counted bytes per step over model bytes are the formula of
docs/host-worker.md: the unselected columns' fp32 sum once per interval instead of their gradient every step.

    host accumulation:    b·P·(1 + 1/U) per step      device accumulation:    (4 + b)·P / U per step

(P: host-owned elements, b: the model dtype's bytes, U: the update interval.) Their ratio, (4 + b) / (b·(U + 1)),
does not depend on P, so the two records check each other without recounting the model's columns."""

from __future__ import annotations

import pytest

from zenflow.harness.runner import run_in_subprocess

pytestmark = pytest.mark.slow  # every test starts a run child (tests/README.md)

BLOCK = {"topk_ratio": 0.1, "update_interval": 4, "overlap_step": True, "full_warm_up_rounds": 0,
         "select_interval": 10**6}  # no reselection inside the timed window: only gradients and parameters move


def ratio(b: int, interval: int) -> float:
    return (4 + b) / (b * (interval + 1))


@pytest.fixture(scope="module")
def records(tmp_path_factory, run_spec):
    out = tmp_path_factory.mktemp("da")
    done = {}
    for dtype in ("fp32", "bf16"):
        for engine in ("ref-zenflow", "ref-zenflow-da"):
            spec = run_spec(engine, block=BLOCK, dtype=dtype, warmup_steps=4, timed_steps=8, telemetry=True,
                            threads=1)  # telemetry: the byte counters
            spec.workload.update(dtype=dtype, device="cpu")  # the tiny workload (a fresh copy) in this dtype
            done[engine, dtype] = run_in_subprocess(spec, out / f"{engine}-{dtype}.json")
            assert done[engine, dtype].status == "ok", done[engine, dtype].error
    return done


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_it_trains_as_ref_zenflow_does_step_for_step(records, dtype):
    losses = {e: [s["loss"] for s in records[e, dtype].steps] for e in ("ref-zenflow", "ref-zenflow-da")}  # warm-up too
    assert len(losses["ref-zenflow"]) == 12 and losses["ref-zenflow"] == losses["ref-zenflow-da"]


@pytest.mark.parametrize("dtype,b", [("fp32", 4), ("bf16", 2)])
def test_bytes_per_step_are_the_formula(records, dtype, b):
    key = "grad_param_bytes_per_step_over_model_bytes"
    host, device = (records[e, dtype].summary[key] for e in ("ref-zenflow", "ref-zenflow-da"))
    assert device == pytest.approx(ratio(b, 4) * host, rel=1e-9)
    assert device < host
    # Negative control: the formula at another interval (what shipping every other interval would count) does not
    # match, so the comparison can tell.
    assert device != pytest.approx(ratio(b, 2) * host, rel=1e-3)


def test_the_device_holds_the_accumulator_and_the_host_less(records):
    host, device = (records[e, "bf16"] for e in ("ref-zenflow", "ref-zenflow-da"))
    assert device.metrics["host_state_bytes"] < host.metrics["host_state_bytes"]
