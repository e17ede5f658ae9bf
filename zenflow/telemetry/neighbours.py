"""Other heavy jobs on this shared machine: wait until there are none, and note whether any ran meanwhile.

A 2-thread run slows down several-fold when another job takes a core, so a calibration or validation point records
the fraction of its time during which a neighbour ran (`neighbour_busy_fraction`), and reports read it.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time

# Command-line fragments of heavy jobs: our run children, benchmarks, test runs, reproductions, C++ compilers.
HEAVY = ("harness.runner", "harness.stepper", "cc1plus", "pytest", "reproduce/")


def heavy_neighbours() -> int:
    """How many heavy jobs run here that are neither this process nor its parent or children."""
    mine = {os.getpid(), os.getppid()}
    lines = subprocess.run(["ps", "-eo", "pid,ppid,args"], capture_output=True, text=True).stdout.splitlines()[1:]
    return sum(1 for line in lines if any(h in line for h in HEAVY) and int(line.split()[0]) not in mine
               and int(line.split()[1]) not in mine)


def wait_until_quiet(max_wait_s: float, poll_s: float = 1.0) -> None:
    deadline = time.time() + max_wait_s
    while heavy_neighbours() and time.time() < deadline:
        time.sleep(poll_s)


class NeighbourWatch:
    """`with NeighbourWatch() as watch: ...` then `watch.busy_fraction`: polls every `every_s` in a thread."""

    def __init__(self, every_s: float = 2.0) -> None:
        self.every_s, self.seen = every_s, []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._done.is_set():
            self.seen.append(heavy_neighbours())
            self._done.wait(self.every_s)

    def __enter__(self) -> NeighbourWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    @property
    def busy_fraction(self) -> float:
        return sum(1 for n in self.seen if n) / max(1, len(self.seen))
