"""The memory plan: what each engine needs of the device and the host for a workload, checked before any run.

Every figure comes from the model's shape (no model is built) and the formula of what each engine allocates (its
registry row's memory function, engines/memory.py):

- ours (ref-offload, ref-offload-gas, ref-zenflow): `zenflow.host.host_bytes`, the same function the optimizer's
  `host_state_bytes` is tested against (fp32 master, moments and accumulators of the host-owned columns only, the
  pinned staging as one arena, no power-of-two rounding);
- DeepSpeed and the PyTorch peers: the buffers their sources allocate (read from their sources), with
  torch's pinned-memory rounding to a power of two applied per allocation, as CachingHostAllocator does;
- every run child: the measured resident set of a process that imported what a run imports (`process_base_bytes`),
  plus the fp32 random init of the model on the host (the build peak), or the steady state if that is larger;
  where the device is the CPU, also what the allocator keeps of the gradients freed every step
  (`retained_gradients`).

`plan(...)` gives one `Need` per engine and `Host.measure()` what this host has (MemAvailable and the cgroup
limit); `fits()` says why a run would not fit, in one line, so the harness writes a `skipped` record in seconds
instead of a child dying minutes later as "CUDA error: out of memory" or SIGKILL. Times per step are rough planning
figures from stated rates (ROUGH_RATES), labelled as such; the run records hold the measured ones.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from zenflow.harness.engines.memory import (  # noqa: F401  (our_host_bytes, pow2: re-exported, the tests read them here)
    MemoryInputs,
    our_host_bytes,
    pow2,
)
from zenflow.harness.engines.registry import engine_spec, is_deepspeed
from zenflow.harness.local_inputs import model_folder
from zenflow.harness.workloads import CPU_SCALE_VOCAB, RANDOM_MODELS, Workload

GiB = 2**30
CUDA_CONTEXT = GiB  # host memory of a CUDA context and its libraries (planning a GPU host from a CPU one)
NEEDS = "needs ~"  # how every verdict of fits() starts: reports/scenario.py tells a "does not fit" skip by it
WINDOW_S = 570  # one command of a device window: 10 minutes, less a margin for start-up and the copy back
HEADROOM = 0.95  # a run may use this share of what is available (the rest: page cache, fragmentation, the parent)
DEFAULT_MARGIN = 0.75  # the default --layers leaves a quarter of host and device free: estimates can be 25% low
# Rough planning rates (stated, not measured): the run records hold the measured step times.
ROUGH_RATES = {"gpu_tflops": 400.0,   # bf16 dense, achieved (H100 989 peak × ~0.4)
               "host_gbps": 40.0,     # host memory traffic of the optimizer's cores (estimated 35-55 GB/s)
               "link_gbps": 25.0,     # pinned PCIe copies, one direction
               "init_ns_per_param": 12.0}  # random init + cast on the host (1-1.5 min at 6.7B)
CPU_DEVICE_RATES = {"gpu_tflops": 0.2, "host_gbps": 5.0, "link_gbps": 5.0, "init_ns_per_param": 12.0}


@dataclass(frozen=True)
class ModelShape:
    """A Llama-architecture decoder: what the plan needs to count parameters per buffer."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    tied: bool = False
    frozen_embedding: bool = False

    @classmethod
    def from_workload(cls, workload: dict[str, Any]) -> ModelShape:
        """The shape of a workload dict (reproduce/llama7b.py's): the random-weight builders' fields, or a local
        model folder's config.json."""
        w = Workload(**{k: v for k, v in workload.items() if k in Workload.__dataclass_fields__})
        if w.model in RANDOM_MODELS:
            return cls(CPU_SCALE_VOCAB, w.hidden, w.intermediate, w.layers, w.heads, w.heads,
                       frozen_embedding=w.freeze_embedding)
        config = _local_config(w.model)
        heads = config["num_attention_heads"]
        return cls(config["vocab_size"], config["hidden_size"], config["intermediate_size"],
                   config["num_hidden_layers"], heads, config.get("num_key_value_heads") or heads,
                   bool(config.get("tie_word_embeddings", False)), w.freeze_embedding)

    def matrices(self) -> list[int]:
        """Element counts of the trainable 2-D weights (column params), one entry per tensor."""
        h, kv = self.hidden, self.hidden * self.kv_heads // self.heads
        per_layer = [h * h, kv * h, kv * h, h * h, self.intermediate * h, self.intermediate * h,
                     h * self.intermediate]
        embedding = [] if self.frozen_embedding else [self.vocab * h]
        head = [] if self.tied else [self.vocab * h]
        return embedding + per_layer * self.layers + head

    @property
    def column_params(self) -> int:
        return sum(self.matrices())

    @property
    def root_params(self) -> int:
        """The weights outside the decoder layers: the embedding and the head (FSDP2's root group)."""
        embedding = 0 if self.frozen_embedding else self.vocab * self.hidden
        return embedding + (0 if self.tied else self.vocab * self.hidden)

    @property
    def dense_params(self) -> int:
        return (2 * self.layers + 1) * self.hidden  # two RMSNorms per layer and the final one

    @property
    def params(self) -> int:
        """Trainable parameters."""
        return self.column_params + self.dense_params

    @property
    def all_params(self) -> int:
        """Every parameter the model holds (a frozen embedding too)."""
        return self.params + (self.vocab * self.hidden if self.frozen_embedding else 0)

    def widths(self) -> list[int]:
        """Column count (`in`) of every column param, in matrices() order."""
        h = self.hidden
        per_layer = [h, h, h, h, h, h, self.intermediate]
        return ([] if self.frozen_embedding else [h]) + per_layer * self.layers + ([] if self.tied else [h])


@dataclass(frozen=True)
class Need:
    """One engine's estimate: bytes on the device, pinned and pageable on the host (one run, every process)."""

    engine: str
    device: int
    pinned: int
    pageable: int
    step_s: float
    init_s: float
    note: str = ""
    shm: int = 0  # of `pageable`, the bytes in /dev/shm

    @property
    def host(self) -> int:
        return self.pinned + self.pageable

    def run_s(self, steps: int) -> float:
        return self.init_s + steps * self.step_s


@dataclass
class Host:
    """What this host can give a run: host bytes available, device bytes (None: the device is the CPU), free bytes
    of /dev/shm (None: not checked)."""

    available: int
    device_total: int | None
    source: str
    notes: list[str] = field(default_factory=list)
    shm_free: int | None = None

    @classmethod
    def measure(cls, cuda: bool) -> Host:
        """MemAvailable, capped by the cgroup's limit minus its usage (a container's OOM killer acts on that)."""
        available = _meminfo("MemAvailable")
        source = f"MemAvailable {available / GiB:.1f} GiB"
        limit = _cgroup_room()
        if limit is not None and limit < available:
            available, source = limit, f"{source}, cgroup room {limit / GiB:.1f} GiB"
        device = None
        if cuda:
            import torch

            device = torch.cuda.get_device_properties(0).total_memory
        return cls(available, device, source, shm_free=shm_free())

    @classmethod
    def stated(cls, host_gib: float, measured: Host) -> Host:
        """This host, with its memory as stated instead of MemAvailable: a microVM's RAM starts small and grows as
        it is used (the lent GPU hosts: size from the kind's stated memory). Device and /dev/shm
        stay measured."""
        return cls(int(host_gib * GiB), measured.device_total, f"stated host: {host_gib:g} GiB ({measured.source} "
                   "at the start)", shm_free=measured.shm_free)

    @classmethod
    def simulated(cls, host_gib: float, device_gib: float | None) -> Host:
        device = int(device_gib * GiB) if device_gib else None
        return cls(int(host_gib * GiB), device, f"simulated host: {host_gib:g} GiB")


def plan(engines: list[str], shape: ModelShape, dtype_bytes: int, cuda: bool, block: dict[str, Any],
         seq_len: int, micro_batch: int, base: int) -> list[Need]:
    """One Need per engine for one rank: device, pinned and pageable bytes (pinned is 0 where the device is the
    CPU: nothing is pinned there, and the "device" tensors are host memory, counted as pageable)."""
    return [estimate(e, shape, dtype_bytes, cuda, block, seq_len, micro_batch, base) for e in engines]


def estimate(engine: str, shape: ModelShape, b: int, cuda: bool, block: dict[str, Any], seq_len: int,
             micro_batch: int, base: int) -> Need:
    """One engine's Need: its registry row's footprint (pinned is 0 where the device is the CPU: nothing is pinned
    there, and the "device" tensors are host memory, counted as pageable), the process base and the build peak."""
    spec = engine_spec(engine)
    topk = block.get("topk_ratio", 0.1)
    U = block.get("update_interval", 4) if isinstance(block.get("update_interval", 4), int) else 4
    acts = activation_bytes(shape, seq_len, micro_batch, b)
    held = spec.footprint(MemoryInputs(shape, b, cuda, spec.own_block(block) or {}, acts, base))
    device, pinned, pageable = held.device, held.pinned, held.pageable
    if not cuda:  # the device is the CPU: its tensors are host memory, nothing is pinned
        pageable, pinned, device = pageable + pinned + device + retained_gradients(shape, b), 0, 0
    build = 4 * shape.all_params  # the fp32 random init on the host, before the cast (and the move to the device)
    pageable = base + max(pageable, build)
    rates = ROUGH_RATES if cuda else CPU_DEVICE_RATES
    return Need(engine, int(device), int(pinned), int(pageable), step_seconds(engine, shape, b, U, topk, seq_len *
                                                                                micro_batch, rates),
                15.0 + shape.all_params * rates["init_ns_per_param"] * 1e-9, held.note, int(held.shm))


def retained_gradients(shape: ModelShape, b: int) -> int:
    """What glibc's heap keeps of the gradients freed every step (`zero_grad(set_to_none=True)`) when they are host
    memory: after the first large free its mmap threshold rises (to 32 MiB), so later gradients come from the heap,
    which is not given back at once. Measured on the cpu-scale model (no-offload, 5 steps, 2026-11-29): the peak
    grows by 0.09 GiB over the steps with the default allocator, by 0.003 GiB with a fixed threshold; b·P is
    0.11 GiB. The resident set counts it, so the plan does."""
    return b * shape.params


def step_seconds(engine: str, shape: ModelShape, b: int, U: int, topk: float, tokens: int,
                 rates: dict[str, float]) -> float:
    """Rough: compute 6·P·tokens at the stated rate, plus host optimizer traffic and link bytes (serial), except
    ZenFlow's host work, which overlaps compute. Planning only."""
    spec = engine_spec(engine)
    P = shape.params
    compute = 6 * shape.all_params * tokens / (rates["gpu_tflops"] * 1e12)
    if spec.cycle_rule == "interval":  # ZenFlow: the unselected columns, every U steps, beside compute
        host = (1 - topk) * P * (10 + 34 / U) / (rates["host_gbps"] * 1e9)
        link = (1 - topk) * b * P * (1 + 1 / U) / (rates["link_gbps"] * 1e9)
        return max(compute + link, host)
    every = U if spec.cycle_rule == "accumulation" else 1  # -gas: one host update every U steps
    host_per_param = 40.0 * spec.host_share / every
    link = 0.0 if spec.host_share == 0 else 2 * b * P / every
    return compute + host_per_param * P / (rates["host_gbps"] * 1e9) + link / (rates["link_gbps"] * 1e9)


def activation_bytes(shape: ModelShape, seq_len: int, micro_batch: int, b: int) -> int:
    """Activations kept for backward without recomputation (Korthikanti et al.'s 34·s·h + 5·a·s² per layer, in
    16-bit units), plus the fp32 logits and their gradient."""
    s, h, a = seq_len * micro_batch, shape.hidden, shape.heads
    per_layer = (34 * s * h + 5 * a * seq_len * s) * b // 2
    return shape.layers * per_layer + 3 * 4 * s * shape.vocab


def fits(need: Need, host: Host, headroom: float = HEADROOM) -> str | None:
    """Why `need` does not fit `host` (using `headroom` of it), in one line, or None."""
    room = int(host.available * headroom)
    if need.host > room:
        return (f"{NEEDS}{need.host / GiB:.1f} GiB host ({need.pinned / GiB:.1f} pinned + "
                f"{need.pageable / GiB:.1f} pageable), {host.available / GiB:.1f} available ({host.source})")
    if host.device_total is not None and need.device > host.device_total * headroom:
        return f"{NEEDS}{need.device / GiB:.1f} GiB on the device, {host.device_total / GiB:.1f} there"
    if host.shm_free is not None and need.shm > host.shm_free * headroom:
        return f"{NEEDS}{need.shm / GiB:.1f} GiB in /dev/shm, {host.shm_free / GiB:.1f} free there"
    return None


def process_base_bytes(engines: list[str], cuda: bool) -> int:
    """Measured: the peak resident set of a fresh interpreter that imports what a run child imports (and starts
    CUDA where the runs will), the part of every run's host memory that does not depend on the model."""
    imports = ("import torch, transformers, zenflow.harness.session, zenflow.harness.engines.build\n"
               "from transformers import LlamaForCausalLM")
    if any(is_deepspeed(e) for e in engines):
        imports += "\ntry:\n    import deepspeed\nexcept Exception:\n    pass"
    code = (f"{imports}\nfrom zenflow.harness.session import peak_rss_bytes\n"
            + ("torch.zeros(1, device='cuda')\n" if cuda else "") + "print(peak_rss_bytes())")
    env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cuda" if cuda else "cpu")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    lines = out.stdout.strip().splitlines()
    if out.returncode or not lines:
        return 2 * GiB if cuda else GiB  # stated fallback when the probe fails
    return int(lines[-1])


def shm_free(path: str = "/dev/shm") -> int | None:
    """Free bytes of /dev/shm (a tmpfs sized at boot), or None where there is none."""
    return shutil.disk_usage(path).free if os.path.isdir(path) else None


def _meminfo(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/meminfo has no {key}")


def _cgroup_room(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The cgroup's memory limit minus its usage (v2, then v1); None when unlimited or unknown."""
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            limit = (root / limit_file).read_text().strip()
            usage = int((root / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or int(limit) >= 2**60:
            return None
        return int(limit) - usage
    return None


def _local_config(model: str) -> dict[str, Any]:
    """config.json of a local folder, or of a hub id in the local Hugging Face cache; never fetched."""
    folder = model_folder(model)
    if folder is None or not (folder / "config.json").is_file():
        raise FileNotFoundError(f"model {model!r}: no local config.json (not a folder, not in the Hugging Face "
                                "cache)")
    return json.loads((folder / "config.json").read_text())


def render(needs: list[Need], host: Host, steps: int, shape: ModelShape, base: int,
           window_s: float = WINDOW_S) -> str:
    """The plan as a Markdown table: per engine its estimates, its run time and whether it fits the host and the
    command window (`window_s`: plan commands shorter than that)."""
    from tabulate import tabulate

    rows = []
    for n in needs:
        why = fits(n, host)
        run_s = n.run_s(steps)
        verdict = "does not fit: " + why if why else ("fits" if run_s <= window_s else
                                                      f"fits; one run may not finish in {window_s / 60:.1f} min")
        rows.append([n.engine, f"{n.device / GiB:.1f}" if host.device_total else "-", f"{n.pinned / GiB:.1f}",
                     f"{n.pageable / GiB:.1f}", f"{n.host / GiB:.1f}", f"{n.step_s:.2f}", f"{run_s / 60:.1f}",
                     verdict + (f" ({n.note})" if n.note else "")])
    head = [f"Memory plan: {shape.all_params / 1e9:.3f}B parameters ({shape.params / 1e9:.3f}B trainable), "
            f"{shape.layers} layers of hidden {shape.hidden}; host: {host.source}"
            + (f", device {host.device_total / GiB:.1f} GiB" if host.device_total else ", the device is the CPU")
            + f"; every run child: {base / GiB:.2f} GiB measured base + what its engine holds "
            f"(at least the {4 * shape.all_params / GiB:.1f} GiB fp32 init).",
            "ESTIMATES from the shape (zenflow/harness/memory_plan.py); s/step and run minutes are rough planning "
            "figures (ROUGH_RATES), not measurements.", ""]
    return "\n".join(head) + tabulate(rows, ["engine", "device GiB", "pinned GiB", "pageable GiB", "host GiB",
                                             "~s/step", "~run min", "verdict"], tablefmt="github")


def largest_layers(engines: list[str], shape: ModelShape, host: Host, dtype_bytes: int, cuda: bool,
                   block: dict[str, Any], seq_len: int, micro_batch: int, base: int, most: int) -> int:
    """The most layers (up to `most`) at which every engine in `engines` fits `host` with DEFAULT_MARGIN to spare
    (the estimates of the ZeRO-3 peers are of medium-low confidence); at least 1."""
    for layers in range(most, 0, -1):
        needs = plan(engines, replace(shape, layers=layers), dtype_bytes, cuda, block, seq_len, micro_batch, base)
        if all(fits(n, host, DEFAULT_MARGIN) is None for n in needs):
            return layers
    return 1
