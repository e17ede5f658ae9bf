"""`make gpu-check` (issue 11 item 6) and NVML for the run's own GPU (audit item 13), provable without a GPU:
the smoke of the command, its fail-fast, the memory bound and PCIe agreement arithmetic, and the mapping of
torch's visible devices to NVML handles by PCI bus id with a fake pynvml of a 4-GPU host."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pynvml
import pytest
import torch

from zenflow.harness import gpu_check as gc
from zenflow.harness import pcie_check as pc
from zenflow.telemetry import environment
from zenflow.telemetry.nvml import NvmlSampler, nvml_snapshot, pci_bus_id

ROOT = Path(__file__).resolve().parents[1]


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- the command -------------------------------------------------------------------------------------------------
def test_smoke_runs_the_cpu_part_and_says_what_it_could_not_check(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "reproduce" / "gpu_check.py"), "--smoke", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads((tmp_path / "gpu-check.json").read_text())
    assert (tmp_path / "table.md").exists() and (tmp_path / "figure.png").stat().st_size > 0
    checks = {c["name"]: c for c in record["checks"]}
    assert list(checks) == ["environment", "differential", "memory", "pcie", "engines"]
    assert record["schema"] == gc.SCHEMA and record["mode"] == "smoke"
    assert checks["engines"]["status"] == "pass"
    assert {r["engine"]: r["status"] for r in record["engines"]} == {"ref-offload": "ok", "ref-zenflow": "ok"}
    assert all(r["compute_ms"] is not None and r["stall_ms"] is not None for r in record["engines"])
    assert len(record["differential"]) == len(gc.CASES)
    if torch.cuda.is_available():
        assert {c["status"] for c in checks.values()} <= {"pass", "not checked"}
        assert checks["differential"]["status"] == "pass" and record["differential"][0]["devices"] == "cuda vs cpu"
    else:
        for name in ("environment", "differential", "memory", "pcie"):
            assert checks[name]["status"] == "not checked" and checks[name]["reason"], name
            assert f"{name:<13} NOT CHECKED" in proc.stdout
        assert "no CUDA" in checks["memory"]["reason"] and "no CUDA" in checks["pcie"]["reason"]
        assert "exactly equal" in checks["differential"]["reason"]
        assert all(r["max_abs"] == 0.0 for r in record["differential"])
    table = (tmp_path / "table.md").read_text()
    assert "| ref-zenflow-overlap" in table and "| ref-offload " in table


def test_nvml_gpus_without_cuda_in_torch_stop_with_exit_2(monkeypatch, tmp_path, capsys):
    cli = _load(ROOT / "reproduce" / "gpu_check.py", "gpu_check_cli")
    env = {"hardware_id": "cpu-scale-x-2c", "torch": {"version": "2.13.0+cpu", "cuda": None, "cuda_available": False},
           "nvml": {"available": True, "driver": "555.42.06", "devices": [{"name": "NVIDIA H100 80GB HBM3"}] * 2}}
    monkeypatch.setattr(cli, "capture_environment", lambda: env)
    monkeypatch.setattr(cli.gc, "differential_check", lambda *a, **k: pytest.fail("ran past the fail-fast"))
    assert cli.main(["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "NVML sees 2 GPU(s) (NVIDIA H100 80GB HBM3, driver 555.42.06)" in err and "cannot use CUDA" in err
    assert not list(tmp_path.iterdir())


def test_cuda_unusable_only_when_nvml_sees_gpus_and_torch_cannot_use_them():
    gpus = {"available": True, "devices": [{"name": "A"}], "driver": "1"}
    assert gc.cuda_unusable({"nvml": gpus, "torch": {"cuda_available": False}})
    assert gc.cuda_unusable({"nvml": gpus, "torch": {"cuda_available": True}}) is None
    assert gc.cuda_unusable({"nvml": {"available": False, "reason": "x"}, "torch": {"cuda_available": False}}) is None


def test_memory_bound_is_one_set_of_unselected_columns():
    model = torch.nn.Sequential(torch.nn.Linear(10, 4), torch.nn.LayerNorm(4),
                                torch.nn.Linear(4, 3, dtype=torch.bfloat16))
    # k = ceil(0.25 * 10) = 3 -> 4 * 7 * 4 B; k = ceil(0.25 * 4) = 1 -> 3 * 3 * 2 B; 1-D params never leave
    assert gc.unselected_bound_bytes(model, 0.25) == 4 * 7 * 4 + 3 * 3 * 2
    assert gc.unselected_bound_bytes(model, 0.0) == 4 * 10 * 4 + 3 * 4 * 2
    conv = torch.nn.Conv2d(3, 8, 3)  # [8, 3, 3, 3] is viewed as [8, 27]
    assert gc.unselected_bound_bytes(conv, 0.1) == 8 * (27 - math.ceil(2.7)) * 4


# NVML bytes per payload byte of plain copies, as the first H100 (PCIe 5 x16) measured them in spirit: writes out
# carry headers on TX, reads in carry completion headers on RX and send read requests on TX.
OVERHEAD = {"d2h": {"tx_bytes": 1.10, "rx_bytes": 0.01}, "h2d": {"tx_bytes": 0.08, "rx_bytes": 1.07}}


def test_our_bytes_predict_each_nvml_counter_through_the_links_overhead():
    ours = {"d2h": 1000, "h2d": 2000}
    assert pc.predicted(ours, OVERHEAD, "tx_bytes") == pytest.approx(1000 * 1.10 + 2000 * 0.08)
    assert pc.predicted(ours, OVERHEAD, "rx_bytes") == pytest.approx(1000 * 0.01 + 2000 * 1.07)
    assert pc.predicted(ours, {"d2h": {"tx_bytes": None}, "h2d": {"tx_bytes": 1.0}}, "tx_bytes") is None


def test_pcie_agreement_within_tolerance_of_the_prediction_or_a_recorded_reason():
    assert pc.agreement(1040, 1000.0, 900, 0) == ("pass", None)
    assert pc.agreement(960, 1000.0, 900, 0) == ("pass", None)
    status, reason = pc.agreement(1200, 1000.0, 1000, 5000)
    assert status == "fail" and "1.200x what our bytes predict" in reason and "≈5000 B over the same time" in reason
    assert pc.agreement(None, 1000.0, 1000, None)[0] == "not checked"
    assert pc.agreement(10, 0.0, 0, 0)[0] == "not checked"


def test_the_first_h100_reading_passes_once_the_overhead_is_measured_and_an_uncounted_copy_fails():
    ours = {"d2h": 3221225472, "h2d": 3221225472}  # ref-offload, 12 steps of 4 x 4096x4096 fp32, both ways
    dev = {"counters": "nvml_fi", "name": "H100", "pci_bus_id": "b",
           "tx_bytes": round(pc.predicted(ours, OVERHEAD, "tx_bytes") * 1.01),
           "rx_bytes": round(pc.predicted(ours, OVERHEAD, "rx_bytes") * 0.99)}
    res = pc.verdict(ours, OVERHEAD, dev, {"tx_bytes": 10, "rx_bytes": 20}, window=4.0, idle_s=2.0)
    assert res["status"] == "pass", res["reason"]
    assert res["directions"]["d2h"]["overhead"] == 1.10 and res["tolerance"] == pc.TOLERANCE
    missed = dict(ours, h2d=ours["h2d"] // 2)  # half the uploads not counted: the counters must not explain NVML
    res = pc.verdict(missed, OVERHEAD, dev, {"tx_bytes": 10, "rx_bytes": 20}, window=4.0, idle_s=2.0)
    assert res["status"] == "fail" and res["directions"]["h2d"]["status"] == "fail" and "≈40 B" in res["reason"]
    dev = {"tx_bytes": 1180, "rx_bytes": None, "counters": "unsupported", "counter_errors": {"rx": "Not Supported"}}
    res = pc.verdict({"d2h": 1000, "h2d": 1000}, OVERHEAD, dev, {}, window=1.0, idle_s=1.0)
    assert res["status"] == "not checked" and "counters unsupported" in res["reason"]


def test_memory_verdict_against_the_bound():
    assert gc.memory_verdict(100, 150, 50)["status"] == "pass"
    res = gc.memory_verdict(100, 151, 50)
    assert res["status"] == "fail" and res["extra_bytes"] == 51 and "bound" in res["reason"]


def test_a_check_that_raises_becomes_a_failed_check():
    res = gc.guarded("memory", lambda: 1 / 0)
    assert res["status"] == "fail" and "ZeroDivisionError" in res["reason"] and "Traceback" in res["traceback"]
    assert gc.guarded("memory", lambda x: x, 3) == 3


def test_a_gpu_record_renders_its_memory_pcie_and_engine_tables_and_figure(tmp_path):
    """The GPU-only sections of the table and figure, drawn from a record shaped as a GPU host writes it."""
    env = {"hardware_id": "nvidia-h100-80gb-hbm3x1-pcie5", "driver": "555.42.06", "nvml": "available",
           "torch": "2.11.0", "torch_cuda_build": "13.0", "cuda_available": True, "deepspeed": None,
           "gpus": [{"cuda_index": 0, "name": "NVIDIA H100 80GB HBM3", "pcie_gen": 5, "pcie_gen_max": 5,
                     "pcie_width": 16, "pcie_width_max": 16, "pcie_counters": {"tx": None, "rx": None}}]}
    pcie = pc.verdict({"d2h": 1000, "h2d": 1000}, OVERHEAD,
                      {"tx_bytes": 1190, "rx_bytes": 1080, "counters": "nvml_fi"},
                      {"tx_bytes": 0, "rx_bytes": 0}, 1.0, 1.0)
    engines = [{"engine": "ds-zenflow", "shape": "h512x8", "status": "not installed", "error": ["not installed"]},
               {"engine": "ref-zenflow", "shape": "h512x8", "status": "ok", "cycle_mean_ms": 30.0,
                "compute_ms": 25.0, "io_ms": 1.0, "stall_ms": 4.0, "stall_includes_io": False, "error": None}]
    diff = [{"case": c, "devices": "cuda vs cpu", "steps": 24, **gc.compare({"w": torch.ones(3)},
                                                                              {"w": torch.ones(3) + 1e-6})}
            for c in gc.CASES]
    record = {"environment": env, "differential": diff, "engines": engines,
              "checks": [gc.check("environment", "pass"), gc.check("differential", "pass"),
                         gc.memory_verdict(2**30, 2**30 + 2**20, 2**21), pcie,
                         gc.check("engines", "pass", "not installed: ['ds-zenflow']", scale="gpu")]}
    text = gc.markdown(record)
    rows = [re.sub(r"\s*\|\s*", "|", line) for line in text.splitlines()]
    assert "|1024.0|1025.0|1.0|2.0|pass|" in rows  # sync, overlap, extra and bound MiB
    assert "|d2h|1000|1190|1180|1.190|1.100|0|pass|" in rows and "|h2d|1000|1080|1080|1.080|1.070|0|pass|" in rows
    assert "byte counters answered" in text
    assert "|ref-zenflow|h512x8|ok|30.0|25.0|1.0|4.0||" in rows
    assert "|ds-zenflow|h512x8|not installed|—|—|—|—|not installed|" in rows
    assert "cuda:0 NVIDIA H100 80GB HBM3 PCIe gen 5/5 x16/16" in text
    gc.figure(record, tmp_path / "f.png")
    assert (tmp_path / "f.png").stat().st_size > 0


def test_verdict_fails_only_on_a_failed_check():
    assert gc.verdict([gc.check("a", "pass"), gc.check("b", "not checked", "no CUDA")]) == 0
    assert gc.verdict([gc.check("a", "pass"), gc.check("b", "fail", "off")]) == 1


def test_write_json_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    gc.write_json(path, {"a": 1})
    monkeypatch.setattr(json, "dump", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError):
        gc.write_json(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 1} and [p.name for p in tmp_path.iterdir()] == ["r.json"]


# --- NVML: the run's own GPUs (audit item 13) ---------------------------------------------------------------------
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
           "torch": {"cuda_available": True, "cuda_devices": ["NVIDIA H100 80GB HBM3"]}}
    assert environment.hardware_id(env) == "nvidia-h100-80gb-hbm3x1-pcie5"  # one GPU, its own link (gen 5)
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
    assert gc.cuda_unusable(env)


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
