"""The process an engine runs in: its device, DeepSpeed's accelerator choice, and the process group (torchrun's
ranks, or a group of one for FSDP2 and DeepSpeed), set up before the engine builds its optimizer.
"""

from __future__ import annotations

import os
import socket
import sys

import torch


def resolve_device(device: str) -> torch.device:
    """The workload's device: "auto" is CUDA when available, else the CPU; "cpu" forces the CPU (the cpu-scale
    workload of bench and the golden curve, so they mean the same on a GPU host); "cuda[:N]" must be usable."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"device = {device!r} is not allowed: expected 'auto', 'cpu' or 'cuda[:N]'") from exc
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device = {device!r} is not allowed: expected 'auto', 'cpu' or 'cuda[:N]'")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device = {device!r} but torch.cuda.is_available() is False (torch {torch.__version__}, "
                         f"built for CUDA {torch.version.cuda})")
    return resolved


def pin_deepspeed_to_cpu() -> None:
    """DS_ACCELERATOR=cpu before DeepSpeed first resolves its accelerator (it caches the choice per process; the
    harness also sets it in the child's environment, since capturing the environment resolves it first)."""
    ds_accel = sys.modules.get("deepspeed.accelerator.real_accelerator")
    chosen = getattr(ds_accel, "ds_accelerator", None) if ds_accel else None
    if chosen is not None and chosen.device_name() != "cpu":
        raise RuntimeError(f"device = 'cpu' but DeepSpeed already chose the {chosen.device_name()!r} accelerator "
                           "in this process; run the cpu workload in a fresh process (the harness does)")
    os.environ["DS_ACCELERATOR"] = "cpu"


def join_ranks(device: torch.device, single: bool = False) -> torch.device | None:
    """Under torchrun (WORLD_SIZE > 1): start the default process group (nccl on GPUs, gloo on the CPU) and return
    this rank's device; None for a single process, unless `single` (FSDP2 needs a group of one): then that group on
    a loopback rendezvous, and `device` as given."""
    alone = int(os.environ.get("WORLD_SIZE", "1")) == 1
    if alone and not single:
        return None
    if alone:
        single_process_env()
    if device.type == "cuda":
        device = device if alone else torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


def single_process_env() -> None:
    """torch.distributed needs a rendezvous even for one process; use a free loopback port."""
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
