"""Launching runs: no orphaned processes, multi-GPU labelling, a free launcher port and sharding, the engine's
device, preflight checks, and a DeepSpeed engine where DeepSpeed is absent (docs/history.md, "The first reading of
the CUDA path").
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import torch

from zenflow.harness import processes, runner, stepper
from zenflow.harness.engines.build import deepspeed_config, make_engine, resolve_device
from zenflow.harness.preflight import PreflightError, check_cuda_usable
from zenflow.harness.records import RunRecord
from zenflow.harness.runner import RunSpec, run_in_subprocess
from zenflow.harness.workloads import Workload, WorkloadError, batches, build_model
from zenflow.reports.scenario import MixedWorldSizeError, engine_rows, table
from zenflow.telemetry.timeline import StepTimeline

# A grandchild that writes "<its parent's pid> <its pid>" to argv[1] once it is set up (ignoring SIGTERM when
# argv[2] == "ignore"), and a child that starts it and then, like a hung run, sleeps.
GRANDCHILD = ("import os, signal, sys, time\n"
              "if sys.argv[2] == 'ignore': signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
              "open(sys.argv[1] + '.tmp', 'w').write(f'{os.getppid()} {os.getpid()}')\n"
              "os.replace(sys.argv[1] + '.tmp', sys.argv[1])\n"
              "time.sleep(600)\n")
CHILD = ("import os, subprocess, sys, time\n"
         f"subprocess.Popen([sys.executable, '-c', {GRANDCHILD!r}, sys.argv[1], sys.argv[2]])\n"
         "while not os.path.exists(sys.argv[1]): time.sleep(0.01)\n"
         "print('{\"ok\": true}', flush=True)  # a stepper child's 'ready' reply\n"
         "time.sleep(600)\n")


@pytest.fixture
def spec(run_spec):
    """This file's runs: run_spec's (the tiny workload, topk 0.1, U 2, lr 1e-3, clipping 1), 1 warm-up and 2 timed
    steps."""
    def make(engine: str = "ref-zenflow", **fields) -> RunSpec:
        return run_spec(engine, warmup_steps=1, timed_steps=2, **fields)

    return make


def alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped by whoever adopted it, counts as gone)."""
    try:
        os.kill(pid, 0)
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (ProcessLookupError, FileNotFoundError):
        return False
    return state != "Z"


def pids(pidfile: Path, wait_s: float = 30) -> tuple[int, int]:
    deadline = time.monotonic() + wait_s
    while not pidfile.exists():
        assert time.monotonic() < deadline, "the test child never started its grandchild"
        time.sleep(0.02)
    child, grandchild = map(int, pidfile.read_text().split())
    return child, grandchild


def assert_gone(*pid_list: int, wait_s: float = 5) -> None:
    deadline = time.monotonic() + wait_s  # an adopted zombie may take a moment to be reaped
    while any(alive(p) for p in pid_list) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in pid_list), [p for p in pid_list if alive(p)]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["terminate", "ignore"])
def test_stopping_a_group_stops_the_grandchildren_too_even_one_that_ignores_sigterm(tmp_path, mode):
    pidfile = tmp_path / "pids"
    proc = processes.start_group([sys.executable, "-c", CHILD, str(pidfile), mode])
    child, grandchild = pids(pidfile)
    assert child == proc.pid and alive(grandchild)
    processes.stop_group(proc, grace_s=1.0)  # "ignore": SIGTERM is not enough, SIGKILL after the grace period
    assert_gone(child, grandchild)


@pytest.mark.slow
def test_a_timed_out_run_leaves_no_process_behind(spec, tmp_path, monkeypatch):
    pidfile = tmp_path / "pids"
    monkeypatch.setattr(processes, "GRACE_S", 1.0)
    monkeypatch.setattr(runner, "_launcher", lambda s: [sys.executable, "-c", CHILD, str(pidfile), "ignore"])
    record = run_in_subprocess(spec(), tmp_path / "r.json", timeout_s=4)
    assert record.status == "failed" and "timeout" in record.error
    assert_gone(*pids(pidfile, wait_s=0))


@pytest.mark.slow
def test_closing_a_stepped_engine_leaves_no_process_behind(spec, tmp_path, monkeypatch):
    pidfile = tmp_path / "pids"
    monkeypatch.setattr(processes, "GRACE_S", 1.0)

    def fake_start(cmd, **kw):  # the stepper's own pipes and flags, a child that starts a grandchild
        return processes.start_group([sys.executable, "-c", CHILD, str(pidfile), "terminate"], **kw)

    monkeypatch.setattr(stepper, "start_group", fake_start)
    with stepper.SteppedEngine(spec(), tmp_path / "r.json"):
        child, grandchild = pids(pidfile)
        assert alive(child) and alive(grandchild)
    assert_gone(child, grandchild)
    assert RunRecord.read(tmp_path / "r.json").status == "failed"


def test_multi_gpu_deepspeed_runs_name_the_visible_gpus_and_a_free_port(spec, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    cmd = runner._launcher(spec("ds-zenflow", num_gpus=2))
    # The launcher drops CUDA_VISIBLE_DEVICES when --num_gpus is given: ranks must be named with --include.
    assert "--num_gpus" not in cmd and cmd[cmd.index("--include") + 1] == "localhost:4,5"
    assert 0 < int(cmd[cmd.index("--master_port") + 1]) < 65536
    assert cmd[-2:] == ["--module", "zenflow.harness.runner"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    cmd = runner._launcher(spec("ds-zenflow", num_gpus=2))
    assert cmd[cmd.index("--num_gpus") + 1] == "2" and "--include" not in cmd
    assert runner._launcher(spec("ds-zenflow")) == [sys.executable, "-m", "zenflow.harness.runner"]


@pytest.mark.deepspeed
@pytest.mark.skipif(torch.cuda.is_available(), reason="two ranks on DeepSpeed's CPU accelerator (LOCAL_SIZE=2)")
def test_a_two_rank_deepspeed_run_goes_through_the_launcher_and_records_its_world_size(spec, tmp_path, monkeypatch):
    monkeypatch.setenv("LOCAL_SIZE", "2")  # the CPU accelerator's device count
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # the ranks are named with --include localhost:0,1
    s = spec("ds-zero-offload", num_gpus=2)
    s.workload["data"] = "synthetic"
    record = run_in_subprocess(s, tmp_path / "r.json", timeout_s=600)
    assert record.status == "ok", record.error
    assert record.protocol["num_gpus"] == 2 and record.protocol["world_size"] == 2


@pytest.mark.parametrize("visible, match", [("0", "makes 1 visible"), ("GPU-1a2b,GPU-3c4d", "not UUIDs")])
def test_a_gpu_selection_the_launcher_cannot_express_fails_clearly(spec, monkeypatch, visible, match):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    with pytest.raises(ValueError, match=match):
        runner._launcher(spec("ds-zero-offload", num_gpus=2))


@pytest.mark.ranks
@pytest.mark.parametrize("engine", ["ref-zenflow", "no-offload"])
def test_a_two_rank_run_of_our_engines_trains_on_gloo_and_records_its_world_size(spec, tmp_path, engine):
    s = spec(engine, num_gpus=2)
    s.workload.update(data="synthetic", device="cpu")
    record = run_in_subprocess(s, tmp_path / "r.json", timeout_s=300)
    assert record.status == "ok", record.error
    assert record.protocol["world_size"] == 2
    assert record.protocol["threads"] == max(1, len(os.sched_getaffinity(0)) // 2)  # each rank its share of cores
    assert record.environment["cpu"]["allowed_cores"] == len(os.sched_getaffinity(0))  # the machine, not the share
    assert len(record.protocol["rank_cores"]) == record.protocol["threads"]
    if engine == "ref-zenflow":  # the ranks exchanged gradients and columns (our own counters)
        assert record.summary["bytes_per_step"]["net_grad_reduce"] > 0
        assert record.metrics["host_state_bytes"] > 0  # this rank's block of the host state


def test_reference_engines_run_their_ranks_under_torchrun(spec):
    cmd = runner._launcher(spec("ref-zenflow", num_gpus=2))
    assert cmd[1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m"]
    assert cmd[-1] == "zenflow.harness.runner"
    with pytest.raises(ValueError, match="int >= 1"):
        spec("ds-zenflow", num_gpus=0)


def _rec(engine: str, world_size: int | None, cycle: float = 100.0) -> RunRecord:
    protocol = {} if world_size is None else {"num_gpus": world_size, "world_size": world_size}
    return RunRecord(engine=engine, protocol=protocol,
                     summary={"step_ms": {"median": cycle}, "cycle_mean_ms": cycle, "stall_ms": 1.0})


def test_a_table_refuses_to_mix_world_sizes_and_names_engines_and_sizes():
    with pytest.raises(MixedWorldSizeError) as err:
        engine_rows([_rec("ds-zenflow", 4), _rec("ref-zenflow", 1), _rec("no-offload", None)])
    assert "world size 1: ref-zenflow, no-offload" in str(err.value) and "world size 4: ds-zenflow" in str(err.value)
    rows = engine_rows([_rec("ds-zero-offload", 4), _rec("ds-zenflow", 4, cycle=50.0)])
    assert [r["world_size"] for r in rows] == [4, 4] and rows[1]["speedup"] == pytest.approx(2.0)


def test_a_deepspeed_engine_without_deepspeed_is_a_not_installed_row_not_a_failure(spec, tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed"
                        else real(name, *a))
    record = run_in_subprocess(spec("ds-zenflow"), tmp_path / "ds.json")
    assert record.status == "skipped" and "deepspeed not installed" in record.error
    assert RunRecord.read(tmp_path / "ds.json").status == "skipped"
    rows = engine_rows([record, _rec("ds-zero-offload", 1, cycle=200.0)])
    by = {r["engine"]: r for r in rows}
    assert by["ds-zenflow"]["note"] == "not installed" and by["ds-zenflow"]["speedup"] is None
    assert "| ds-zenflow (not installed)" in table(rows) and by["ds-zero-offload"]["speedup"] == 1.0


class _CountingTokenizer:
    """Text "i" -> token i: the first token of a batch tells where in the stream it starts."""

    eos_id = -1

    @staticmethod
    def encode(text: str) -> list[int]:
        return [int(text)]


def _first_pass(rank: int | None, world: int | None, n: int) -> list[tuple[int, ...]]:
    w = Workload(seq_len=2, micro_batch=1, data="synthetic")
    data = batches(w, _CountingTokenizer(), [str(i) for i in range(40)], rank=rank, world_size=world)
    return [tuple(next(data).view(-1).tolist()) for _ in range(n)]


def test_ranks_train_on_disjoint_batches_that_together_cover_the_single_process_stream(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    single = _first_pass(None, None, 40)  # 80 tokens, 40 batches of 2: one pass
    assert single == _first_pass(0, 1, 40) and len(set(single)) == 40
    monkeypatch.setenv("WORLD_SIZE", "2")  # what the DeepSpeed launcher sets for each rank
    by_rank = []
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        by_rank.append(_first_pass(None, None, 20))
    assert not set(by_rank[0]) & set(by_rank[1])
    assert set(by_rank[0]) | set(by_rank[1]) == set(single)
    with pytest.raises(WorkloadError, match="rank"):
        _first_pass(2, 2, 1)


def test_the_engine_trains_on_the_workloads_device_not_on_whatever_is_available(tiny_workload):
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(WorkloadError, match="device"):
        Workload(device="tpu")
    w = Workload(**tiny_workload, device="cpu")
    cfg = deepspeed_config("ref-zenflow", {"topk_ratio": 0.1}, "fp32", 1, lr=1e-3, weight_decay=0.0, clipping=1.0,
                           cuda=False)
    engine = make_engine("ref-zenflow", build_model(w), cfg, StepTimeline(), device=w.device)
    try:
        assert engine.device == torch.device("cpu")
        assert {p.device.type for p in engine.model.parameters()} == {"cpu"}
    finally:
        engine.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal of 'cuda' where CUDA is not usable")
def test_asking_for_cuda_without_cuda_fails_clearly():
    with pytest.raises(ValueError, match="torch.cuda.is_available"):
        resolve_device("cuda")


def test_preflight_fails_fast_when_nvml_sees_gpus_that_torch_cannot_use():
    nvml = {"available": True, "driver": "550.54.15", "devices": [{"name": "NVIDIA H100 80GB HBM3"}] * 2}
    with pytest.raises(PreflightError) as err:
        check_cuda_usable(nvml, cuda_available=False)
    assert "550.54.15" in str(err.value) and f"CUDA {torch.version.cuda}" in str(err.value)
    assert "2 GPU(s)" in str(err.value) and torch.__version__ in str(err.value)
    check_cuda_usable(nvml, cuda_available=True)
    check_cuda_usable({"available": False, "reason": "NVML Shared Library Not Found"}, cuda_available=False)
