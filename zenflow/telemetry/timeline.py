"""Per-step timeline: start-to-start period and its split into compute, exposed I/O and stall (DESIGN §4).

`StepTimeline` attaches from outside: the training loop marks step starts and phase boundaries, and the optimizer's
observer API (zenflow/hooks.py) reports where the training thread blocks. On a GPU host the same blocking sections
are host-side waits on CUDA events/streams, so they are stalls of the device's feeder thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from zenflow.hooks import Observer

# Blocking sections of the optimizer, by category: copies the step waits for, and waits for the host optimizer.
IO_BLOCKS = {"copy_d2h", "copy_h2d"}
STALL_BLOCKS = {"host_wait", "host_update", "host_accumulate", "reselect", "clip_sync"}


@dataclass
class StepTiming:
    step: int
    start: float
    period_ms: float | None = None
    forward_backward_ms: float = 0.0
    optimizer_ms: float = 0.0
    io_ms: float = 0.0
    stall_ms: float = 0.0
    kind: str = "accumulate"  # "warmup" | "accumulate" | "update"
    bytes: dict[str, int] = field(default_factory=dict)
    loss: float | None = None
    telemetry_ms: float = 0.0  # time spent inside this timeline's own callbacks (its overhead on the step)

    @property
    def compute_ms(self) -> float | None:
        """Everything of the period that is not exposed I/O or stall: forward, backward, device update."""
        if self.period_ms is None:
            return None
        return max(0.0, self.period_ms - self.io_ms - self.stall_ms)


class StepTimeline(Observer):
    """Collects StepTiming records; also an optimizer observer (blocking sections and bytes)."""

    def __init__(self) -> None:
        self.steps: list[StepTiming] = []
        self._outer: tuple[str, float] | None = None  # the outermost open blocking section
        self._depth = 0
        self._finished = False
        self._bytes: dict[str, int] = {}

    # -- the loop's marks --------------------------------------------------------------------------------------
    def start_step(self, step: int) -> StepTiming:
        now = time.perf_counter()
        if self.steps and self.steps[-1].period_ms is None:
            self.steps[-1].period_ms = (now - self.steps[-1].start) * 1e3  # start-to-start
        self._bytes = {}
        timing = StepTiming(step=step, start=now, bytes=self._bytes)
        self.steps.append(timing)
        return timing

    def finish(self) -> None:
        """Close the last step's period; what happens after (a final drain, close) is not attributed to it."""
        if self.steps and self.steps[-1].period_ms is None:
            self.steps[-1].period_ms = (time.perf_counter() - self.steps[-1].start) * 1e3
        self._finished = True
        self._bytes = {}

    # -- optimizer observer ------------------------------------------------------------------------------------
    def on_transfer(self, direction: str, kind: str, nbytes: int) -> None:
        entered = time.perf_counter()
        key = f"{direction}_{kind}"
        self._bytes[key] = self._bytes.get(key, 0) + nbytes
        self._charge(entered)

    def on_block_start(self, what: str) -> None:
        entered = time.perf_counter()
        self._depth += 1
        if self._depth == 1:  # copies inside a reselection count once, as part of it
            self._outer = (what, entered)
        self._charge(entered)

    def on_block_end(self, what: str) -> None:
        entered = time.perf_counter()
        self._depth -= 1
        if self._depth or self._outer is None or not self.steps or self._finished:
            return
        what, started = self._outer
        self._outer = None
        elapsed = (entered - started) * 1e3
        if what in IO_BLOCKS:
            self.steps[-1].io_ms += elapsed
        elif what in STALL_BLOCKS:
            self.steps[-1].stall_ms += elapsed
        self._charge(entered)

    def _charge(self, entered: float) -> None:
        if self.steps and not self._finished:  # the worker thread may call in too; a float add is enough here
            self.steps[-1].telemetry_ms += (time.perf_counter() - entered) * 1e3
