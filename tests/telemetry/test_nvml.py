"""NVML telemetry and environment capture.

(a) The real pynvml on this host: no driver here, so the sampler and snapshot must report NVML's own error string.
(b) A small recorded fake (real pynvml constants, errors and ctypes field structs; only the calls are scripted),
    used for the arithmetic only: counter deltas with and without wrap, summaries, an unsupported field.
(c) Environment capture.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pynvml
import pytest

from zenflow.telemetry import environment
from zenflow.telemetry.nvml import NvmlSampler, counter_delta, field_counter, nvml_snapshot, summarize, wrap_ambiguous

REPO = Path(__file__).resolve().parents[2]


def _nvml_error_here() -> str | None:
    """The string pynvml raises from nvmlInit on this host, or None if a driver answers."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return str(e)
    pynvml.nvmlShutdown()
    return None


no_driver = pytest.mark.skipif(_nvml_error_here() is None, reason="an NVIDIA driver answers on this host")


# --- (a) real pynvml ------------------------------------------------------------------------------------------------
@no_driver
def test_sampler_reports_the_exact_nvml_error_without_a_driver():
    with NvmlSampler(interval_s=0.01) as s:
        time.sleep(0.03)
    res = s.result()
    assert res["available"] is False
    assert res["reason"] == _nvml_error_here()
    assert res["devices"] == []
    json.dumps(res)


@no_driver
def test_snapshot_reports_the_exact_nvml_error_without_a_driver():
    assert nvml_snapshot() == {"available": False, "reason": _nvml_error_here()}


@pytest.mark.gpu
@pytest.mark.skipif(_nvml_error_here() is not None, reason="no NVIDIA driver on this host")
def test_sampler_on_a_gpu_host():
    with NvmlSampler(interval_s=0.01) as s:
        time.sleep(0.5)
    res = json.loads(json.dumps(s.result()))
    assert res["available"] is True and res["devices"] and res["sampler_error"] is None
    assert all(d["samples"] > 0 and d["counters"] in ("nvml_fi", "unsupported") for d in res["devices"])


# --- (b) arithmetic, with a recorded fake -----------------------------------------------------------------------------
def test_counter_delta():
    assert counter_delta(100, 1100) == 1000
    assert counter_delta(5, 5) == 0
    assert counter_delta(2**64 - 10, 5) == 15  # 64-bit wrap
    assert counter_delta(2**32 - 10, 5, bits=32) == 15  # 32-bit wrap
    assert counter_delta(2**32 - 10, 5, bits=64) == 2**64 - 2**32 + 15  # the width matters
    with pytest.raises(ValueError):
        counter_delta(0, 2**32, bits=32)


def _field(value_type: int, member: str, value: int | float, ret: int = pynvml.NVML_SUCCESS):
    fv = pynvml.c_nvmlFieldValue_t()
    fv.fieldId, fv.valueType, fv.nvmlReturn = pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, value_type, ret
    setattr(fv.value, member, value)
    return fv


def test_field_counter_takes_width_from_value_type():
    assert field_counter(_field(pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, "uiVal", 2**32 - 1)) == (2**32 - 1, 32)
    assert field_counter(_field(pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, "ullVal", 2**40)) == (2**40, 64)
    assert field_counter(_field(pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG, "sllVal", -1)) == (2**64 - 1, 64)
    with pytest.raises(ValueError):
        field_counter(_field(pynvml.NVML_VALUE_TYPE_DOUBLE, "dVal", 1.5))


def test_summarize():
    assert summarize(list(range(1, 11))) == {"median": 5.5, "p90": pytest.approx(9.1), "max": 10.0}
    assert summarize([7]) == {"median": 7.0, "p90": 7.0, "max": 7.0}
    assert summarize([]) == {"median": None, "p90": None, "max": None}


def test_wrap_ambiguous():
    # Gen4 x16 moves ~31.5 GB/s: 2**32 bytes take ~136 ms.
    assert wrap_ambiguous(0.1, 32, 4, 16) is False
    assert wrap_ambiguous(0.2, 32, 4, 16) is True
    assert wrap_ambiguous(0.2, 64, 4, 16) is False
    assert wrap_ambiguous(0.2, 32, None, 16) is None


class FakeNvml:
    """One GPU. TX counts up `step` bytes per read from `tx_start` in a `tx_bits` counter; RX as configured."""

    def __init__(self, tx_bits: int, tx_start: int, step: int = 1000, rx: str = "unsupported"):
        self.tx_bits, self.tx, self.step, self.rx_mode = tx_bits, tx_start, step, rx
        self.reads, self.shutdowns, self.lock = 0, 0, threading.Lock()
        self.tx_kbps: list[int] = []

    def __getattr__(self, name):  # constants and NVMLError come from the real module
        return getattr(pynvml, name)

    def nvmlShutdown(self):
        self.shutdowns += 1

    nvmlInit = staticmethod(lambda: None)
    nvmlSystemGetDriverVersion = staticmethod(lambda: "555.42.06")
    nvmlDeviceGetCount = staticmethod(lambda: 1)
    nvmlDeviceGetHandleByIndex = staticmethod(lambda i: i)
    nvmlDeviceGetName = staticmethod(lambda h: "NVIDIA A100-SXM4-80GB")
    nvmlDeviceGetUtilizationRates = staticmethod(lambda h: SimpleNamespace(gpu=90, memory=40))
    nvmlDeviceGetCurrPcieLinkGeneration = nvmlDeviceGetMaxPcieLinkGeneration = staticmethod(lambda h: 4)
    nvmlDeviceGetCurrPcieLinkWidth = nvmlDeviceGetMaxPcieLinkWidth = staticmethod(lambda h: 16)

    def nvmlDeviceGetPcieThroughput(self, h, counter):
        if counter == pynvml.NVML_PCIE_UTIL_RX_BYTES:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        with self.lock:
            self.tx_kbps.append(100 * (len(self.tx_kbps) % 7))
            return self.tx_kbps[-1]

    def nvmlDeviceGetFieldValues(self, h, fields):
        if self.rx_mode == "call_fails":
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        with self.lock:
            if self.reads:
                self.tx = (self.tx + self.step) % 2**self.tx_bits
            self.reads += 1
        if self.tx_bits == 32:
            tx = _field(pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, "uiVal", self.tx)
        else:
            tx = _field(pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, "ullVal", self.tx)
        rx_ret = pynvml.NVML_SUCCESS if self.rx_mode == "ok" else pynvml.NVML_ERROR_NOT_SUPPORTED
        rx = _field(pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, "ullVal", 7, rx_ret)
        return [tx, rx]


def _run(fake: FakeNvml, min_reads: int = 6) -> dict:
    with NvmlSampler(interval_s=0.001, nvml=fake) as s:
        deadline = time.monotonic() + 10
        while fake.reads < min_reads and time.monotonic() < deadline:
            time.sleep(0.002)
    assert fake.shutdowns == 1
    return json.loads(json.dumps(s.result()))


@pytest.mark.parametrize("bits", [32, 64])
def test_sampler_accumulates_across_a_wrap(bits):
    fake = FakeNvml(tx_bits=bits, tx_start=2**bits - 2500)  # wraps between the 3rd and 4th read
    res = _run(fake)
    dev = res["devices"][0]
    assert res["available"] is True and res["sampler_error"] is None and res["driver"] == "555.42.06"
    assert fake.reads >= 6 and dev["counter_reads"] == fake.reads
    assert dev["tx_bytes"] == 1000 * (fake.reads - 1)
    assert dev["counter_bits"]["tx"] == bits


def test_unsupported_fields_and_metrics_are_reported_not_filled():
    dev = _run(FakeNvml(tx_bits=64, tx_start=0))["devices"][0]
    assert dev["counters"] == "unsupported"
    assert dev["rx_bytes"] is None and dev["counter_errors"] == {"tx": None, "rx": "Not Supported"}
    assert dev["tx_bytes"] is not None
    assert dev["errors"] == {"pcie_rx": "Not Supported"}
    assert dev["pcie_rx_kbps"] == {"median": None, "p90": None, "max": None}


def test_whole_field_call_refused():
    dev = _run(FakeNvml(tx_bits=64, tx_start=0, rx="call_fails"), min_reads=0)["devices"][0]
    assert dev["counters"] == "unsupported" and dev["tx_bytes"] is None and dev["rx_bytes"] is None
    assert dev["counter_errors"] == {"tx": "Function Not Found", "rx": "Function Not Found"}


def test_supported_counters_and_summaries():
    fake = FakeNvml(tx_bits=64, tx_start=123, rx="ok")
    with NvmlSampler(interval_s=0.001, nvml=fake) as s:
        deadline = time.monotonic() + 10
        while len(fake.tx_kbps) < 10 and time.monotonic() < deadline:
            time.sleep(0.002)
    dev = s.result()["devices"][0]
    assert dev["counters"] == "nvml_fi" and dev["rx_bytes"] == 0
    assert (dev["name"], dev["pcie_gen"], dev["pcie_width"]) == ("NVIDIA A100-SXM4-80GB", 4, 16)
    assert dev["samples"] == len(fake.tx_kbps)
    assert dev["pcie_tx_kbps"] == summarize(fake.tx_kbps)
    assert dev["util_gpu_pct"] == {"median": 90.0, "p90": 90.0, "max": 90.0}
    assert dev["wrap_ambiguous"] is False


def test_exception_in_block_propagates_and_shuts_down():
    fake = FakeNvml(tx_bits=64, tx_start=0)
    with pytest.raises(RuntimeError, match="boom"), NvmlSampler(interval_s=0.001, nvml=fake):
        raise RuntimeError("boom")
    assert fake.shutdowns == 1


# --- (c) environment --------------------------------------------------------------------------------------------------
def test_capture_environment():
    env = environment.capture_environment()
    for key in ("python", "torch", "deepspeed", "transformers", "git", "hostname", "os", "cpu", "memory_total_bytes"):
        assert key in env, key
    assert env["deepspeed"]["version"] or env["deepspeed"]["error"]
    assert env["cpu"]["model"] and env["cpu"]["allowed_cores"] >= 1 and env["memory_total_bytes"] > 0
    assert env["torch"]["num_threads"] >= 1
    json.dumps(env)
    assert re.fullmatch(r"[a-z0-9][a-z0-9.-]+", env["hardware_id"])
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True)
    assert env["git"]["commit"] == head.stdout.strip()
    assert isinstance(env["git"]["dirty"], bool)
    if _nvml_error_here() is not None:
        assert env["nvml"] == {"available": False, "reason": _nvml_error_here()}
        assert env["hardware_id"].startswith("cpu-scale-")
        assert env["hardware_id"].endswith(f"-{len(os.sched_getaffinity(0))}c")
        assert environment.hardware_label(env).startswith("cpu-scale: ")


def test_the_cpu_generation_is_read_from_cpuinfo(tmp_path):
    """One model name ("AMD EPYC") covered CPUs whose bf16 step differed 7.7x: the record names family, model number
    and the bf16-relevant flags, read from the file's first processor block."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
                       "model name\t: AMD EPYC\nflags\t\t: fpu sse avx2 avx512f avx512_bf16\n\n"
                       "processor\t: 1\ncpu family\t: 6\nmodel\t\t: 1\nflags\t\t: avx2\n")
    assert environment.cpu_generation(str(cpuinfo)) == {"family": 25, "model_number": 17,
                                                         "isa": ["avx2", "avx512f", "avx512_bf16"]}
    assert environment.cpu_generation(str(tmp_path / "absent")) == {"family": None, "model_number": None, "isa": []}
    here = environment.capture_environment(import_deepspeed=False)["cpu"]
    assert set(here) >= {"family", "model_number", "isa"} and set(here["isa"]) <= set(environment.CPU_ISA_FLAGS)


def test_hardware_id_for_a_gpu_host():
    env = {
        "cpu": {"model": "AMD EPYC 7763 64-Core Processor", "allowed_cores": 128},
        "nvml": {"available": True, "driver": "555.42.06", "devices": [{"name": "NVIDIA A100-SXM4-80GB"}] * 4},
    }
    env["nvml"]["devices"] = [d | {"pcie_gen_max": 4} for d in env["nvml"]["devices"]]
    assert environment.hardware_id(env) == "nvidia-a100-sxm4-80gbx4-pcie4-128c-mem-unknown"  # host named too
    env["memory_total_bytes"] = 1024 * 2**30
    assert environment.hardware_id(env) == "nvidia-a100-sxm4-80gbx4-pcie4-128c-1024g"
    label = "4x NVIDIA A100-SXM4-80GB, PCIe gen 4, driver 555.42.06 (host: 128-core AMD EPYC 7763 64-Core Processor)"
    assert environment.hardware_label(env) == label
    env["nvml"] = {"available": False, "reason": "NVML Shared Library Not Found"}
    assert environment.hardware_id(env) == "cpu-scale-amd-epyc-7763-64-core-128c"
