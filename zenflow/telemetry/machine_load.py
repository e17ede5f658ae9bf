"""How busy the rest of the machine was while a run timed its steps, from the kernel's counters.

The neighbour watch (neighbours.py) matches process names; a job it does not know (a compiler it does not list, a
test at the lowest priority, another VM on the host) escapes it. This reads what the kernel counts instead:

- `/proc/stat`: every CPU's busy time (user, nice, system, irq, softirq) and the time stolen by the hypervisor;
- `/proc/<pid>/stat` of this run's process tree (the process, its live descendants, and its reaped children's
  times, cutime/cstime): what the run itself used.

Over the timed window, `outside_cpu_fraction` = (machine busy − own tree) / (CPUs × wall time): the share of the
machine's CPU that other processes took; `steal_fraction` the share the hypervisor gave to other guests. Linux
only; elsewhere the record says "not measured". A rank of a multi-process run counts its launcher's whole tree
(every rank) as its own.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BUSY_BOUND = 0.10  # above this a run's table row is flagged: a tenth of the machine went to someone else
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PROC = Path("/proc")


def machine_ticks() -> tuple[int, int, int] | None:
    """(busy, steal, all) clock ticks summed over every CPU since boot, or None where /proc/stat is missing."""
    try:
        fields = (_PROC / "stat").read_text().splitlines()[0].split()
    except OSError:
        return None
    values = [int(v) for v in fields[1:]]
    user, nice, system, idle, iowait, irq, softirq = values[:7]
    steal = values[7] if len(values) > 7 else 0  # guest time is already inside user and nice
    return user + nice + system + irq + softirq, steal, user + nice + system + idle + iowait + irq + softirq + steal


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None  # gone meanwhile
    return text[text.rindex(")") + 2:].split()  # after "pid (comm) ": state is fields[0]


def tree_ticks(root: int) -> int:
    """CPU ticks used by `root` and its live descendants, including the children each has reaped."""
    parents: dict[int, int] = {}
    for entry in _PROC.iterdir():
        if entry.name.isdigit() and (fields := _stat_fields(int(entry.name))):
            parents[int(entry.name)] = int(fields[1])
    tree, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        children = [child for child, parent in parents.items() if parent == pid and child not in tree]
        tree.update(children)
        frontier += children
    total = 0
    for pid in tree:
        fields = _stat_fields(pid)
        if fields:
            total += sum(int(v) for v in fields[11:15])  # utime, stime, cutime, cstime
    return total


def own_root() -> int:
    """The process whose tree is this run: the launcher of a multi-rank run (its ranks are one run), else self."""
    # torchrun says LOCAL_WORLD_SIZE, DeepSpeed's launcher LOCAL_SIZE: without it a DeepSpeed rank counted the other
    # rank as another process (47% of the machine "elsewhere" in the first 2-rank FSDP2 set)
    local = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or "1"
    return os.getppid() if int(local) > 1 else os.getpid()


@dataclass
class LoadWindow:
    """`window = LoadWindow.start()` ... `window.stop()` -> the record's `machine_load` block."""

    root: int
    wall: float
    machine: tuple[int, int, int] | None
    own: int

    @classmethod
    def start(cls) -> LoadWindow:
        root = own_root()
        machine = machine_ticks()
        return cls(root, time.monotonic(), machine, tree_ticks(root) if machine else 0)

    def stop(self) -> dict[str, Any]:
        machine = machine_ticks()
        if self.machine is None or machine is None:
            return {"measured": False, "reason": "no /proc/stat (not Linux)"}
        own = tree_ticks(self.root)
        busy, steal, total = (after - before for after, before in zip(machine, self.machine))
        capacity = max(1, total)
        outside = max(0, busy - (own - self.own))
        return {"measured": True, "window_s": time.monotonic() - self.wall, "cpus": os.cpu_count(),
                "outside_cpu_fraction": outside / capacity, "steal_fraction": steal / capacity,
                "own_cpu_s": (own - self.own) / _TICKS, "outside_cpu_s": outside / _TICKS}


def busy(load: dict[str, Any] | None, bound: float = BUSY_BOUND) -> bool:
    """Whether a record's machine_load says other work took more than `bound` of the machine."""
    if not load or not load.get("measured"):
        return False
    return load["outside_cpu_fraction"] > bound or load["steal_fraction"] > bound
