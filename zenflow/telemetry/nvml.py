"""NVML telemetry: per-GPU PCIe throughput, utilization and cumulative PCIe byte counters from a sampler thread.

Nothing is estimated. Without a driver the result is `{"available": False, "reason": <NVML's own error string>}`;
a metric or counter field the GPU refuses is marked unsupported with NVML's string, never filled in. TX/RX follow
NVML's naming (the GPU's end of the link).

Which GPUs: the ones this process's torch can use (CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER applied), matched to
NVML by PCI bus id (NVML numbers GPUs by PCI order and ignores CUDA_VISIBLE_DEVICES). Without CUDA in
torch the sampler covers every GPU NVML sees and says so (`scope`).
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time
from typing import Any

import pynvml

# Usable bytes/s per lane (after line coding) by PCIe generation. Used only to flag a sampling gap long enough for a
# counter to wrap more than once, which a delta cannot see (it would silently come out short).
_LANE_BYTES_PER_S = {1: 0.25e9, 2: 0.5e9, 3: 0.985e9, 4: 1.969e9, 5: 3.938e9, 6: 7.563e9}
_SERIES = ("pcie_tx_kbps", "pcie_rx_kbps", "util_gpu_pct", "util_mem_pct")  # sampled per tick, summarised at the end


def counter_delta(start: int, end: int, bits: int = 64) -> int:
    """Bytes counted between two reads of a free-running `bits`-wide counter; `end < start` means it wrapped once."""
    modulus = 1 << bits
    if not (0 <= start < modulus and 0 <= end < modulus):
        raise ValueError(f"counter reads {start}, {end} do not fit in {bits} bits")
    return end - start if end >= start else end + modulus - start


def quantile(values: list[float], q: float) -> float:
    """Linear-interpolated quantile (numpy's default method) of a non-empty list."""
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo, hi = int(pos), min(int(pos) + 1, len(xs) - 1)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


def summarize(values: list[float]) -> dict[str, float | None]:
    """{"median", "p90", "max"} of samples; all None when there are none (nothing is invented for an empty run)."""
    if not values:
        return {"median": None, "p90": None, "max": None}
    return {"median": quantile(values, 0.5), "p90": quantile(values, 0.9), "max": float(max(values))}


# nvmlValueType_t -> (union member, width in bits). The width decides where the counter wraps, so it is taken from the
# type NVML reports for each read rather than assumed; c_ulong is 32 bits on Windows and 64 on Linux.
_VALUE_MEMBERS: dict[int, tuple[str, int]] = {
    pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: ("uiVal", 32),
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: ("ulVal", 8 * ctypes.sizeof(ctypes.c_ulong)),
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: ("ullVal", 64),
    pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: ("sllVal", 64),
    pynvml.NVML_VALUE_TYPE_SIGNED_INT: ("siVal", 32),
    pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT: ("usVal", 16),
}


def field_counter(field: Any) -> tuple[int, int]:
    """(value, width in bits) of one nvmlFieldValue_t, read through the union member its `valueType` names."""
    if field.valueType not in _VALUE_MEMBERS:  # a double (or unknown type) is not a byte counter
        raise ValueError(f"field {field.fieldId} has non-counter valueType {field.valueType}")
    member, bits = _VALUE_MEMBERS[field.valueType]
    # Signed members are reinterpreted as the unsigned bit pattern so wrap arithmetic stays modular.
    return int(getattr(field.value, member)) & ((1 << bits) - 1), bits


def wrap_ambiguous(max_gap_s: float, bits: int | None, gen: int | None, width: int | None) -> bool | None:
    """True if the link could move >= 2**bits bytes in the longest gap between reads; None if bits/gen/width unknown."""
    per_lane = _LANE_BYTES_PER_S.get(gen or 0)
    return None if per_lane is None or not width or not bits else max_gap_s * per_lane * width >= (1 << bits)


TORCH_VISIBLE = "torch-visible"  # default of `bus_ids`: ask torch which GPUs this process uses


def pci_bus_id(domain: int, bus: int, device: int) -> str:
    """A PCI address as NVML spells it ("00000000:3b:00.0", function 0), from torch's integer device properties."""
    return f"{domain:08x}:{bus:02x}:{device:02x}.0"


def torch_pci_bus_ids() -> list[str | None] | None:
    """PCI bus id of each CUDA device this process can use, in torch's order; None when torch cannot use CUDA.
    An entry is None where this torch does not report PCI ids. Initialises CUDA in this process."""
    import torch

    if not torch.cuda.is_available():
        return None
    ids: list[str | None] = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        bus = getattr(p, "pci_bus_id", None)
        ids.append(None if bus is None else pci_bus_id(getattr(p, "pci_domain_id", 0), bus,
                                                       getattr(p, "pci_device_id", 0)))
    return ids


def visible_handles(nv: Any, bus_ids: list[str | None]) -> tuple[list[tuple[int, int, Any, str]], list[str]]:
    """(cuda index, NVML index, handle, bus id) of each of torch's devices NVML finds by PCI bus id, and an error
    line for each it does not find (never guessed by index: NVML's and CUDA's orders differ)."""
    found, errors = [], []
    for cuda_index, bus in enumerate(bus_ids):
        if bus is None:
            errors.append(f"cuda:{cuda_index}: torch reports no PCI bus id")
            continue
        try:
            handle = nv.nvmlDeviceGetHandleByPciBusId(bus)
            found.append((cuda_index, nv.nvmlDeviceGetIndex(handle), handle, bus))
        except nv.NVMLError as e:
            errors.append(f"cuda:{cuda_index} (PCI {bus}): {e}")
    return found, errors


def counter_support(nv: Any, handle: Any) -> dict[str, str | None]:
    """Whether the GPU answers the PCIe byte counter fields (197 TX, 198 RX; driver R555+): None = supported,
    else NVML's error string."""
    fields = [nv.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, nv.NVML_FI_DEV_PCIE_COUNT_RX_BYTES]
    try:
        reads = [fv.nvmlReturn for fv in nv.nvmlDeviceGetFieldValues(handle, fields)]
    except nv.NVMLError as e:
        return {"tx": str(e), "rx": str(e)}
    return {k: None if ret == nv.NVML_SUCCESS else str(nv.NVMLError(ret)) for k, ret in zip(("tx", "rx"), reads)}


def _device_facts(nv: Any, handle: Any, index: int) -> dict[str, Any]:
    """Name and PCIe link (current and max) of one GPU; a refused query leaves None plus NVML's string in errors."""
    facts: dict[str, Any] = {"index": index, "errors": {}}
    queries = {
        "name": nv.nvmlDeviceGetName,
        "pcie_gen": nv.nvmlDeviceGetCurrPcieLinkGeneration,
        "pcie_width": nv.nvmlDeviceGetCurrPcieLinkWidth,
        "pcie_gen_max": nv.nvmlDeviceGetMaxPcieLinkGeneration,
        "pcie_width_max": nv.nvmlDeviceGetMaxPcieLinkWidth,
    }
    for key, fn in queries.items():
        try:
            facts[key] = fn(handle)
        except nv.NVMLError as e:
            facts[key], facts["errors"][key] = None, str(e)
    return facts


def nvml_snapshot(nvml: Any = None, bus_ids: list[str | None] | None | str = TORCH_VISIBLE) -> dict[str, Any]:
    """Static facts read once: driver, and per GPU on the host its name, PCIe link gen/width (current and max),
    PCIe counter support, and `cuda_index` (its index in this process's torch, None if torch does not use it).
    `bus_ids`: torch's devices' PCI bus ids (default: asked from torch; None: torch has no CUDA)."""
    nv = pynvml if nvml is None else nvml
    try:
        nv.nvmlInit()
    except nv.NVMLError as e:
        return {"available": False, "reason": str(e)}
    try:
        ids = torch_pci_bus_ids() if bus_ids == TORCH_VISIBLE else bus_ids
        visible, errors = visible_handles(nv, ids) if ids is not None else ([], [])
        cuda_of = {nvml_index: (cuda_index, bus) for cuda_index, nvml_index, _, bus in visible}
        devices = []
        for i in range(nv.nvmlDeviceGetCount()):
            handle = nv.nvmlDeviceGetHandleByIndex(i)
            cuda_index, bus = cuda_of.get(i, (None, None))
            devices.append(_device_facts(nv, handle, i) | {"cuda_index": cuda_index, "pci_bus_id": bus,
                                                           "pcie_counters": counter_support(nv, handle)})
        return {"available": True, "reason": None, "driver": nv.nvmlSystemGetDriverVersion(), "devices": devices,
                "torch_cuda": ids is not None, "mapping_errors": errors}
    except nv.NVMLError as e:
        return {"available": False, "reason": str(e)}
    finally:
        with contextlib.suppress(nv.NVMLError):
            nv.nvmlShutdown()


class NvmlSampler:
    """`with NvmlSampler() as s: ...; s.result()`. Pass `nvml=` only to substitute a recorded fake in tests."""

    def __init__(self, device_indices: list[int] | None = None, interval_s: float = 0.05, nvml: Any = None,
                 bus_ids: list[str | None] | None | str = TORCH_VISIBLE, rates: bool = True) -> None:
        """`device_indices`: NVML indices to sample; default: the GPUs this process's torch uses, found by PCI bus
        id (`bus_ids`, asked from torch unless given; None: torch has no CUDA, so every GPU, scope "all").
        `rates=False`: read only the byte counters (no throughput, utilisation or link queries, which block ~20 ms
        each), so the gap between two counter reads stays near `interval_s` (the PCIe check's wrap safety)."""
        self._nv = pynvml if nvml is None else nvml
        self._rates = rates
        self._indices, self._interval, self._bus_ids = device_indices, interval_s, bus_ids
        self._scope: str | None = None  # "explicit" | "visible" | "all" (which GPUs were sampled, and why)
        self._mapping_errors: list[str] = []
        self._reason: str | None = "sampler not started"
        self._driver: str | None = None  # NVML's driver version string, once initialised
        self._devs: list[dict[str, Any]] = []
        self._stop, self._initialised = threading.Event(), False
        self._thread: threading.Thread | None = None
        self._thread_error: str | None = None  # an unexpected exception in the sampler thread, reported in result()

    def __enter__(self) -> NvmlSampler:
        nv = self._nv
        try:
            nv.nvmlInit()
            self._initialised = True
            self._driver = nv.nvmlSystemGetDriverVersion()
            for cuda_index, i, handle, bus in self._targets():
                dev = _device_facts(nv, handle, i) | {"handle": handle, "cuda_index": cuda_index, "pci_bus_id": bus}
                dev.update({k: [] for k in _SERIES}, ticks=0, reads=0, max_gap_s=0.0, last_t=None)
                dev["counter"] = {k: {"last": None, "total": 0, "bits": None, "error": None} for k in ("tx", "rx")}
                self._devs.append(dev)
        except nv.NVMLError as e:
            self._reason = str(e)
            return self
        self._reason = None
        self._read_counters()  # baseline; the final read happens in __exit__
        self._thread = threading.Thread(target=self._run, name="nvml-sampler", daemon=True)
        self._thread.start()
        return self

    def _targets(self) -> list[tuple[int | None, int, Any, str | None]]:
        """(cuda index, NVML index, handle, bus id) of the GPUs to sample; sets the scope that says why these."""
        nv = self._nv
        if self._indices is not None:
            self._scope = "explicit"
            return [(None, i, nv.nvmlDeviceGetHandleByIndex(i), None) for i in self._indices]
        ids = torch_pci_bus_ids() if self._bus_ids == TORCH_VISIBLE else self._bus_ids
        if ids is None:  # the run does not use a GPU: report every GPU on the host, labelled as such
            self._scope = "all"
            return [(None, i, nv.nvmlDeviceGetHandleByIndex(i), None) for i in range(nv.nvmlDeviceGetCount())]
        self._scope = "visible"
        found, self._mapping_errors = visible_handles(nv, ids)
        return found

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            if self._reason is None:
                self._read_counters()  # closes the counting window
        except Exception as e:  # reported in result(); sampler trouble must not mask the run's own exception
            self._thread_error = self._thread_error or f"{type(e).__name__}: {e}"
        if self._initialised:
            with contextlib.suppress(self._nv.NVMLError):
                self._nv.nvmlShutdown()

    def _run(self) -> None:
        try:
            while True:
                if not self._rates:  # counters only: one read of every GPU per tick
                    self._read_counters()
                else:
                    for dev in self._devs:
                        # Counters are re-read before each GPU's rate queries: nvmlDeviceGetPcieThroughput blocks
                        # ~20 ms per direction, and with several GPUs a 32-bit counter could otherwise wrap unseen.
                        self._read_counters()
                        self._sample_rates(dev)
                if self._stop.wait(self._interval):
                    return
        except Exception as e:  # a sampler bug must not kill the run; it is reported in the result
            self._thread_error = f"{type(e).__name__}: {e}"

    def _read_counters(self) -> None:
        nv = self._nv
        fields = [nv.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, nv.NVML_FI_DEV_PCIE_COUNT_RX_BYTES]
        for dev in self._devs:
            counters = [dev["counter"]["tx"], dev["counter"]["rx"]]
            if all(c["error"] is not None for c in counters):
                continue
            now, got = time.perf_counter(), False
            try:  # each entry carries its own nvmlReturn: one field can be refused while the other is read
                reads = [(fv.nvmlReturn, fv) for fv in nv.nvmlDeviceGetFieldValues(dev["handle"], fields)]
            except nv.NVMLError as e:  # the whole call refused (e.g. Function Not Found on an old driver)
                reads = [(e.value, None)] * 2
            for c, (ret, fv) in zip(counters, reads):
                if c["error"] is not None:
                    continue
                if ret != nv.NVML_SUCCESS:
                    if c["last"] is None:  # refused on first read: unsupported (needs driver R555+, GPU support)
                        c["error"] = str(nv.NVMLError(ret))
                    continue  # a later transient failure only lengthens the gap, which max_gap_s reports
                try:
                    value, c["bits"] = field_counter(fv)
                except ValueError as e:  # not an integer counter: report it rather than guess a width
                    c["error"] = str(e)
                    continue
                if c["last"] is not None:
                    c["total"] += counter_delta(c["last"], value, c["bits"])
                c["last"], got = value, True
            if got:
                if dev["last_t"] is not None:
                    dev["max_gap_s"] = max(dev["max_gap_s"], now - dev["last_t"])
                dev["last_t"], dev["reads"] = now, dev["reads"] + 1

    def _sample_rates(self, dev: dict[str, Any]) -> None:
        nv, h, err = self._nv, dev["handle"], dev["errors"]
        link_gen, link_width = nv.nvmlDeviceGetCurrPcieLinkGeneration, nv.nvmlDeviceGetCurrPcieLinkWidth
        dev["ticks"] += 1
        probes = {
            "pcie_tx": lambda: {"pcie_tx_kbps": nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_TX_BYTES)},
            "pcie_rx": lambda: {"pcie_rx_kbps": nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_RX_BYTES)},
            "util": lambda: {"util_gpu_pct": (u := nv.nvmlDeviceGetUtilizationRates(h)).gpu, "util_mem_pct": u.memory},
            # An idle GPU trains its link down, so the gen/width that carried traffic is the highest seen.
            "link": lambda: {"pcie_gen": link_gen(h), "pcie_width": link_width(h)},
        }
        for key, probe in probes.items():
            if key in err:  # refused once: reported, not retried (a retry would only thin the series unevenly)
                continue
            try:
                for name, v in probe().items():
                    if isinstance(dev[name], list):
                        dev[name].append(v)
                    else:
                        dev[name] = max(dev[name] or 0, v)
            except nv.NVMLError as e:
                err[key] = str(e)

    def result(self) -> dict[str, Any]:
        """Plain JSON-serialisable summary; call after the `with` block."""
        if self._reason is not None:
            return {"available": False, "reason": self._reason, "driver": self._driver, "devices": []}
        out = {"available": True, "reason": None, "driver": self._driver, "interval_s": self._interval,
               "rates": self._rates, "scope": self._scope, "mapping_errors": list(self._mapping_errors)}
        return out | {"sampler_error": self._thread_error, "devices": [self._device_result(d) for d in self._devs]}

    @staticmethod
    def _device_result(d: dict[str, Any]) -> dict[str, Any]:
        tx, rx = d["counter"]["tx"], d["counter"]["rx"]
        valid = {k: c["error"] is None and c["last"] is not None for k, c in d["counter"].items()}
        bits = max(tx["bits"] or 0, rx["bits"] or 0)
        keys = ("index", "cuda_index", "pci_bus_id", "name", "pcie_gen", "pcie_width", "pcie_gen_max", "pcie_width_max")
        return {k: d[k] for k in keys} | {
            "tx_bytes": tx["total"] if valid["tx"] else None,
            "rx_bytes": rx["total"] if valid["rx"] else None,
            "counters": "nvml_fi" if all(valid.values()) else "unsupported",
            "counter_bits": {"tx": tx["bits"], "rx": rx["bits"]},
            "counter_errors": {"tx": tx["error"], "rx": rx["error"]},
            "counter_reads": d["reads"],
            "counter_max_gap_s": d["max_gap_s"],
            # the fastest the link can run (its maximum, else the fastest seen): an idle link trains down, and
            # without rate sampling the current gen is only read once, at the start
            "wrap_ambiguous": wrap_ambiguous(d["max_gap_s"], bits, max(d["pcie_gen"] or 0, d["pcie_gen_max"] or 0),
                                             max(d["pcie_width"] or 0, d["pcie_width_max"] or 0)),
            "samples": d["ticks"],
            **{k: summarize(d[k]) for k in _SERIES},
            "errors": dict(d["errors"]),
        }
