"""Where a run's training thread computes: the placement, decided once per run (Session) like the rank strategy.

- **shared** (the default; every committed set before issue 42): every phase of every engine on every core this run
  may use. The "device" and the "host" are the same cores, so a sync engine's host phase borrows the device's cores
  and the device never idles while the host works.
- **split** (the GPU analog, docs/design.md §3, "Placement"): the device's work (forward, backward, the device side
  of the optimizer) on the *device cores*, the host's work (host accumulation, host AdamW, the host side of the
  copies) on the *host cores*, for every engine, as on a GPU host, where neither side can borrow the other's. A sync
  engine's host phase moves to the host cores while the training thread waits there, as a GPU waits; an overlap
  engine's worker already runs there (the same split: `worker.reserved_cores`).

How a split reaches each engine is its class's `placed_by`:
- "observers": our optimizers bracket every host phase (hooks.Observers.blocking); `PhaseSwitch` attaches there
  and moves the training thread to the host cores for a host block and back after it.
- "device": the engine has no host phase (no-offload, the 8-bit optimizers): it runs on the device cores.
- "deepspeed": DeepSpeed's CPU Adam runs on the host cores (ds_placement.py); its copies stay on the device cores.
- None: it cannot be placed (its host work is nowhere we can see from outside); in split its row says so.

Every phase notes the cores it was allowed (`os.sched_getaffinity`) and the CPU it ran on (/proc), so the record
shows the split held (`phases_apart`), and a shared run shows it did not. Exact with one core per side (this VM):
with more, OpenMP's team threads keep the mask they were created with, which the record's note says.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

from zenflow.config import ZenFlowConfig
from zenflow.worker import pin_thread, reserved_cores

PLACEMENTS = ("shared", "split")
DEVICE, HOST = "device", "host"
# the host's blocks: the copies' host side, the accumulation and the host AdamW; every other block is the device's
# (a collective, a clip sync, a wait for the worker, a reselection's top-k: the device waits or computes there)
HOST_BLOCKS = frozenset({"copy_d2h", "copy_h2d", "host_accumulate", "host_update"})
# the share of the cores a split keeps for the device without a ZenFlow block: ZenFlow's own default, so the split
# is the one its worker makes
DEVICE_SHARE = ZenFlowConfig.pt_reserved_cores_perc
PLACED_BY = ("observers", "device", "deepspeed")


class PlacementError(RuntimeError):
    """A split placement that did not happen as asked (an engine that would silently share the cores)."""


def check_placement(value: object) -> str:
    """A run's placement: one of PLACEMENTS, else a one-line ValueError naming them."""
    if not isinstance(value, str) or value not in PLACEMENTS:
        raise ValueError(f"placement = {value!r} is not allowed: expected one of {PLACEMENTS}")
    return value


def split_cores(compute_fraction: float = DEVICE_SHARE) -> tuple[list[int], list[int]] | None:
    """(device cores, host cores) of this thread's cores, as ZenFlow's worker splits them (DeepSpeed's
    `pt_reserved_cores_perc`: the share kept for compute); None with fewer than two cores."""
    split = reserved_cores(min(compute_fraction, 0.99))  # 1.0 would mean "no split": a split keeps one host core
    return None if split is None else (split[1], split[0])


def current_cpu() -> int:
    """The CPU this thread is running on now (field 39 of /proc/thread-self/stat); -1 where there is no /proc."""
    try:
        with open("/proc/thread-self/stat", encoding="ascii") as f:
            return int(f.read().rsplit(")", 1)[1].split()[36])
    except (OSError, IndexError, ValueError):
        return -1


class PhaseSwitch:
    """An observer (hooks.Observer): moves the training thread to the host cores for the host's blocks and back to
    the device cores for the device's (`cores` None: shared, it only notes where each phase ran). Each side's log:
    the masks it ran under, the CPUs it ran on, how many phases; plus the switches made and their time.

    Inside the optimizer step (`lazy`, set by the run loop) a block's end moves nothing yet: the next block or
    `settle()` does, if the side changes. A sync step's host blocks come one after another (each parameter's copy,
    then its add; the update; each upload), and a move costs a migration (~60 µs on this VM): moving back after each
    would add ~100 of them to every ZeRO-Offload step, 6% of the cpu-scale step. Device work between two host blocks
    of a step would run on the host cores; in our optimizers there is none but the whole-rows upload's rewrite of the
    selected columns after the uploads, which runs while the host side is idle (the same core speed, no contention).
    Outside it (a copy in a backward hook: ref-offload-overlap) the move back is at once: backward goes on after it.
    The run loop settles after every optimizer step (Session)."""

    def __init__(self, cores: dict[str, list[int]] | None) -> None:
        self.cores = cores
        self.sides = [DEVICE]  # the stack of sides: blocks nest (a reselection's copies)
        self.at = DEVICE  # the side whose cores the thread holds now
        self.log: dict[str, dict[str, Any]] = {side: {"masks": set(), "ran_on": set(), "phases": 0}
                                               for side in (DEVICE, HOST)}
        self.switches, self.switch_s = 0, 0.0
        self.lazy = False  # inside the optimizer step: a block's end moves nothing until the next block or settle()

    def on_transfer(self, direction: str, kind: str, nbytes: int) -> None:
        pass  # bytes are the timeline's

    def on_block_start(self, what: str) -> None:
        self.enter(HOST if what in HOST_BLOCKS else DEVICE)

    def on_block_end(self, what: str) -> None:
        self.leave(lazy=self.lazy)

    def enter(self, side: str) -> None:
        self.sides.append(side)
        self.settle()

    def leave(self, lazy: bool = False) -> None:
        self.note(self.sides.pop())
        if not lazy:
            self.settle()

    def settle(self) -> None:
        """Hold the cores of the side the thread is in now (a move only if they are not held)."""
        side = self.sides[-1]
        if side != self.at:
            self._move(side)
            self.at = side

    def note(self, side: str) -> None:
        """Where the thread is now, as a phase of `side`."""
        entry = self.log[side]
        entry["masks"].add(tuple(sorted(os.sched_getaffinity(0))))
        entry["ran_on"].add(current_cpu())
        entry["phases"] += 1

    def _move(self, side: str) -> None:
        if self.cores is None:
            return  # shared: nothing moves
        start = time.perf_counter()
        pin_thread(self.cores[side])
        self.switches += 1
        self.switch_s += time.perf_counter() - start

    def facts(self) -> dict[str, Any]:
        phases = {side: {"masks": sorted(list(m) for m in e["masks"]), "ran_on": sorted(e["ran_on"]),
                         "phases": e["phases"]} for side, e in self.log.items()}
        return {"phases": phases, "switches": self.switches, "switch_ms": round(1e3 * self.switch_s, 3)}


class Placement:
    """A run's placement, bound once to its engine after the engine is built (`bind`): an overlap engine's worker
    has split the cores by then, and DeepSpeed's lazily started optimizer process is widened for (ds_placement)."""

    name = "shared"

    def __init__(self) -> None:
        self.switch = PhaseSwitch(self.side_cores())
        self.placed_by: str | None = None
        self.notes: list[str] = []

    def side_cores(self) -> dict[str, list[int]] | None:
        return None

    def bind(self, engine: Any) -> None:
        """Attach the phase log to the engine (and, split, move its phases): the engine's class says how
        (`Engine.attach_placement`, by its `placed_by`)."""
        self.placed_by = getattr(engine, "placed_by", None)
        if self.placed_by is not None:
            self.notes += engine.attach_placement(self.switch)

    @contextlib.contextmanager
    def optimizer_step(self) -> Iterator[None]:
        """The run loop's optimizer step: its host blocks hand the cores back lazily, and all at its end."""
        self.switch.lazy = True
        try:
            yield
        finally:
            self.switch.lazy = False
            self.switch.settle()

    def note_device(self) -> None:
        """The training thread after forward and backward: a device phase."""
        self.switch.note(DEVICE)

    def facts(self) -> dict[str, Any]:
        """The record's `protocol.cores`."""
        cores = self.side_cores() or {}
        return {"placement": self.name, "device": cores.get(DEVICE), "host": cores.get(HOST),
                "placed_by": self.placed_by, "notes": self.notes, **self.switch.facts()}


class Shared(Placement):
    """Every phase on every core (nothing moves); the phase log is kept, so a record shows the sides shared."""


class Split(Placement):
    """The device's phases on `device` cores, the host's on `host` cores (the GPU analog)."""

    name = "split"

    def __init__(self, device: list[int], host: list[int]) -> None:
        if not device or not host or set(device) & set(host):
            raise PlacementError(f"placement split: device cores {device} and host cores {host}: expected two "
                                 "non-empty, disjoint sets")
        self.device, self.host = list(device), list(host)
        super().__init__()
        if len(device) > 1 or len(host) > 1:
            self.notes.append("more than one core per side: OpenMP's team threads keep the mask they were created "
                              "with, so a side's extra threads may run on the other side's cores")

    def side_cores(self) -> dict[str, list[int]]:
        return {DEVICE: self.device, HOST: self.host}

    def bind(self, engine: Any) -> None:
        if getattr(engine, "placed_by", None) not in PLACED_BY:
            raise PlacementError(f"placement split: {engine.name} cannot be placed (its host work is not visible "
                                 "from outside); expected an engine whose class sets placed_by")
        pin_thread(self.device)  # the training thread: the device's, from here on
        super().bind(engine)


def placement_for(name: str, compute_fraction: float = DEVICE_SHARE) -> Placement:
    """The placement called `name` on this thread's cores (split: `split_cores(compute_fraction)`)."""
    if check_placement(name) == "shared":
        return Shared()
    cores = split_cores(compute_fraction)
    if cores is None:
        raise PlacementError(f"placement split needs at least 2 cores; this process may use "
                             f"{len(os.sched_getaffinity(0))}")
    return Split(*cores)


def phases_apart(cores: dict[str, Any] | None) -> bool:
    """Did the device's phases and the host's run apart (a record's `protocol.cores`)? Both sides seen, every mask
    of one disjoint from every mask of the other, and each side ran only on CPUs its masks allow."""
    if not cores or "phases" not in cores:
        return False
    device, host = cores["phases"][DEVICE], cores["phases"][HOST]
    if not device["phases"] or not host["phases"]:
        return False
    allowed = {side: set().union(*map(set, p["masks"])) for side, p in ((DEVICE, device), (HOST, host))}
    within = all(set(p["ran_on"]) <= allowed[side] for side, p in ((DEVICE, device), (HOST, host)))
    return within and not allowed[DEVICE] & allowed[HOST]
