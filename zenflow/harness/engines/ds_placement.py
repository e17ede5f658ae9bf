"""DeepSpeed's engines under a placement (zenflow/harness/placement.py), from outside DeepSpeed:

- its CPU Adam (`DeepSpeedCPUAdam`, `ZenFlowCPUAdam`: one `#pragma omp parallel` on the calling thread, whose team
  `torch.set_num_threads` sizes: the same libgomp) runs on the host cores: the basic optimizer's `step` is wrapped
  (an instance attribute shadows the method) so the training thread moves there for it and back. Every ZeRO stage
  reaches it as `<zero optimizer>.optimizer.step(...)`.
- DeepSpeed's ZenFlow starts its optimizer process lazily, at its first CPU step, and splits *the main thread's
  mask* by `pt_reserved_cores_perc` then. Under a split the trainer holds the device cores only, so that start is
  widened to device ∪ host and the trainer re-pinned after; the process must land on the host cores, or the run
  fails (PlacementError) rather than silently share.
- What stays on the device cores, said in the record: DeepSpeed's gradient copies into its fp32 buffers (backward
  hooks) and the copy back of the updated weights (inside its step, around CPU Adam).
"""

from __future__ import annotations

import functools
import os
from typing import Any

from zenflow.harness.placement import HOST, PhaseSwitch, PlacementError
from zenflow.worker import pin_thread

COPIES_NOTE = ("DeepSpeed's gradient copies (backward hooks) and the weights' copy back stay on the device cores; "
               "its CPU Adam runs on the host cores")


def place_deepspeed(engine: Any, switch: PhaseSwitch) -> list[str]:
    """Wrap `engine`'s CPU Adam step (and ZenFlow's process start) for `switch`; returns the record's notes."""
    zero = engine.engine.optimizer
    basic = getattr(zero, "optimizer", None)
    notes = []
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    if isinstance(basic, DeepSpeedCPUAdam):
        basic.step = _on_host(basic.step, switch)
        notes.append(COPIES_NOTE)
    else:
        notes.append(f"no CPU Adam ({type(basic).__name__}): every phase on the device cores")
    if hasattr(zero, "start_optimizer_process") and switch.cores is not None:
        zero.start_optimizer_process = _widened(zero.start_optimizer_process, zero, switch)
        notes.append("DeepSpeed's ZenFlow optimizer process on the host cores (checked when it starts)")
    return notes


def _on_host(step: Any, switch: PhaseSwitch) -> Any:
    @functools.wraps(step)
    def placed(*args: Any, **kwargs: Any) -> Any:
        switch.enter(HOST)
        try:
            return step(*args, **kwargs)
        finally:
            switch.leave()
    return placed


def _widened(start: Any, zero: Any, switch: PhaseSwitch) -> Any:
    """DeepSpeed's process start with the main thread's mask widened to both sides for it (DeepSpeed splits that
    mask itself), then the trainer back on the device cores; the process is checked to be on the host cores."""
    def placed() -> Any:
        device, host = switch.cores["device"], switch.cores[HOST]
        os.sched_setaffinity(0, sorted({*device, *host}))
        try:
            result = start()
        finally:
            pin_thread(device)
        proc = getattr(zero, "process", None)
        got = sorted(os.sched_getaffinity(proc.pid)) if proc is not None and proc.is_alive() else None
        if got != sorted(host):
            raise PlacementError(f"placement split: DeepSpeed's ZenFlow optimizer process runs on cores {got}, "
                                 f"expected the host cores {sorted(host)} (device cores {sorted(device)})")
        return result
    return placed
