"""Which engines fit Llama-2-13B and 70B on hosts of 1, 2, 4 and 8 GPUs of 80 GB: the memory plan's
per-rank footprints (each engine's registry memory function at `world` ranks) against a stated multi-GPU host.

Per rank: the device footprint against one GPU (80 GiB, the plan's headroom). Per host: every rank's pinned and
pageable bytes and its process base against the host's memory (HOST_GIB_PER_GPU per GPU, a DGX H100's 2 TiB for 8).
Planning figures, from the model's shape only (no model is built): the build peak of the harness's random init is
left out (a user loads the weights sharded or initialises them on the meta device), activations are kept without
recomputation at the stated sequence and micro-batch.

How each engine's footprint changes with W ranks (registry.py): ref-zenflow keeps the whole model on every GPU and
1/W of the host state per rank (its column blocks); ref-zenflow-fsdp2 keeps 1/W of the model, gradients and device
state plus the layers FSDP2 gathers, and 1/W of the host state; fsdp2-offload keeps a few gathered layers on the
device and 1/W of everything on the host; DeepSpeed's ZeRO-2 offload keeps the model on every GPU and partitions
the host state; no-offload (DDP) replicates everything.
"""

from __future__ import annotations

from dataclasses import dataclass

from tabulate import tabulate

from zenflow.harness.engines.registry import MemoryInputs, engine_spec
from zenflow.harness.memory_plan import HEADROOM, GiB, ModelShape, activation_bytes

# Hugging Face config.json of each model (meta-llama/Llama-2-13b-hf, Llama-2-70b-hf: grouped-query attention, 8 kv).
MODELS = {
    "Llama-2-13B": ModelShape(vocab=32000, hidden=5120, intermediate=13824, layers=40, heads=40, kv_heads=40),
    "Llama-2-70B": ModelShape(vocab=32000, hidden=8192, intermediate=28672, layers=80, heads=64, kv_heads=8),
}
GPUS = (1, 2, 4, 8)
GPU_GIB = 80
HOST_GIB_PER_GPU = 256  # a DGX H100: 2 TiB of host memory for 8 GPUs
SEQ_LEN, MICRO_BATCH = 512, 1
OVERLAP = {"topk_ratio": 0.1, "update_interval": 4, "overlap_step": True}
SYNC = {**OVERLAP, "overlap_step": False}  # ours without the unselected columns' device buffers in flight
# (column title, engine, ZenFlow block): ours twice, since overlap's buffers decide where it fits
COLUMNS = (("no-offload", "no-offload", OVERLAP), ("ds-zero-offload", "ds-zero-offload", OVERLAP),
           ("ds-zenflow", "ds-zenflow", OVERLAP), ("fsdp2-offload", "fsdp2-offload", OVERLAP),
           ("ref-zenflow", "ref-zenflow", OVERLAP), ("ref-zenflow sync", "ref-zenflow", SYNC),
           ("ref-zenflow-fsdp2", "ref-zenflow-fsdp2", OVERLAP), ("ref-zenflow-fsdp2 sync", "ref-zenflow-fsdp2", SYNC))


@dataclass(frozen=True)
class Cell:
    """One engine on one host: per-rank device bytes, the host's bytes (all ranks), and why it does not fit."""

    device: float
    host: float
    why: str | None

    def text(self) -> str:
        return f"{'fits' if self.why is None else 'no'}: {self.device / GiB:.0f} / {self.host / GiB:.0f}"


def cell(engine: str, block: dict, shape: ModelShape, world: int, base: int, b: int = 2) -> Cell:
    """One engine at `world` ranks of one host: each rank's device bytes, every rank's host bytes and base."""
    spec = engine_spec(engine)
    acts = activation_bytes(shape, SEQ_LEN, MICRO_BATCH, b)
    held = spec.footprint(MemoryInputs(shape, b, True, spec.own_block(block) or {}, acts, base, world))
    host = world * (held.pinned + held.pageable + base)
    why = [f"GPU {held.device / GiB:.0f} GiB"] if held.device > GPU_GIB * GiB * HEADROOM else []
    if host > world * HOST_GIB_PER_GPU * GiB * HEADROOM:
        why.append(f"host {host / GiB:.0f} GiB")
    return Cell(held.device, host, " and ".join(why) or None)


def render(base: int) -> str:
    """The table: one row per model and host, one column per engine: "fits" or "no", then GiB per GPU / GiB of
    the host."""
    rows = [[model, f"{world} × {GPU_GIB} GB, {world * HOST_GIB_PER_GPU} GiB",
             *(cell(engine, block, shape, world, base).text() for _, engine, block in COLUMNS)]
            for model, shape in MODELS.items() for world in GPUS]
    head = (f"Which engines fit where: per cell fits/no, then GiB per GPU / GiB of host memory (all ranks). Planning "
            f"estimates from the shapes: bf16, sequence {SEQ_LEN}, micro-batch {MICRO_BATCH}, ZenFlow block {OVERLAP} "
            f"(sync: overlap_step off), a run child's base of {base / GiB:.1f} GiB per rank, the random init's build "
            f"peak left out, {HEADROOM:.0%} of each GPU and of the host usable.")
    return head + "\n\n" + tabulate(rows, headers=["model", "GPUs, host", *(c[0] for c in COLUMNS)],
                                     tablefmt="github")
