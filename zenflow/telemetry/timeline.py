"""Per-step timeline: start-to-start period and its split into compute, exposed I/O and stall (docs/design.md §4).

`StepTimeline` attaches from outside: the training loop marks step starts (`start_step`) and phases (`mark`:
"forward", "backward", "optimizer"), and the optimizer's observer API (zenflow/hooks.py) reports where the training
thread blocks. Every step's period is split exactly: period = compute + io + stall. One attribution protocol per
device, named in the record (`protocol.attribution`):

- "host-blocking" (CPU device): the training thread is the device, so a blocking section's wall time is device
  idle: `copy_*` sections are I/O, waits for the host optimizer are stall, the rest of the period is compute.
- "cuda-events" (CUDA): `backward()` returns when its kernels are launched, so a blocking section first absorbs the
  GPU's queued work (compute) and only then leaves the GPU idle. A step starts with the compute stream idle (every
  engine ends its step with `loss.item()`), so an anchor event recorded there completes at the host time read with
  it, and any later event on that stream maps to the host clock as anchor time + `anchor.elapsed_time(event)`.
  A blocking section entered at host time h_s (event e_s) and left at h_e books max(0, h_e - max(h_s, gpu(e_s)))
  as I/O or stall, the part before as compute. Phase marks are events too, so `forward_backward_ms` is GPU time,
  not launch time. Nothing in a step synchronizes: a step's events are read at the next
  `start_step`, where `query()` says they completed; only `finish()`, after the last step, may wait.
  A copy the compute stream waits for on the device (`wait_event` on an upload, link.py) takes no host time: the
  link records an event just before and just after the wait (`Observers.device_wait`), and their span is I/O.

The protocol follows the engine's device: the run loop calls `use_device(device)` at the top of every step; until a
CUDA device is named the timeline is host-blocking (never a CUDA call on a CPU run). The clock and its events are
a small seam (`HostClock`, `EventClock`), so tests check the CUDA arithmetic on the CPU with fake events. On CUDA
each step also gets the allocator's peak device memory (peaks reset at every step start).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

# Blocking sections of the optimizer, by category (hooks.py owns the names, and refuses any other): copies the step
# waits for are exposed I/O, waits for the host optimizer are stall.
from zenflow.hooks import IO_BLOCKS, STALL_BLOCKS, Observer


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
    peak_memory_allocated_bytes: int | None = None  # CUDA only: allocator peaks during this step
    peak_memory_reserved_bytes: int | None = None
    blocks_ms: dict[str, float] = field(default_factory=dict)  # device-idle ms per kind of blocking section
    decisions: dict[str, int] = field(default_factory=dict)  # hooks.DECISIONS the optimizer made in this step

    @property
    def compute_ms(self) -> float | None:
        """Everything of the period that is not exposed I/O or stall: forward, backward, device update."""
        if self.period_ms is None:
            return None
        return max(0.0, self.period_ms - self.io_ms - self.stall_ms)


# ---- clocks: the seam between the arithmetic and the device (tests pass fake events) ----------------------------
class HostClock:
    """CPU device: no device events; a point's time is the host time it was queued at."""

    attribution = "host-blocking"
    memory = "not measured: no CUDA device (the run trains on the CPU)"

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self.now = now

    def begin_step(self) -> None:
        pass

    def event(self) -> Any:
        return None

    def read_memory_peaks(self) -> tuple[int, int] | None:
        return None


class EventClock(HostClock):
    """A device with timing events: `make_event()` gives an object with `record(stream)`, `query()`,
    `elapsed_time(later)` (ms) and `synchronize()`: `torch.cuda.Event` or a test's fake."""

    attribution = "cuda-events"
    memory = "not measured: this clock has no allocator counters"

    def __init__(self, make_event: Callable[[], Any], now: Callable[[], float] = time.perf_counter) -> None:
        super().__init__(now)
        self.make_event, self.stream = make_event, None

    def event(self) -> Any:
        event = self.make_event()
        event.record(self.stream)  # on the loop's stream, even when called inside a side-stream context
        return event


class CudaClock(EventClock):
    memory = "torch.cuda.max_memory_allocated / max_memory_reserved of each step (peaks reset at every step start)"

    def __init__(self, device: torch.device | str | None = None) -> None:
        super().__init__(lambda: torch.cuda.Event(enable_timing=True))
        self.device = device  # None: the current device

    def begin_step(self) -> None:
        # Read per step, not at construction: DeepSpeed may select this rank's device after the timeline is built.
        self.stream = torch.cuda.current_stream(self.device)

    def read_memory_peaks(self) -> tuple[int, int] | None:
        """The peaks since the last call, then reset: host-side allocator counters, no device sync."""
        try:
            peaks = torch.cuda.max_memory_allocated(self.device), torch.cuda.max_memory_reserved(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        except RuntimeError:  # an allocator backend without peak statistics: say nothing rather than guess
            return None
        return peaks


def clock_for(device: torch.device | str) -> HostClock:
    """The attribution protocol of a device: CUDA events on a CUDA device, host blocking sections otherwise."""
    device = torch.device(device)
    return CudaClock(device) if device.type == "cuda" else HostClock()


# ---- the timeline -------------------------------------------------------------------------------------------------
@dataclass
class _Recorded:
    """One step's raw points (host time, device event or None), settled into its StepTiming once they completed."""

    timing: StepTiming
    anchor: tuple[float, Any]  # (host time, event) where the compute stream was idle: the step's start
    marks: dict[str, tuple[float, Any]] = field(default_factory=dict)
    blocks: list[tuple[str, float, Any, float]] = field(default_factory=list)  # (what, host start, event, host end)
    stall_spans: list[tuple[str, str]] = field(default_factory=list)  # (from mark, to mark)
    device_waits: list[tuple[str, Any, Any]] = field(default_factory=list)  # (what, event before, event after)

    def events(self) -> list[Any]:
        found = [self.anchor[1], *(e for _, e in self.marks.values()), *(b[2] for b in self.blocks),
                 *(e for _, before, after in self.device_waits for e in (before, after))]
        return [e for e in found if e is not None]


class StepTimeline(Observer):
    """Collects StepTiming records; also an optimizer observer (blocking sections and bytes)."""

    def __init__(self, clock: HostClock | None = None) -> None:
        """`clock`: fixed (tests); None: host blocking sections until `use_device` names a CUDA device."""
        self._fixed, self._device = clock is not None, None
        self._use(clock or HostClock())
        self.steps: list[StepTiming] = []
        self._current: _Recorded | None = None
        self._pending: list[_Recorded] = []  # ended steps whose events were not yet read
        self._outer: tuple[str, float, Any] | None = None  # the outermost open blocking section
        self._depth = 0
        self._finished = False
        self._bytes: dict[str, int] = {}

    def use_device(self, device: torch.device | str) -> str:
        """Follow the engine's device; returns the protocol's name. The run loop (session.py) calls it at the top
        of every step (a no-op after the first); on a switch inside a step the anchor is taken here, before
        anything is queued."""
        if self._fixed or device is self._device:
            return self.attribution
        self._device = device
        clock = clock_for(device)
        if type(clock) is type(self.clock) and getattr(clock, "device", None) == getattr(self.clock, "device", None):
            return self.attribution
        self._use(clock)
        self.clock.read_memory_peaks()  # resets the peaks
        if self._current is not None:
            self.clock.begin_step()
            self._current.anchor = (self.clock.now(), self.clock.event())
        return self.attribution

    def _use(self, clock: HostClock) -> None:
        self.clock = clock
        self.attribution = clock.attribution  # the protocol, for the record
        self.memory = clock.memory  # how peak device memory is measured, or why not

    # -- the loop's marks --------------------------------------------------------------------------------------
    def start_step(self, step: int) -> StepTiming:
        now = self.clock.now()
        self._end_current(now)
        self._settle(wait=False)
        self.clock.begin_step()
        self._bytes = {}
        timing = StepTiming(step=step, start=now, bytes=self._bytes)
        # The previous step ended with loss.item(): the compute stream is idle, so the anchor completes at once.
        self._current = _Recorded(timing, anchor=(self.clock.now(), self.clock.event()))
        self.steps.append(timing)
        timing.telemetry_ms += (self.clock.now() - now) * 1e3
        return timing

    def mark(self, name: str, stall_since: str | None = None) -> None:
        """A phase boundary ("forward", "backward", "optimizer") of the current step. `stall_since`: book the span
        from that mark to this one as stall (incl. I/O): an opaque step the timeline cannot see into (DeepSpeed's)."""
        if self._current is None or self._finished:
            return
        entered = time.perf_counter()
        self._current.marks[name] = (self.clock.now(), self.clock.event())
        if stall_since is not None:
            self._current.stall_spans.append((stall_since, name))
        self._charge(entered)

    def end_step(self) -> None:
        """Close the current step's period now (e.g. before idle time between rounds of steps)."""
        if self._current is not None:
            self._end_current(self.clock.now())

    def finish(self) -> None:
        """Close the last step's period; what happens after (a final drain, close) is not attributed to it."""
        self._end_current(self.clock.now())
        self._finished = True
        self._bytes = {}
        self._settle(wait=True)  # after the last step: waiting here delays no step

    # -- optimizer observer ------------------------------------------------------------------------------------
    def on_transfer(self, direction: str, kind: str, nbytes: int) -> None:
        entered = time.perf_counter()
        key = f"{direction}_{kind}"
        self._bytes[key] = self._bytes.get(key, 0) + nbytes
        self._charge(entered)

    def on_block_start(self, what: str) -> None:
        entered = time.perf_counter()
        self._depth += 1
        if self._depth == 1 and self._current is not None and not self._finished:
            # copies inside a reselection count once, as part of it
            self._outer = (what, self.clock.now(), self.clock.event())
        self._charge(entered)

    def on_block_end(self, what: str) -> None:
        entered = time.perf_counter()
        self._depth -= 1
        if self._depth or self._outer is None or self._current is None or self._finished:
            return
        what, started, event = self._outer
        self._outer = None
        self._current.blocks.append((what, started, event, self.clock.now()))
        self._charge(entered)

    def on_decision(self, what: str) -> None:
        """A host-update boundary or a selection in the current step (hooks.DECISIONS): the record's per-step trace
        of what the "auto" intervals chose."""
        entered = time.perf_counter()
        if self._current is not None and not self._finished:
            decisions = self._current.timing.decisions
            decisions[what] = decisions.get(what, 0) + 1
        self._charge(entered)

    def on_device_wait(self, what: str, before: Any, after: Any) -> None:
        """The compute stream waited for a copy (CUDA `wait_event`, link.py): the span between the events recorded
        just before and just after the wait is device-idle time, exposed I/O (it used to be booked
        as compute). Inside a blocking section the section's own idle time already covers it: not booked twice."""
        entered = time.perf_counter()
        if self._current is not None and not self._finished and self._depth == 0:
            self._current.device_waits.append((what, before, after))
        self._charge(entered)

    def _charge(self, entered: float) -> None:
        if self.steps and not self._finished:  # the worker thread may call in too; a float add is enough here
            self.steps[-1].telemetry_ms += (time.perf_counter() - entered) * 1e3

    # -- settling ----------------------------------------------------------------------------------------------
    def _end_current(self, now: float) -> None:
        rec, self._current = self._current, None
        if rec is None:
            self.clock.read_memory_peaks()  # resets the peaks: what came before the first step is no step's
            return
        timing = rec.timing
        if timing.period_ms is None:
            timing.period_ms = (now - timing.start) * 1e3  # start-to-start
        peaks = self.clock.read_memory_peaks()
        if peaks is not None:
            timing.peak_memory_allocated_bytes, timing.peak_memory_reserved_bytes = peaks
        self._pending.append(rec)

    def _settle(self, wait: bool) -> None:
        """Settle ended steps in order; one whose events have not all completed waits for a later call, unless
        `wait` (only after the last step)."""
        while self._pending:
            rec = self._pending[0]
            for event in rec.events():
                if not event.query():
                    if not wait:
                        return
                    event.synchronize()  # sync point, taken only by finish()
            self._pending.pop(0)
            split_step(rec)


def split_step(rec: _Recorded) -> None:
    """Phases and the compute / io / stall split of one ended step whose events have completed."""
    t = rec.timing
    origin, anchor = rec.anchor

    def reached(host: float, event: Any) -> float:
        """When the device finished what was queued before the point (host clock); never before it was queued."""
        if event is None or anchor is None:
            return host
        return max(host, origin + anchor.elapsed_time(event) / 1e3)

    at = {name: reached(*point) for name, point in rec.marks.items()}
    if "forward" in at and "backward" in at:
        t.forward_backward_ms = (at["backward"] - at["forward"]) * 1e3
    if "backward" in at and "optimizer" in at:
        t.optimizer_ms = (at["optimizer"] - at["backward"]) * 1e3
    for what, started, event, ended in rec.blocks:
        idle_ms = max(0.0, ended - reached(started, event)) * 1e3  # after the device drained what came before
        t.blocks_ms[what] = t.blocks_ms.get(what, 0.0) + idle_ms
        if what in IO_BLOCKS:  # hooks.BLOCKS is these two sets, and Observers refuses any other name
            t.io_ms += idle_ms
        elif what in STALL_BLOCKS:
            t.stall_ms += idle_ms
    for what, before, after in rec.device_waits:  # same stream, nothing queued between: the wait itself
        waited_ms = max(0.0, before.elapsed_time(after))
        t.blocks_ms[what] = t.blocks_ms.get(what, 0.0) + waited_ms
        t.io_ms += waited_ms if what in IO_BLOCKS else 0.0
        t.stall_ms += waited_ms if what in STALL_BLOCKS else 0.0
    for since, until in rec.stall_spans:
        if since in at and until in at:
            t.stall_ms += max(0.0, at[until] - at[since]) * 1e3
    if t.period_ms is not None:  # a period closed early from outside: the parts still sum to it
        t.io_ms = min(t.io_ms, t.period_ms)
        t.stall_ms = min(t.stall_ms, t.period_ms - t.io_ms)
