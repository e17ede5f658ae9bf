"""Where a run ran: versions, git commit, host, CPU, memory, GPUs/driver/PCIe link, and a hardware-class id.

Everything is read, not assumed: a fact that cannot be read is None (with the error string where there is one).
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from zenflow.telemetry.nvml import nvml_snapshot

_REPO = Path(__file__).resolve().parents[2]


def _slug(text: str) -> str:
    """Lower-case, filesystem-safe; (R)/(TM), 'CPU', 'Processor' and '@ clock' are noise, other junk runs -> '-'."""
    text = re.sub(r"\((r|tm)\)|\b(cpu|processor)\b|@.*$", " ", text.lower())
    return re.sub(r"[^a-z0-9.]+", "-", text).strip("-.") or "unknown"


def _proc_field(path: str, key: str) -> str | None:
    """First `key : value` line of a /proc file (cpuinfo, meminfo); None where the file or key is absent."""
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() == key:
                    return value.strip()
    except OSError:
        return None
    return None


# The flags that decide which bf16 matmul and copy kernels a CPU runs. Two VMs both named "AMD EPYC" ran the same
# cpu-scale step 7.7x apart (ds-zero-offload 340 ms on 2026-11-27, 2613 ms on 2026-11-29, family 25 model 1 with
# AVX2 only), so a record names the generation beside the model name.
CPU_ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_generation(cpuinfo: str = "/proc/cpuinfo") -> dict[str, Any]:
    """What the model name leaves out: `family` and `model_number` (integers, None where not known) and `isa`, the
    CPU_ISA_FLAGS this CPU has (an empty list where /proc/cpuinfo says none or is absent)."""
    def number(key: str) -> int | None:
        value = _proc_field(cpuinfo, key)
        return int(value) if value and value.isdigit() else None

    flags = set((_proc_field(cpuinfo, "flags") or "").split())
    return {"family": number("cpu family"), "model_number": number("model"),
            "isa": [flag for flag in CPU_ISA_FLAGS if flag in flags]}


GIT_COMMIT_VAR = "ZENFLOW_GIT_COMMIT"  # the commit of a copied tree without .git (a GPU host's copy: gpu_window.py)


def _git(repo: Path = _REPO) -> dict[str, Any]:
    """HEAD commit and dirty flag of the project checkout; when `repo` is not itself a git work tree, the commit
    $ZENFLOW_GIT_COMMIT names (the tree was copied without .git: dirty unknown), else None."""
    told = os.environ.get(GIT_COMMIT_VAR) or None

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=10)

    try:
        top = git("rev-parse", "--show-toplevel")
        # An installed copy (site-packages inside some other repo's venv) must not report that repo's commit.
        if top.returncode != 0 or Path(top.stdout.strip()).resolve() != repo.resolve():
            error = top.stderr.strip() or "not the project's own checkout"
            error += f" (commit from ${GIT_COMMIT_VAR})" if told else ""
            return {"commit": told, "dirty": None, "error": error}
        head, status = git("rev-parse", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError) as e:
        return {"commit": told, "dirty": None, "error": str(e)}
    # Tracked changes only: untracked outputs (results/, caches) would otherwise mark every run dirty.
    dirty = bool(status.stdout.strip()) if status.returncode == 0 else None
    return {"commit": head.stdout.strip() or None, "dirty": dirty, "error": head.stderr.strip() or None}


def git_commit(repo: Path = _REPO) -> str | None:
    """The checkout's HEAD commit, or $ZENFLOW_GIT_COMMIT where the tree was copied without .git; else None."""
    return _git(repo)["commit"]


@functools.lru_cache(maxsize=1)
def _deepspeed() -> tuple[tuple[str, Any], ...]:
    # A real import, not package metadata, so a broken install shows here. It takes ~2 s and prints an accelerator
    # warning line, hence once per process (cached, returned as a tuple so callers cannot mutate the cache).
    try:
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        return (("version", deepspeed.__version__), ("accelerator", get_accelerator().device_name()), ("error", None))
    except Exception as e:  # any import failure is a fact to record, not a reason to fail the run
        return (("version", None), ("accelerator", None), ("error", f"{type(e).__name__}: {e}"))


def _torch() -> dict[str, Any]:
    try:
        import torch
    except Exception as e:
        return {"version": None, "error": f"{type(e).__name__}: {e}"}
    # Note: on a GPU host torch.cuda.get_device_name initialises CUDA in this process (as training will anyway).
    cuda = torch.cuda.is_available()
    return {
        "version": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "num_threads": torch.get_num_threads(),
        "cuda_available": cuda,
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
    }


def _version(package: str) -> str | None:
    try:  # installed metadata: importing transformers just for its version would cost seconds
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _deepspeed_installed() -> dict[str, Any]:
    """DeepSpeed's version from its installed metadata, without importing it (seconds and an accelerator probe that
    a run of a non-DeepSpeed engine does not need)."""
    return {"version": _version("deepspeed"), "accelerator": None, "error": None, "imported": False}


def capture_environment(import_deepspeed: bool = True) -> dict[str, Any]:
    """JSON-serialisable facts about this process's software and hardware, plus `hardware_id`. `import_deepspeed`:
    import it to record its accelerator and whether it imports (a DeepSpeed run, the window's facts), or read its
    version from the installed metadata only (every other run child)."""
    try:
        allowed = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        allowed = os.cpu_count()
    mem_kb = _proc_field("/proc/meminfo", "MemTotal")
    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "python_executable": sys.executable,
        "torch": _torch(),
        "deepspeed": dict(_deepspeed()) if import_deepspeed or "deepspeed" in sys.modules else _deepspeed_installed(),
        "transformers": _version("transformers"),
        "git": _git(),
        "hostname": socket.gethostname(),
        "os": {"system": platform.system(), "release": platform.release(), "platform": platform.platform()},
        "cpu": {
            "model": _proc_field("/proc/cpuinfo", "model name") or platform.processor() or platform.machine(),
            "logical_cores": os.cpu_count(),
            "allowed_cores": allowed,
            **cpu_generation(),
        },
        "memory_total_bytes": int(mem_kb.split()[0]) * 1024 if mem_kb else None,
        "nvml": nvml_snapshot(),
    }
    env["hardware_id"] = hardware_id(env)
    return env


def visible_gpus(env: dict[str, Any]) -> list[dict[str, Any]]:
    """NVML's facts of the GPUs this process's torch uses, in torch's order (matched by PCI bus id):
    a 1-GPU job on an 8-GPU host has one. Records from before the mapping (no `cuda_index`) list every GPU NVML
    saw. Where NVML does not answer or cannot match them: torch's device names, link unknown."""
    nvml = env.get("nvml") or {}
    devices = (nvml.get("devices") or []) if nvml.get("available") else []
    if devices and all("cuda_index" not in d for d in devices):
        return devices
    mapped = sorted((d for d in devices if d.get("cuda_index") is not None), key=lambda d: d["cuda_index"])
    return mapped or [{"name": n} for n in (env.get("torch") or {}).get("cuda_devices") or []]


def _gpus(env: dict[str, Any]) -> tuple[list[str], int | None]:
    """Names and max PCIe gen of the GPUs the run uses (gen None where NVML did not report it)."""
    devices = visible_gpus(env)
    gens = [d["pcie_gen_max"] for d in devices if d.get("pcie_gen_max")]
    return [d.get("name") or "unknown-gpu" for d in devices], max(gens) if gens else None


def hardware_id(env: dict[str, Any]) -> str:
    """Short filesystem-safe hardware class: 'cpu-scale-<cpu>-<n>c' or '<gpu>x<count>-pcie<gen>-<n>c-<m>g', counting
    only the GPUs this process uses; a process whose torch cannot use CUDA ran on the CPU and is 'cpu-scale'.
    A GPU id names the host's cores and memory (GiB, rounded) too: offload engines are host-bound, so a 16-core
    128 GiB VM and a 128-core 1 TB node must not share a results folder or a benchmark baseline.
    cpu-scale ids name the cores already (the device is the host)."""
    names, gen = _gpus(env)
    if not names:
        return f"cpu-scale-{_slug(env['cpu']['model'] or 'unknown')}-{env['cpu']['allowed_cores']}c"
    # Mixed GPU models are listed in order, each with its count, so two such hosts compare equal only if they match.
    parts = [f"{_slug(n)}x{names.count(n)}" for n in dict.fromkeys(names)]
    memory = env.get("memory_total_bytes")
    host = f"-{env['cpu']['allowed_cores']}c-" + (f"{round(memory / 2**30)}g" if memory else "mem-unknown")
    return "-".join(parts) + (f"-pcie{gen}" if gen else "-pcie-unknown") + host


def hardware_label(env: dict[str, Any]) -> str:
    """Human-readable hardware line for reports."""
    info = env.get("cpu") or {}  # none in a set of skipped runs, with no window facts beside it
    model = re.sub(r"\s*\((R|TM)\)", "", info.get("model") or "unknown CPU")
    cpu = f"{info.get('allowed_cores', '?')}-core {model}"
    names, gen = _gpus(env)
    if not names:
        return f"cpu-scale: {cpu} (no GPU)"
    gpus = ", ".join(f"{names.count(n)}x {n}" for n in dict.fromkeys(names))
    driver = (env.get("nvml") or {}).get("driver")
    return f"{gpus}, PCIe gen {gen or '?'}, driver {driver or '?'} (host: {cpu})"
