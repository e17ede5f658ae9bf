"""A small observer API: the optimizer reports what it moves and where it blocks; telemetry attaches here.

Transfers are reported from whichever thread makes them (the worker too); blocking sections only from the
training thread, since only its waits delay the step.

The optimizer always keeps byte totals (plain integers). Observers are optional and called synchronously; with
none attached a blocking section costs one empty-list check.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, Protocol

DIRECTIONS = ("d2h", "h2d")
KINDS = ("grads", "params", "master", "moments", "indices")
# Where the main thread can block, in the order a step meets them.
BLOCKS = ("clip_sync", "copy_d2h", "host_accumulate", "copy_h2d", "host_wait", "host_update", "reselect",
          "collective")  # collective: waiting for the other ranks (data parallelism)
# What a step decided: a host-update boundary, a top-k selection (what the "auto" intervals chose, step by step).
DECISIONS = ("host_update", "selection")


class Observer(Protocol):
    def on_transfer(self, direction: str, kind: str, nbytes: int) -> None: ...
    def on_block_start(self, what: str) -> None: ...
    def on_block_end(self, what: str) -> None: ...


class RemovableHandle:
    def __init__(self, observers: list[Observer], observer: Observer) -> None:
        self._observers, self._observer = observers, observer

    def remove(self) -> None:
        if self._observer in self._observers:
            self._observers.remove(self._observer)


class Observers:
    """Byte totals by (direction, kind) plus the attached observers."""

    def __init__(self) -> None:
        self.attached: list[Observer] = []
        self.bytes: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()  # the worker thread counts its transfers too
        self._training_thread = threading.get_ident()  # only its waits are stalls; the worker's are not

    def add(self, observer: Observer) -> RemovableHandle:
        self.attached.append(observer)
        return RemovableHandle(self.attached, observer)

    def transfer(self, direction: str, kind: str, nbytes: int) -> None:
        with self._lock:
            self.bytes[(direction, kind)] += nbytes
        for obs in self.attached:
            obs.on_transfer(direction, kind, nbytes)

    @contextlib.contextmanager
    def device_wait(self, what: str, mark: Callable[[], Any]) -> Iterator[None]:
        """A wait of the device's compute stream on a copy (CUDA `wait_event`): no host time passes, so the observers
        that book device waits get an event `mark()` recorded just before it and one just after, with nothing else
        queued between: the span between them is the exposed copy (booked as `what`, e.g. "copy_h2d")."""
        watchers = [o for o in self.attached if hasattr(o, "on_device_wait")]
        if not watchers or threading.get_ident() != self._training_thread:
            yield
            return
        before = mark()
        yield
        after = mark()
        for obs in watchers:
            obs.on_device_wait(what, before, after)

    def decided(self, what: str) -> None:
        """A decision of DECISIONS, for the observers that keep them (`on_decision(what)`: optional, as
        `on_device_wait`), from the training thread."""
        for obs in self.attached:
            if hasattr(obs, "on_decision"):
                obs.on_decision(what)

    @contextlib.contextmanager
    def blocking(self, what: str) -> Iterator[None]:
        if not self.attached or threading.get_ident() != self._training_thread:
            yield
            return
        for obs in self.attached:
            obs.on_block_start(what)
        try:
            yield
        finally:
            for obs in self.attached:
                obs.on_block_end(what)


class Observed:
    """What an optimizer holding `observers` offers telemetry (ZenFlowAdamW, OverlappedOffloadAdamW)."""

    observers: Observers

    def add_observer(self, observer: Observer) -> RemovableHandle:
        """Attach telemetry: it sees every transfer (direction, kind, bytes) and every blocking section."""
        return self.observers.add(observer)

    @property
    def transfer_bytes(self) -> dict[tuple[str, str], int]:
        """Bytes moved so far, by (direction, kind)."""
        return dict(self.observers.bytes)
