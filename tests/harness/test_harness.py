"""Harness: records are atomic and complete, failures become failed records, tables read records only."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from zenflow.harness import records as records_module
from zenflow.harness.configs import DEFAULT_ENGINES
from zenflow.harness.engines.registry import ENGINE_SPECS
from zenflow.harness.placement import DEVICE, HOST, phases_apart
from zenflow.harness.records import RecordError, RunRecord, describe, summarize_steps
from zenflow.harness.runner import RunSpec, run_in_subprocess
from zenflow.reports.scenario import engine_rank, engine_rows, runs_hardware_label, table
from zenflow.telemetry.timeline import StepTimeline

ROOT = Path(__file__).resolve().parents[2]
BLOCK = {"topk_ratio": 0.1, "update_interval": 2, "overlap_step": True}


def test_record_write_is_atomic_and_an_interrupted_write_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "run.json"
    RunRecord(engine="ref-zenflow", summary={"x": 1}).write(path)

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(records_module.json, "dump", crash)
    with pytest.raises(KeyboardInterrupt):
        RunRecord(engine="ref-zenflow", summary={"x": 2}).write(path)
    assert RunRecord.read(path).summary == {"x": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]  # no half-written temporary left behind


def test_reading_a_record_of_another_schema_version_fails_clearly(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"schema_version": 0, "engine": "x"}))
    with pytest.raises(RecordError, match="schema_version = 0, expected 1"):
        RunRecord.read(path)


def test_describe_gives_known_statistics():
    d = describe([1.0, 2.0, 3.0, 4.0, 5.0])
    assert d["median"] == 3.0 and d["mean"] == 3.0 and d["n"] == 5
    assert d["p90"] == pytest.approx(4.6) and d["iqr"] == pytest.approx(2.0)
    assert d["cv"] == pytest.approx((2.0 ** 0.5) / 3.0)
    assert describe([])["median"] is None


def test_summary_uses_whole_cycles_and_splits_accumulate_from_update_steps():
    kinds = ["warmup", "accumulate", "update"] * 1 + ["accumulate", "update"] * 2 + ["accumulate"]
    steps = [{"kind": k, "period_ms": 10.0 if k == "accumulate" else 30.0, "compute_ms": 5.0, "io_ms": 1.0,
              "stall_ms": 0.0, "bytes": {"d2h_grads": 100, "h2d_params": 50 if k == "update" else 0},
              "loss": float(i)} for i, k in enumerate(kinds)]
    s = summarize_steps(steps, cycle=2, model_bytes=100)
    assert s["cycles"] == 3  # the trailing lone accumulate step is not a whole cycle
    assert s["cycle_mean_ms"] == 20.0 and s["accumulate_step_ms"] == 10.0 and s["update_step_ms"] == 30.0
    assert s["grad_param_bytes_per_step_over_model_bytes"] == pytest.approx(1.25)
    assert s["final_loss"] == float(len(kinds) - 1)


def test_timeline_splits_blocking_sections_into_io_and_stall_and_counts_nested_copies_once():
    tl = StepTimeline()
    step = tl.start_step(0)
    for what in ("copy_d2h", "host_wait"):
        tl.on_block_start(what)
        tl.on_block_end(what)
    tl.on_block_start("reselect")
    tl.on_block_start("copy_h2d")
    tl.on_block_end("copy_h2d")
    tl.on_block_end("reselect")
    tl.on_transfer("d2h", "grads", 7)
    tl.finish()
    tl.on_transfer("h2d", "params", 5)  # after finish: a final drain is not attributed to the last step
    assert step.io_ms > 0 and step.stall_ms > 0
    assert step.bytes == {"d2h_grads": 7}
    assert step.compute_ms == pytest.approx(step.period_ms - step.io_ms - step.stall_ms)


@pytest.fixture
def tiny_spec(run_spec, tiny_workload):
    """This file's runs: BLOCK, weight decay 0.01, 2 warm-up and 4 timed steps unless given; `workload`: keys over
    the tiny workload."""
    def make(engine: str, workload: dict | None = None, **fields) -> RunSpec:
        return run_spec(engine, block=BLOCK, weight_decay=0.01, workload={**tiny_workload, **(workload or {})},
                        **{"warmup_steps": 2, "timed_steps": 4, **fields})

    return make


@pytest.mark.slow
def test_a_failing_run_leaves_a_complete_failed_record(tiny_spec, tmp_path):
    out = tmp_path / "bad.json"
    record = run_in_subprocess(tiny_spec("ref-zenflow", workload={"data": str(tmp_path / "missing.json")}), out)
    assert record.status == "failed" and "file not found" in record.error
    assert RunRecord.read(out).status == "failed"


@pytest.mark.slow
def test_a_killed_run_leaves_a_failed_record_and_no_process(tiny_spec, tmp_path):
    out = tmp_path / "slow.json"
    record = run_in_subprocess(tiny_spec("ref-zenflow", timed_steps=10_000), out, timeout_s=3)
    assert record.status == "failed" and "timeout" in record.error


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["ref-zenflow", "ref-offload", "ref-offload-gas", "no-offload"])
def test_a_run_record_holds_timings_bytes_environment_and_nvml_status(tiny_spec, tmp_path, engine):
    record = run_in_subprocess(tiny_spec(engine), tmp_path / f"{engine}.json")
    assert record.status == "ok", record.error
    timed = [s for s in record.steps if s["kind"] != "warmup"]
    assert len(timed) == 4 and all(s["period_ms"] > 0 for s in timed)
    # The GPU form on a GPU host: the hardware id names the GPUs, the run's device is CUDA.
    nvml_gpus = bool(record.environment["nvml"].get("available") and record.environment["nvml"].get("devices"))
    gpu_host = nvml_gpus or torch.cuda.is_available()
    assert record.environment["hardware_id"].startswith("cpu-scale") is not gpu_host
    assert record.protocol["device"].startswith("cuda" if torch.cuda.is_available() else "cpu")
    assert record.protocol["num_gpus"] == 1 and record.protocol["world_size"] == 1
    if nvml_gpus:
        assert record.nvml["available"] is True, record.nvml
    else:
        assert record.nvml["available"] is False and record.nvml["reason"]
    if engine == "ref-offload":
        assert record.summary["grad_param_bytes_per_step_over_model_bytes"] == pytest.approx(2.0)
    if engine in ("ref-zenflow", "ref-offload-gas"):  # the host part every 2 steps
        assert [s["kind"] for s in timed] == ["accumulate", "update"] * 2
    if engine == "ref-offload-gas":  # every gradient down and every parameter up, once per 2 steps
        assert record.summary["grad_param_bytes_per_step_over_model_bytes"] == pytest.approx(1.0)
    # the rest of the machine's CPU over the timed steps, from the kernel's counters
    load = record.protocol["machine_load"]
    assert load["measured"] is os.path.exists("/proc/stat")
    if load["measured"]:
        assert load["own_cpu_s"] > 0 and 0 <= load["outside_cpu_fraction"] <= 1 and load["window_s"] > 0
    facts = record.metrics.get("zenflow")  # what ZenFlow decided, logged: ZenFlow engines only
    assert (facts is not None) is (engine == "ref-zenflow")
    if facts:
        steps, every = len(record.steps), facts["select_interval"]
        assert every >= 1 and facts["update_interval"] == 2
        assert facts["selections"] == 1 + (steps - 1) // every
        assert facts["host_updates"] == steps // 2


@pytest.mark.deepspeed
def test_the_same_update_frequency_controls_agree_deepspeed_with_ours(tiny_spec, tmp_path):
    """ds-zero-offload-gas (DeepSpeed, gradient accumulation U) and ref-offload-gas (ours: gradients accumulated U
    steps, then one ZeRO-Offload step on their mean, clipped) are the same algorithm: the same losses on the same
    data. And it is not every-step ZeRO-Offload."""
    def run(engine: str) -> list[float]:
        spec = tiny_spec(engine, lr=1e-2, warmup_steps=0, timed_steps=8)
        record = run_in_subprocess(spec, tmp_path / f"{engine}.json")
        assert record.status == "ok", record.error
        assert spec.cycle == (2 if engine.endswith("-gas") else 1)
        return [s["loss"] for s in record.steps]

    ds, ours, every_step = run("ds-zero-offload-gas"), run("ref-offload-gas"), run("ds-zero-offload")
    assert ds == pytest.approx(ours, rel=1e-4)
    assert ds[-1] != pytest.approx(every_step[-1], rel=1e-4)


def test_table_computes_speedup_and_stall_reduction_from_records():
    def rec(engine, cycle, stall):
        return RunRecord(engine=engine, summary={"step_ms": {"median": cycle}, "cycle_mean_ms": cycle,
                                                 "stall_ms": stall, "compute_ms": cycle - stall, "io_ms": 0.0})
    rows = engine_rows([rec("ds-zero-offload", 400.0, 300.0), rec("ref-offload", 300.0, 200.0),
                        rec("ref-zenflow", 100.0, 10.0)])
    by = {r["engine"]: r for r in rows}
    assert by["ref-zenflow"]["speedup"] == pytest.approx(4.0)
    assert by["ref-zenflow"]["stall_reduction"] == pytest.approx(0.95)
    assert "4.00×" in table(rows) and "95.0%" in table(rows)


@pytest.mark.deepspeed
def test_reproduce_llama7b_smoke_runs_every_engine_and_writes_table_and_figure(tmp_path):
    sys.path.insert(0, str(ROOT / "reproduce"))
    import llama7b

    code = llama7b.main(["--smoke", "--repeats", "1", "--out", str(tmp_path)])
    assert code == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert {"table.md", "table.csv", "figure.png"} <= set(names)
    # every engine but the opt-in ones (ds-zenflow-intended), + the no-telemetry run
    assert len([n for n in names if n.endswith(".json")]) == len(DEFAULT_ENGINES) + 1
    text = (tmp_path / "table.md").read_text()
    for engine in DEFAULT_ENGINES:
        assert f"| {engine} " in text
    # Building an engine must not change the model's weights. DeepSpeed 0.19.8's ZenFlow stage 1/2 does
    # (divergence G: every weight re-viewed untransposed), and the record says so.
    changed = {}
    for path in tmp_path.glob("*.json"):
        record = RunRecord.read(path)
        why = ENGINE_SPECS[record.engine].unavailable("auto")  # CUDA-only peers here, an optional package missing
        if why is not None:  # listed, with why
            assert record.status == "skipped" and why in record.error
            assert f"| {record.engine} (not run here)" in text or f"| {record.engine} (not installed)" in text
            continue
        assert record.status == "ok", (record.engine, record.error)
        changed[record.engine] = record.protocol["weights_changed_at_init"]
        assert bool(record.protocol["weights_changed_at_init"]) == any("changed the values" in w
                                                                      for w in record.warnings)
    assert changed.pop("ds-zenflow") > 0
    assert set(changed.values()) == {0}
    # shared (the default): a sync engine's host phase and its device phase were not apart (the split's control)
    offload = RunRecord.read(tmp_path / "ref-offload-r0.json")
    assert offload.protocol["placement"] == "shared" and offload.protocol["cores"]["phases"][HOST]["phases"] > 0
    assert not phases_apart(offload.protocol["cores"])
    assert "placement shared" in text.splitlines()[0]
    # Both ZenFlow engines: finite losses after U + 1 steps (DeepSpeed issue #7759) and what they decided, logged
    # (DeepSpeed's default never re-selects, PR #8456)
    for engine in ("ref-zenflow", "ds-zenflow"):
        record = RunRecord.read(tmp_path / f"{engine}-r0.json")
        interval = record.config["zero_optimization"]["zenflow"]["update_interval"]
        assert len(record.steps) >= interval + 1
        assert all(math.isfinite(s["loss"]) for s in record.steps[:interval + 1]), (engine, record.steps)
        facts = record.metrics["zenflow"]
        assert facts["selections"] >= 1 and facts["host_updates"] >= 1, (engine, facts)
        assert facts["select_interval"] is not None and facts["update_interval"] == interval


# the engines whose training thread has host phases in a smoke run (DeepSpeed's ZenFlow runs its own in a process)
HOST_PHASE_ENGINES = ("ref-offload", "ref-offload-gas", "ref-zenflow", "ref-zenflow-da", "ref-offload-overlap",
                      "ds-zero-offload", "ds-zero-offload-gas")


@pytest.mark.deepspeed
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a split needs two cores; this runner has one")
def test_reproduce_llama7b_smoke_split_placement_runs_each_phase_on_its_own_cores(tmp_path):
    """Issue 42: --placement split, every default engine: each phase on its side's cores (the thread's mask and the
    CPU it ran on, per phase, in the record), engines that cannot be placed say so in their row, the title says
    which placement; the shared smoke above is the control (its ref-offload phases were not apart)."""
    sys.path.insert(0, str(ROOT / "reproduce"))
    import llama7b

    code = llama7b.main(["--smoke", "--placement", "split", "--repeats", "1", "--no-overhead-check",
                         "--out", str(tmp_path)])
    assert code == 0
    text = (tmp_path / "table.md").read_text()
    assert "placement split (GPU analog)" in text.splitlines()[0]
    ran = set()
    for path in tmp_path.glob("*.json"):
        record = RunRecord.read(path)
        assert record.protocol["placement"] == "split", record.engine
        why = ENGINE_SPECS[record.engine].unavailable("auto", "split")
        if why is not None:  # not placeable, or not runnable here: listed, with why
            assert record.status == "skipped" and why in record.error
            continue
        assert record.status == "ok", (record.engine, record.error)
        cores = record.protocol["cores"]
        assert cores["placed_by"] and record.protocol["threads"] == len(cores["device"])
        for side in (DEVICE, HOST):  # every phase on its own side's cores
            assert all(mask == cores[side] for mask in cores["phases"][side]["masks"]), (record.engine, cores)
            assert set(cores["phases"][side]["ran_on"]) <= set(cores[side]), (record.engine, cores)
        ran.add(record.engine)
        if record.engine in HOST_PHASE_ENGINES:
            assert phases_apart(cores), (record.engine, cores)
    assert {"ref-offload", "ref-zenflow", "no-offload", "ds-zero-offload", "ds-zenflow"} <= ran
    zenflow = RunRecord.read(tmp_path / "ds-zenflow-r0.json").protocol["cores"]["notes"]
    assert any("optimizer process on the host cores" in note for note in zenflow)  # checked when it started


def test_a_report_names_the_hardware_of_its_runs_not_the_machine_remaking_it():
    def record(cpu_model: str | None) -> RunRecord:
        env = {"cpu": {"model": cpu_model, "allowed_cores": 2}} if cpu_model else {}
        return RunRecord(engine="ref-zenflow", label="t", status="ok", environment=env)

    here = {"cpu": {"model": "Machine Remaking The Report", "allowed_cores": 8}}
    assert runs_hardware_label([record(None), record("Intel(R) Xeon(R) Processor")], here) == \
        "cpu-scale: 2-core Intel Xeon Processor (no GPU), placement shared"
    assert runs_hardware_label([record(None)], here) == \
        "cpu-scale: 8-core Machine Remaking The Report (no GPU), placement shared"


def test_engines_sort_in_the_report_order_then_by_name():
    assert sorted(["zz", "no-offload", "ref-zenflow", "aa", "ds-zero-offload"], key=engine_rank) == \
        ["ds-zero-offload", "ref-zenflow", "no-offload", "aa", "zz"]
