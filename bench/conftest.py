"""bench/ session setup: machine info that names the hardware, storage kept per hardware id, raw timings saved.

- `pytest_benchmark_update_machine_info` adds what decides a step time: CPU model and cores, GPU name and count,
  driver, PCIe generation/width (the link's maximum: an idle link downshifts), torch/CUDA/DeepSpeed versions, git
  commit, and `hardware_id` (zenflow/telemetry/environment.py), which the compare command checks; plus the load
  average at the start and end of the session (other work on a shared machine).
- Storage: `--benchmark-storage` defaults to `.benchmarks/<hardware_id>` (unless given), so runs of an H100 and of an
  A100 never land in, or get compared from, the same folder.
- `ZENFLOW_BENCH_INTERVAL`: the ZenFlow update interval of every benchmark's block, "auto" or an integer >= 1
  (default DeepSpeedExamples' 4); any other value is in the benchmark names (`-Uauto`), so it is never compared with
  the default's, and a bad one is refused in one line before anything is collected.
- Raw per-round timings are saved (`--benchmark-save-data`) and every run with benchmarks enabled is saved
  (`--benchmark-autosave`), unless `--benchmark-save` names it or ZENFLOW_BENCH_NO_SAVE=1: the compare command's
  Mann–Whitney test needs the rounds, not only their statistics.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import pytest

from zenflow.config import ConfigError, ZenFlowConfig
from zenflow.harness.cli import interval, split_problem
from zenflow.harness.configs import DEEPSPEED_EXAMPLES_BLOCK
from zenflow.harness.placement import check_placement
from zenflow.telemetry.environment import capture_environment, visible_gpus

DEFAULT_STORAGE = "file://./.benchmarks"  # pytest-benchmark's own default
_ENV: dict[str, Any] = {}
_LOAD_AT_START: list[float] = []  # 1/5/15-minute load averages when the session began


def environment() -> dict[str, Any]:
    """capture_environment(), once per session (it imports DeepSpeed: ~2 s)."""
    if not _ENV:
        _ENV.update(capture_environment())
    return _ENV


def machine_facts(env: dict[str, Any]) -> dict[str, Any]:
    """The keys added to pytest-benchmark's machine_info (flat, so they show in its JSON at a glance)."""
    nvml = env.get("nvml") or {}
    devices = visible_gpus(env)  # the GPUs this run uses, in torch's order (not every GPU on the host)
    names = [d.get("name") for d in devices]
    link = devices[0] if devices else {}  # cuda:0, the device the benchmarks train on
    torch_info, git = env.get("torch") or {}, env.get("git") or {}
    return {
        "hardware_id": env.get("hardware_id"),
        "cpu_model": (env.get("cpu") or {}).get("model"),
        "cpu_cores": (env.get("cpu") or {}).get("allowed_cores"),
        "cpu_logical_cores": (env.get("cpu") or {}).get("logical_cores"),
        "gpu_name": ", ".join(dict.fromkeys(names)) if names else None,
        "gpu_count": len(names),
        "gpu_driver": nvml.get("driver"),
        "pcie_gen": link.get("pcie_gen_max"),
        "pcie_width": link.get("pcie_width_max"),
        "torch_version": torch_info.get("version"),
        "cuda_version": torch_info.get("cuda"),
        "deepspeed_version": (env.get("deepspeed") or {}).get("version"),
        "git_commit": git.get("commit"),
        "git_dirty": git.get("dirty"),
    }


def pytest_benchmark_update_machine_info(config: Any, machine_info: dict[str, Any]) -> None:
    machine_info.update(machine_facts(environment()))
    # Other work on the machine during the run (a shared host, a busy runner) shows here and in the compare header.
    machine_info["load_average"] = {"start": _LOAD_AT_START or None, "end": _load_average()}


def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # not available on this platform
        return None


def configure_benchmark_options(option: Any) -> None:
    """Save raw timings; autosave enabled runs; storage per hardware id unless the user chose one."""
    if not hasattr(option, "benchmark_storage"):  # pytest-benchmark not loaded (-p no:benchmark)
        return
    option.benchmark_save_data = True
    enabled = not option.benchmark_disable or getattr(option, "benchmark_enable", False)
    if not enabled or getattr(option, "benchmark_skip", False):
        return  # nothing will be measured: do not pay for the environment capture
    if not (option.benchmark_save or option.benchmark_autosave) and os.environ.get("ZENFLOW_BENCH_NO_SAVE") != "1":
        from pytest_benchmark.utils import get_tag

        option.benchmark_autosave = get_tag()
    if option.benchmark_storage == DEFAULT_STORAGE:
        option.benchmark_storage = f"{DEFAULT_STORAGE}/{environment()['hardware_id']}"


def check_interval_knob() -> None:
    """ZENFLOW_BENCH_INTERVAL (read by the benchmark modules): "auto" or an integer >= 1 that the benchmarks' blocks
    allow (select_interval 64 bounds it); otherwise one line and pytest's usage-error exit, before any collection."""
    value = os.environ.get("ZENFLOW_BENCH_INTERVAL")
    if not value:
        return
    try:
        ZenFlowConfig.from_dict({**DEEPSPEED_EXAMPLES_BLOCK, "update_interval": interval(value)})
    except (argparse.ArgumentTypeError, ConfigError) as exc:
        raise pytest.UsageError(f"ZENFLOW_BENCH_INTERVAL: {exc}") from None


def check_placement_knob() -> None:
    """ZENFLOW_BENCH_PLACEMENT (bench/test_train_step.py): one of PLACEMENTS, split with two cores at least;
    otherwise one line and pytest's usage-error exit, before any collection."""
    value = os.environ.get("ZENFLOW_BENCH_PLACEMENT")
    if not value:
        return
    try:
        check_placement(value)
    except ValueError as exc:
        raise pytest.UsageError(f"ZENFLOW_BENCH_PLACEMENT: {exc}") from None
    problem = split_problem(cuda=False) if value == "split" else None  # the split's workloads run on the CPU
    if problem:
        raise pytest.UsageError(f"ZENFLOW_BENCH_PLACEMENT: {problem}")


def pytest_configure(config: pytest.Config) -> None:
    check_interval_knob()
    check_placement_knob()
    # Runs before pytest-benchmark's own pytest_configure (trylast), which reads these options.
    configure_benchmark_options(config.option)
    _LOAD_AT_START[:] = _load_average() or []


@pytest.fixture(scope="session")
def bench_records_dir() -> Path:
    """Where the engine benchmarks write their run records: $ZENFLOW_BENCH_RECORDS or .benchmarks/records/<hw>."""
    folder = os.environ.get("ZENFLOW_BENCH_RECORDS")
    return Path(folder) if folder else Path(".benchmarks") / "records" / environment()["hardware_id"]
