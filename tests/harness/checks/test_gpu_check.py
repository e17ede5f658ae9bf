"""`make gpu-check` and NVML for the run's own GPU, provable without a GPU:
the smoke of the command, a record that survives a kill after any check, its fail-fast, --checks, the
rendering of a GPU record (NVML totals marked where a counter could have wrapped), and the mapping of torch's
visible devices to NVML handles by PCI bus id with a fake pynvml of a 4-GPU host. The checks' own logic:
tests/harness/checks/test_differential_check.py, tests/harness/checks/test_memory_check.py,
tests/harness/checks/test_pcie_check.py."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pynvml
import pytest
import torch

from zenflow.harness.checks import differential as diffmod
from zenflow.harness.checks import gpu, render
from zenflow.harness.checks import pcie as pc
from zenflow.harness.checks.differential import CASES, Trained
from zenflow.harness.checks.memory import memory_verdict
from zenflow.harness.checks.verdict import check, guarded, pending, verdict
from zenflow.telemetry import environment
from zenflow.telemetry.nvml import NvmlSampler, nvml_snapshot, pci_bus_id

ROOT = Path(__file__).resolve().parents[3]


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cli = _load(ROOT / "reproduce" / "gpu_check.py", "gpu_check_cli")


# --- the command -------------------------------------------------------------------------------------------------
def _command(out: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "reproduce" / "gpu_check.py"), *args, "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)


@pytest.mark.script
def test_smoke_runs_the_cpu_part_and_says_what_it_could_not_check(tmp_path):
    proc = _command(tmp_path, "--smoke")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads((tmp_path / "gpu-check.json").read_text())
    assert (tmp_path / "table.md").exists() and (tmp_path / "figure.png").stat().st_size > 0
    checks = {c["name"]: c for c in record["checks"]}
    assert list(checks) == list(gpu.CHECK_NAMES)
    assert record["schema"] == gpu.SCHEMA and record["mode"] == "smoke" and record["complete"] is True
    assert checks["engines"]["status"] == "pass"
    assert all(c["seconds"] >= 0 for c in record["checks"])  # each check's time, for budgets
    assert {r["engine"]: r["status"] for r in record["engines"]} == {"ref-offload": "ok", "ref-zenflow": "ok"}
    assert all(r["compute_ms"] is not None and r["stall_ms"] is not None for r in record["engines"])
    assert [r["case"] for r in record["differential"]] == [*CASES, "ref-zenflow-stress"]
    for row in record["differential"]:  # the maxima by kind, and what each device's run did
        assert set(row["by_kind"]) == {"column", "dense", "losses"}
        assert row["host_updates"][0] == row["host_updates"][1] > 0
    if torch.cuda.is_available():
        assert {c["status"] for c in checks.values()} <= {"pass", "not checked"}
        assert checks["differential"]["status"] == "pass" and record["differential"][0]["devices"] == "cuda vs cpu"
        assert all(c["outcome"] == "failed as expected" for x in ("differential", "memory")
                   for c in checks[x]["controls"])
    else:
        for name in ("environment", "differential", "memory", "pcie"):
            assert checks[name]["status"] == "not checked" and checks[name]["reason"], name
            assert f"{name:<13} NOT CHECKED" in proc.stdout
        assert "no CUDA" in checks["memory"]["reason"] and "no CUDA" in checks["pcie"]["reason"]
        assert "exactly equal" in checks["differential"]["reason"]
        assert all(r["max_abs"] == 0.0 for r in record["differential"])
        assert {c["outcome"] for x in ("differential", "memory", "pcie") for c in checks[x]["controls"]} == {
            "not run"}
    table = (tmp_path / "table.md").read_text()
    assert "| ref-zenflow-overlap" in table and "| ref-offload " in table and "Incomplete" not in table
    assert "## Negative controls (each must fail)" in table


@pytest.mark.script
@pytest.mark.parametrize("k", [1, 2])
def test_a_kill_after_check_k_leaves_a_record_with_checks_1_to_k(tmp_path, k):
    """The record and table are written atomically after every check, so SIGKILL (a command's time limit) after
    check k leaves a record that parses and holds checks 1..k, the rest "not run"."""
    proc = _command(tmp_path, "--smoke", env={**os.environ, cli.KILL_AFTER: str(k)})
    assert proc.returncode == -signal.SIGKILL, proc.stdout[-2000:] + proc.stderr[-2000:]
    record = json.loads((tmp_path / "gpu-check.json").read_text())
    statuses = [c["status"] for c in record["checks"]]
    assert "not run" not in statuses[:k] and statuses[k:] == ["not run"] * (len(gpu.CHECK_NAMES) - k)
    assert record["complete"] is False and [c["name"] for c in record["checks"]] == list(gpu.CHECK_NAMES)
    assert bool(record["differential"]) == (k >= 2)  # the finished check's rows are in the record too
    table = (tmp_path / "table.md").read_text()
    assert f"**Incomplete record**: {k} of {len(gpu.CHECK_NAMES)} checks finished" in table
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu-check.json", "table.md"]  # no temporary left


def test_the_engines_check_saves_the_record_after_every_run(tmp_path, monkeypatch):
    from zenflow.harness.records import RunRecord

    monkeypatch.setattr(gpu, "run_in_subprocess", lambda spec, path, timeout_s: RunRecord(
        engine=spec.engine, status="ok", summary={"cycle_mean_ms": 1.0}))
    seen = []
    plan = gpu.engine_plan(False, True)
    res, rows = gpu.run_engines(plan, tmp_path, False, on_row=lambda r: seen.append(len(r)))
    assert res["status"] == "pass" and seen == [1, 2] and len(rows) == 2


def test_nvml_gpus_without_cuda_in_torch_stop_with_exit_2(monkeypatch, tmp_path, capsys):
    env = {"hardware_id": "cpu-scale-x-2c", "torch": {"version": "2.13.0+cpu", "cuda": None, "cuda_available": False},
           "nvml": {"available": True, "driver": "555.42.06", "devices": [{"name": "NVIDIA H100 80GB HBM3"}] * 2}}
    monkeypatch.setattr(cli, "capture_environment", lambda: env)
    monkeypatch.setattr(gpu, "differential_check", lambda *a, **k: pytest.fail("ran past the fail-fast"))
    assert cli.main(["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "NVML sees 2 GPU(s) (NVIDIA H100 80GB HBM3, driver 555.42.06)" in err and "cannot use CUDA" in err
    assert not list(tmp_path.iterdir())


def test_cuda_unusable_only_when_nvml_sees_gpus_and_torch_cannot_use_them():
    gpus = {"available": True, "devices": [{"name": "A"}], "driver": "1"}
    assert gpu.cuda_unusable({"nvml": gpus, "torch": {"cuda_available": False}})
    assert gpu.cuda_unusable({"nvml": gpus, "torch": {"cuda_available": True}}) is None
    assert gpu.cuda_unusable({"nvml": {"available": False, "reason": "x"}, "torch": {"cuda_available": False}}) is None


@pytest.mark.script
def test_checks_flag_runs_only_the_asked_checks_timed_and_says_the_rest_were_not_asked(tmp_path):
    """gpu_window.py runs checks 1-4 through a real flag (not a SIGKILL after check 4), and the
    record says how long each took (budgets are sized from it)."""
    assert cli.parse_args(["--checks", "pcie,environment"]).checks == ["environment", "pcie"]  # record order
    for bad in ("engine", "memory,memory", ""):
        with pytest.raises(SystemExit):
            cli.parse_args(["--checks", bad])
    proc = _command(tmp_path, "--smoke", "--checks", "environment")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    record = json.loads((tmp_path / "gpu-check.json").read_text())
    checks = {c["name"]: c for c in record["checks"]}
    assert record["complete"] is True and checks["environment"]["seconds"] >= 0
    for name in (n for n in gpu.CHECK_NAMES if n != "environment"):
        assert checks[name]["status"] == "not checked" and "not asked" in checks[name]["reason"], checks[name]
        assert "seconds" not in checks[name]
    assert re.search(r"\| check +\| status +\| seconds +\| reason", (tmp_path / "table.md").read_text())


def test_the_engines_run_without_the_llama_tokenizer_packages(tmp_path, monkeypatch):
    """Without mistral-common (or sentencepiece) the runs train on UTF-8 bytes and say so in their
    record; the engine rows must not all read "not installed"."""
    from zenflow.harness.records import RunRecord

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("mistral_common", "sentencepiece") else real(name, *a))
    monkeypatch.setattr(gpu, "run_in_subprocess", lambda spec, path, timeout_s: RunRecord(
        engine=spec.engine, status="ok", summary={"cycle_mean_ms": 1.0}))
    res, rows = gpu.run_engines(gpu.engine_plan(False, True), tmp_path, False)
    assert res["status"] == "pass" and [r["status"] for r in rows] == ["ok", "ok"]


def test_a_check_that_raises_becomes_a_failed_check():
    res = guarded("memory", lambda: 1 / 0)
    assert res["status"] == "fail" and "ZeroDivisionError" in res["reason"] and "Traceback" in res["traceback"]
    assert guarded("memory", lambda x: x, 3) == 3


# NVML bytes per payload byte of plain copies (pcie_check.link_overhead), in the spirit of the first H100's
OVERHEAD = {"d2h": {"tx_bytes": 1.10, "rx_bytes": 0.01}, "h2d": {"tx_bytes": 0.08, "rx_bytes": 1.07},
            "devices": [{"counter_bits": {"tx": 32, "rx": 32}, "wrap_ambiguous": False}] * 2}


def _window(ours_by_kind: dict[str, int], wrap: bool) -> dict:
    ours = pc.per_direction(ours_by_kind)
    dev = {"counters": "nvml_fi", "counter_bits": {"tx": 32, "rx": 32}, "counter_max_gap_s": 0.1 if wrap else 0.012,
           "wrap_ambiguous": wrap, **{c: round(pc.predicted(ours, OVERHEAD, c)) for c in ("tx_bytes", "rx_bytes")}}
    return pc.window_verdict(ours_by_kind, OVERHEAD, dev, {"tx_bytes": 0, "rx_bytes": 0}, 1.0, 1.0, asymmetric=wrap)


def test_a_gpu_record_renders_its_memory_pcie_controls_and_engine_tables_and_figure(tmp_path):
    """The GPU-only sections of the table and figure, drawn from a record shaped as a GPU host writes it; an NVML
    total whose 32-bit counter could have wrapped between reads is marked."""
    env = {"hardware_id": "nvidia-h100-80gb-hbm3x1-pcie5", "driver": "555.42.06", "nvml": "available",
           "torch": "2.11.0", "torch_cuda_build": "13.0", "cuda_available": True, "deepspeed": None,
           "gpus": [{"cuda_index": 0, "name": "NVIDIA H100 80GB HBM3", "pcie_gen": 5, "pcie_gen_max": 5,
                     "pcie_width": 16, "pcie_width_max": 16, "pcie_counters": {"tx": None, "rx": None}}]}
    pcie = pc.pcie_verdict({"ref-offload": _window({"d2h/grads": 1000, "h2d/params": 1000}, wrap=False),
                            "ref-zenflow": _window({"d2h/grads": 4000, "h2d/params": 1000}, wrap=True)}, OVERHEAD)
    engines = [{"engine": "ds-zenflow", "shape": "h512x8", "status": "not installed", "error": ["not installed"]},
               {"engine": "ref-zenflow", "shape": "h512x8", "status": "ok", "cycle_mean_ms": 30.0,
                "compute_ms": 25.0, "io_ms": 1.0, "stall_ms": 4.0, "stall_includes_io": False, "error": None}]
    ref = {"w": torch.ones(3, 2), "b": torch.ones(3), "<losses>": torch.ones(4)}
    run = lambda t: Trained(t, 8, 120)  # noqa: E731
    diff = [diffmod.case_row(c, ("cuda", "cpu"), 24, run(ref), run(ref | {"w": ref["w"] + 1e-6})) for c in CASES]
    memory = memory_verdict(2**30, 2**30 + 2**20, 2**21, 2**30 + 2**23, steps=12, metric="active_bytes.all.peak")
    record = {"environment": env, "differential": diff, "engines": engines, "complete": True,
              "checks": [check("environment", "pass"), diffmod.differential_verdict(diff, []), memory, pcie,
                         check("engines", "pass", "not installed: ['ds-zenflow']", scale="gpu")]}
    text = gpu.markdown(record)
    rows = [re.sub(r"\s*\|\s*", "|", line) for line in text.splitlines()]
    assert "|1024.0|1025.0|1.0|2.0|8.0|pass|" in rows  # sync, overlap, extra, bound, no-backpressure extra MiB
    assert "|ref-offload|d2h|1000|1180|1180|1.180|1.100|0|pass|" in rows
    assert "|ref-zenflow|d2h|4000|4480†|4480|1.120|1.100|0|not checked|" in rows
    assert "† a counter of this width could have wrapped" in text and "ref-zenflow: 32-bit" in text
    # the difference is in the column param only (1e-6 in fp32 is 2^-20): dense params and losses read 0
    assert "|ref-zenflow-sync|cuda vs cpu|24|9.54e-07|8.67e-03|0.00e+00|0.00e+00|0|8|120|rtol 0.0001, atol 1e-05|" \
        in rows
    assert "|memory|overlap without backpressure|failed as expected|" in "\n".join(rows)
    assert "|pcie|ref-offload: d2h/grads left uncounted|failed as expected|" in "\n".join(rows)
    assert "byte counters answered" in text and "(tolerance ±1%)" in text
    assert "|ref-zenflow|h512x8|ok|30.0|25.0|1.0|4.0||" in rows
    assert "|ds-zenflow|h512x8|not installed|—|—|—|—|not installed|" in rows
    assert "cuda:0 NVIDIA H100 80GB HBM3 PCIe gen 5/5 x16/16" in text
    # the sections in the checks' order, the controls after the last check that has any, before the engine runs
    titles = [line for line in text.splitlines() if line.startswith("## ")]
    assert titles == ["## Differential", "## Device memory (overlap vs sync)", "## PCIe bytes (NVML vs the optimizer)",
                      "## Negative controls (each must fail)", "## Engines"]
    render.figure(record, tmp_path / "f.png")
    assert (tmp_path / "f.png").stat().st_size > 0


def test_every_check_is_one_row_and_the_record_and_docs_follow_the_rows():
    """Adding a check is one CHECKS row: the record's rows keys and the checks' order come from the rows, and
    docs/gpu-check.md has a paragraph for each."""
    record = gpu.new_record("smoke", False, {}, {})
    assert [c["name"] for c in record["checks"]] == [c.name for c in gpu.CHECKS] == list(gpu.CHECK_NAMES)
    assert {c.rows for c in gpu.CHECKS if c.rows} <= set(record) and len(set(gpu.CHECK_NAMES)) == len(gpu.CHECKS)
    docs = (ROOT / "docs" / "gpu-check.md").read_text()
    assert [name for name in gpu.CHECK_NAMES if f"**{name}**" not in docs] == []


def test_verdict_fails_only_on_a_failed_check():
    assert verdict([check("a", "pass"), check("b", "not checked", "no CUDA")]) == 0
    assert verdict([check("a", "pass"), check("b", "fail", "off")]) == 1
    assert verdict([check("a", "pass"), pending("b")]) == 0


def test_writes_are_atomic(tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    gpu.write_json(path, {"a": 1})
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError):
        gpu.write_json(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 1} and [p.name for p in tmp_path.iterdir()] == ["r.json"]
    assert path.stat().st_mode & 0o777 == 0o644


# --- NVML: the run's own GPUs ------------------------------------------------------------------------------------
BUS = [pci_bus_id(0, bus, 0) for bus in (0x18, 0x3B, 0x86, 0xAF)]  # NVML indices 0..3, by PCI order


class FourGpuNvml:
    """A host with 4 GPUs; GPU 2 has a wider, newer link so a test can tell which GPU a fact came from."""

    def __init__(self):
        self.sampled, self.lock = set(), threading.Lock()

    def __getattr__(self, name):
        return getattr(pynvml, name)

    nvmlInit = nvmlShutdown = staticmethod(lambda: None)
    nvmlSystemGetDriverVersion = staticmethod(lambda: "555.42.06")
    nvmlDeviceGetCount = staticmethod(lambda: 4)
    nvmlDeviceGetHandleByIndex = staticmethod(lambda i: ("h", i))
    nvmlDeviceGetIndex = staticmethod(lambda h: h[1])
    nvmlDeviceGetName = staticmethod(lambda h: "NVIDIA H100 80GB HBM3")
    nvmlDeviceGetUtilizationRates = staticmethod(lambda h: SimpleNamespace(gpu=50, memory=10))
    nvmlDeviceGetPcieThroughput = staticmethod(lambda h, c: 7)
    nvmlDeviceGetCurrPcieLinkGeneration = nvmlDeviceGetMaxPcieLinkGeneration = staticmethod(
        lambda h: 5 if h[1] == 2 else 4)
    nvmlDeviceGetCurrPcieLinkWidth = nvmlDeviceGetMaxPcieLinkWidth = staticmethod(lambda h: 16 if h[1] == 2 else 8)

    @staticmethod
    def nvmlDeviceGetHandleByPciBusId(bus):
        if bus not in BUS:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return ("h", BUS.index(bus))

    def nvmlDeviceGetFieldValues(self, h, fields):
        with self.lock:
            self.sampled.add(h[1])
        out = []
        for field in fields:
            fv = pynvml.c_nvmlFieldValue_t()
            fv.fieldId, fv.valueType, fv.nvmlReturn = field, pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, 0
            fv.value.ullVal = int(time.monotonic() * 1e6)
            out.append(fv)
        return out


def test_pci_bus_id_is_spelled_as_nvml_reads_it():
    assert pci_bus_id(0, 0x3B, 0) == "00000000:3b:00.0"
    assert pci_bus_id(1, 0xAF, 0x1F) == "00000001:af:1f.0"


def test_snapshot_maps_torch_devices_to_nvml_by_pci_bus_id_and_the_hardware_id_counts_only_them():
    # CUDA_VISIBLE_DEVICES=2 on a 4-GPU host: torch sees one device, NVML index 2
    snap = nvml_snapshot(FourGpuNvml(), bus_ids=[BUS[2]])
    assert [d["cuda_index"] for d in snap["devices"]] == [None, None, 0, None]
    assert snap["devices"][2]["pci_bus_id"] == BUS[2] and snap["mapping_errors"] == []
    assert snap["devices"][2]["pcie_counters"] == {"tx": None, "rx": None}
    env = {"cpu": {"model": "AMD EPYC 7763", "allowed_cores": 16}, "nvml": snap,
           "torch": {"cuda_available": True, "cuda_devices": ["NVIDIA H100 80GB HBM3"]},
           "memory_total_bytes": 135_148_564_480}  # the committed H100 host: 125.9 GiB
    # one GPU, its own link (gen 5), and the host it is bound by
    assert environment.hardware_id(env) == "nvidia-h100-80gb-hbm3x1-pcie5-16c-126g"
    bigger = {**env, "cpu": {**env["cpu"], "allowed_cores": 128}, "memory_total_bytes": 2**40}
    assert environment.hardware_id(bigger) == "nvidia-h100-80gb-hbm3x1-pcie5-128c-1024g"
    facts = _load(ROOT / "bench" / "conftest.py", "bench_conftest").machine_facts(env)
    assert (facts["gpu_count"], facts["pcie_gen"], facts["pcie_width"]) == (1, 5, 16)
    # CUDA_VISIBLE_DEVICES=3,0: torch's order, not NVML's
    snap = nvml_snapshot(FourGpuNvml(), bus_ids=[BUS[3], BUS[0]])
    assert [d["cuda_index"] for d in snap["devices"]] == [1, None, None, 0]
    assert [d["index"] for d in environment.visible_gpus({**env, "nvml": snap})] == [3, 0]


def test_torch_without_cuda_makes_a_cpu_hardware_id_even_with_gpus_on_the_host():
    snap = nvml_snapshot(FourGpuNvml(), bus_ids=None)
    assert snap["torch_cuda"] is False and all(d["cuda_index"] is None for d in snap["devices"])
    env = {"cpu": {"model": "AMD EPYC 7763", "allowed_cores": 16}, "nvml": snap,
           "torch": {"cuda_available": False, "cuda_devices": []}}
    assert environment.hardware_id(env) == "cpu-scale-amd-epyc-7763-16c"
    assert gpu.cuda_unusable(env)


def test_sampler_samples_only_the_runs_gpus():
    fake = FourGpuNvml()
    with NvmlSampler(interval_s=0.001, nvml=fake, bus_ids=[BUS[1]]) as s:
        time.sleep(0.05)
    res = s.result()
    assert res["scope"] == "visible" and fake.sampled == {1}
    assert [(d["index"], d["cuda_index"], d["pci_bus_id"]) for d in res["devices"]] == [(1, 0, BUS[1])]
    assert res["devices"][0]["counters"] == "nvml_fi" and res["devices"][0]["tx_bytes"] > 0


def test_sampler_reports_a_device_nvml_cannot_find_instead_of_guessing():
    fake = FourGpuNvml()
    with NvmlSampler(interval_s=0.001, nvml=fake, bus_ids=[pci_bus_id(0, 0x99, 0), BUS[0]]) as s:
        time.sleep(0.02)
    res = s.result()
    assert [d["index"] for d in res["devices"]] == [0] and fake.sampled == {0}
    assert len(res["mapping_errors"]) == 1 and "cuda:0" in res["mapping_errors"][0]
    assert "Not Found" in res["mapping_errors"][0]


def test_sampler_without_cuda_in_torch_covers_every_gpu_and_says_so():
    fake = FourGpuNvml()
    with NvmlSampler(interval_s=0.001, nvml=fake, bus_ids=None) as s:
        time.sleep(0.02)
    res = s.result()
    assert res["scope"] == "all" and [d["index"] for d in res["devices"]] == [0, 1, 2, 3]
    assert all(d["cuda_index"] is None for d in res["devices"])
