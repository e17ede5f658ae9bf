"""A small observer API: the optimizer reports what it moves and where it blocks; telemetry attaches here.

Transfers are reported from whichever thread makes them (the worker too); blocking sections only from the
training thread, since only its waits delay the step.

The optimizer always keeps byte totals (plain integers). Observers are optional and called synchronously; with
none attached a blocking section costs a set lookup (its name is checked) and one empty-list check.

Every name passed in is one of this module's vocabulary (DIRECTIONS, KINDS, BLOCKS, DECISIONS), and an unknown one is
refused at once: otherwise a new blocking section, neither I/O nor stall, would fall out of the step's split unseen.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, Protocol

# ---- the vocabulary: every name a transfer, a blocking section or a decision may carry; Observers refuses others.
# Frozensets: the checks run on every transfer and blocking section, and a set lookup costs next to nothing there.
LINK_DIRECTIONS = ("d2h", "h2d")  # over the host-device link, in the order the tables show them
NET = "net"  # between ranks (data parallelism)
DIRECTIONS = frozenset({*LINK_DIRECTIONS, NET})
# What crosses the link, and (direction NET) what the ranks exchange: distributed.Collectives names each collective.
LINK_KINDS = frozenset({"grads", "params", "master", "moments", "indices"})
NET_KINDS = frozenset({"grad_reduce", "param_gather", "grad_average", "grad_norm", "column_norms", "moved_state",
                       "auto_masses"})
KINDS = LINK_KINDS | NET_KINDS
# Where the training thread can block, split as the step's time is (telemetry/timeline.py): waits for bytes to move
# (exposed I/O) and waits for the host optimizer (stall). A new section goes into one of the two.
IO_BLOCKS = frozenset({"copy_d2h", "copy_h2d", "collective"})  # collective: waiting for the other ranks
STALL_BLOCKS = frozenset({"clip_sync", "host_accumulate", "host_wait", "host_update", "reselect"})
BLOCKS = IO_BLOCKS | STALL_BLOCKS
# What a step decided: a host-update boundary, a top-k selection (what the "auto" intervals chose, step by step).
DECISIONS = frozenset({"host_update", "selection"})


def refuse_unknown(what: str, name: str, allowed: frozenset[str]) -> NoReturn:
    """ValueError, one line: `name` is no `what` of the vocabulary above (a typo, or a new name not added here)."""
    raise ValueError(f"zenflow.hooks: unknown {what} {name!r}; expected one of {', '.join(sorted(allowed))} "
                     f"(a new one is added to zenflow/hooks.py first)")


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
        """`nbytes` moved in `direction` (DIRECTIONS), of `kind` (KINDS): counted, then told to the observers."""
        if direction not in DIRECTIONS:
            refuse_unknown("direction", direction, DIRECTIONS)
        if kind not in KINDS:
            refuse_unknown("kind", kind, KINDS)
        with self._lock:
            self.bytes[(direction, kind)] += nbytes
        for obs in self.attached:
            obs.on_transfer(direction, kind, nbytes)

    @contextlib.contextmanager
    def device_wait(self, what: str, mark: Callable[[], Any]) -> Iterator[None]:
        """A wait of the device's compute stream on a copy (CUDA `wait_event`): no host time passes, so the observers
        that book device waits get an event `mark()` recorded just before it and one just after, with nothing else
        queued between: the span between them is the exposed copy (booked as `what` of BLOCKS, e.g. "copy_h2d")."""
        if what not in BLOCKS:
            refuse_unknown("blocking section", what, BLOCKS)
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
        if what not in DECISIONS:
            refuse_unknown("decision", what, DECISIONS)
        for obs in self.attached:
            if hasattr(obs, "on_decision"):
                obs.on_decision(what)

    @contextlib.contextmanager
    def blocking(self, what: str) -> Iterator[None]:
        """The training thread waits inside this section, booked as `what` (BLOCKS) by the observers."""
        if what not in BLOCKS:
            refuse_unknown("blocking section", what, BLOCKS)
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
