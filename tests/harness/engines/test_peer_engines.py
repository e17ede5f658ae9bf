"""The peers a user would pick instead of ZenFlow (ZeRO-Infinity, Twin-Flow, FSDP2 CPUOffloadPolicy, torchao
CPUOffloadOptimizer): each runs through the harness's one run loop where it can, computes what its baseline computes
(the same losses on the same seed and data), and where it cannot run it is a "skipped" record with the reason, listed
in the table."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from zenflow.harness.configs import DEEPSPEED_EXAMPLES_BLOCK, ENGINES, TINY_LLAMA_SHAPE, TWIN_FLOW_SUB_GROUPS
from zenflow.harness.engines.build import deepspeed_config
from zenflow.harness.engines.registry import unavailable
from zenflow.harness.preflight import PreflightError, check_async_io
from zenflow.harness.records import RunRecord
from zenflow.harness.runner import run_in_subprocess
from zenflow.reports.scenario import engine_rows, regime_notes, table

ROOT = Path(__file__).resolve().parents[3]
TINY = {"model": "cpu-scale", "dtype": "fp32", "seq_len": 16, "micro_batch": 1, "data": "synthetic", "device": "cpu",
        **TINY_LLAMA_SHAPE}
LLAMA2_7B_PARAMETERS = 6_738_415_616


@pytest.fixture
def run(run_spec):
    """`run(engine, tmp_path, steps=6)`: the record of `steps` timed steps of `engine` on TINY (DeepSpeedExamples'
    block, lr 1e-3, weight decay 0.01, no warm-up), in a child process."""
    def make(engine: str, tmp_path: Path, steps: int = 6) -> RunRecord:
        spec = run_spec(engine, block=DEEPSPEED_EXAMPLES_BLOCK, weight_decay=0.01, workload=dict(TINY),
                        warmup_steps=0, timed_steps=steps)
        return run_in_subprocess(spec, tmp_path / f"{engine}.json", timeout_s=600)

    return make


def losses(record: RunRecord) -> list[float]:
    assert record.status == "ok", record.error
    assert record.protocol["weights_changed_at_init"] == 0  # trains from the weights it was given
    return [s["loss"] for s in record.steps]


@pytest.mark.deepspeed
def test_zero_infinity_and_twin_flow_train_as_zero_offload_does(run, tmp_path: Path) -> None:
    """ZeRO-3 with parameters and optimizer on the host, and with half the optimizer's groups there, are the same
    AdamW as ZeRO-2 offload: the same losses step for step (fp32). That they differ from no update at all is the
    loss falling."""
    offload = losses(run("ds-zero-offload", tmp_path))
    infinity = run("ds-zero-infinity", tmp_path)
    twin = run("ds-twin-flow", tmp_path)
    assert losses(infinity) == pytest.approx(offload, rel=1e-5)
    assert losses(twin) == pytest.approx(offload, rel=1e-5)
    assert offload[-1] < offload[0]
    zero = twin.config["zero_optimization"]  # the record holds the sub_group_size the engine resolved
    assert zero["stage"] == 3 and zero["offload_optimizer"]["ratio"] == 0.5
    assert zero["sub_group_size"] == math.ceil(twin.model["parameters"] / TWIN_FLOW_SUB_GROUPS)
    assert infinity.config["zero_optimization"]["offload_param"]["device"] == "cpu"


@pytest.mark.slow
def test_fsdp2_cpu_offload_trains_as_plain_adamw_does(run, tmp_path: Path) -> None:
    """FSDP2 with CPUOffloadPolicy (parameters, gradients and AdamW on the host, fp32 master) is torch AdamW on
    the same model: the same losses (through gloo on the CPU here)."""
    plain = losses(run("no-offload", tmp_path))
    fsdp2 = run("fsdp2-offload", tmp_path)
    assert losses(fsdp2) == pytest.approx(plain, rel=1e-5)
    assert fsdp2.protocol["stall_includes_io"] is True


@pytest.mark.slow
def test_overlapped_offload_trains_as_zero_offload_does(run, tmp_path: Path) -> None:
    """ref-offload-overlap (host AdamW per parameter during backward, clipping 1.0 as configured) is ZeRO-Offload's
    AdamW with nothing late: ref-offload's losses step for step (fp32). Negative
    control: ref-zenflow, whose deferred host updates make its losses differ. Bytes: every gradient down and every
    parameter up, each step."""
    offload = losses(run("ref-offload", tmp_path))
    overlap = run("ref-offload-overlap", tmp_path)
    assert losses(overlap) == pytest.approx(offload, rel=1e-5)
    ratio = overlap.summary["grad_param_bytes_per_step_over_model_bytes"]
    assert 2.0 < ratio < 2.01  # every parameter both ways, the few dense ones too (model bytes: the column params)
    assert losses(run("ref-zenflow", tmp_path)) != pytest.approx(offload, rel=1e-5)


def test_torchao_offload_is_not_run_on_the_cpu_and_the_table_says_why(run, tmp_path: Path) -> None:
    record = run("torchao-offload", tmp_path)
    assert record.status == "skipped" and "CUDA" in record.error and record.steps == []
    rows = engine_rows([record])
    assert rows[0]["note"] == "not run here"
    said = "\n".join(regime_notes(rows, [record]))
    assert "- Not run: torchao-offload: " in said and "CUDA" in said and "/bin/python" not in said
    assert "not run here" in table(rows)


def test_unavailable_names_the_missing_library_or_device(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    assert unavailable("fsdp2-offload", "cpu") is None and unavailable("ref-zenflow", "cpu") is None
    assert "CPU" in unavailable("torchao-offload", "cpu")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("deepspeed", "torchao")
                        else real(name, *a))
    assert unavailable("ds-twin-flow", "cpu") == "deepspeed not installed: ds-twin-flow needs it"
    assert "torchao not installed" in unavailable("torchao-offload", "cuda")


def test_zero_infinity_goes_to_nvme_only_where_async_io_builds(tmp_path: Path) -> None:
    cfg = deepspeed_config("ds-zero-infinity", DEEPSPEED_EXAMPLES_BLOCK, "bf16", 1, lr=2e-5, weight_decay=0.01,
                           clipping=1.0, cuda=True, nvme_path=str(tmp_path))
    zero = cfg["zero_optimization"]
    for part in ("offload_param", "offload_optimizer"):
        assert zero[part] == {"device": "nvme", "nvme_path": str(tmp_path), "pin_memory": True}
    with pytest.raises(PreflightError, match="--nvme-path.*libaio"):
        check_async_io(compatible=False)
    check_async_io(compatible=True)


@pytest.mark.parametrize("engine", [e for e in ENGINES if e.startswith("ds-")])
def test_committed_deepspeed_configs_are_what_the_harness_hands_deepspeed(engine: str) -> None:
    cfg = deepspeed_config(engine, DEEPSPEED_EXAMPLES_BLOCK, "bf16", 1, lr=2e-5, weight_decay=0.01, clipping=1.0,
                           cuda=True)
    if cfg["zero_optimization"].get("sub_group_size") == "auto":  # resolved for Llama-2-7B in the file
        cfg["zero_optimization"]["sub_group_size"] = math.ceil(LLAMA2_7B_PARAMETERS / TWIN_FLOW_SUB_GROUPS)
    assert json.loads((ROOT / "reproduce" / "configs" / f"{engine}.json").read_text()) == cfg
