"""A deadline for a plan of runs (plans.execute): a run starts only when its estimated time fits the time left.

GPU time often comes as one command of a few minutes (reproduce/gpu_window.py). A run killed by the command's limit
is lost whole and leaves nothing that says why; a run not started leaves a `skipped` record saying "out of time",
and the table a row that says so, and `--resume` with more time runs it later (a skipped record is not kept).

A run that started is stopped at `run_limit` (three times its expected time, at least a minute, never past the
deadline): stopped at its own limit it is stuck, and gets a "failed: timeout" record; stopped at the deadline it was
cut for time, and gets an "out of time" skip like a run not started. Either way the next run starts, so one stuck
run costs its own time only.

The estimate of each run is the memory plan's rough one (memory_plan.Need.run_s), corrected by the runs already done
in this plan: every estimate is scaled by (measured seconds) / (estimated seconds) of the runs so far, so a host
slower or faster than the plan's stated rates cuts the list where the real times say, not where the rates do.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

OUT_OF_TIME = "out of time"  # how every deadline skip starts: the reports (scenario, gpu_claims, ...) tell it by this
# A started run may take this many times what it is expected to (at least RUN_FLOOR_S, never past the deadline):
# a stuck run (DeepSpeed's ZenFlow waits 600 s for a dead worker) becomes "failed: timeout" and the plan moves on,
# instead of eating every later run
RUN_SLACK = 3.0
RUN_FLOOR_S = 60.0


@dataclass
class Deadline:
    """`until`: the wall-clock time (time.time()) by which every started run must have ended; `estimates`: seconds
    per run name (a name without one is estimated at the mean of the runs done, 0 before any)."""

    until: float
    estimates: dict[str, float] = field(default_factory=dict)
    done: list[tuple[float | None, float]] = field(default_factory=list)  # (estimated, measured) per run done

    def correction(self) -> float:
        """Measured over estimated seconds of the runs done that had an estimate (1 before any)."""
        pairs = [(e, m) for e, m in self.done if e]
        return sum(m for _, m in pairs) / sum(e for e, _ in pairs) if pairs else 1.0

    def expected(self, name: str) -> float:
        """The seconds run `name` is expected to take, the plan's estimate corrected by the runs done."""
        if name in self.estimates:
            return self.estimates[name] * self.correction()
        measured = [m for _, m in self.done]
        return sum(measured) / len(measured) if measured else 0.0

    def left(self) -> float:
        return self.until - time.time()

    def refusal(self, name: str) -> str | None:
        """Why run `name` must not start now (a skipped record's error), or None when it fits the time left."""
        need, left = self.expected(name), self.left()
        if need <= left:
            return None
        how = (f"the plan's {self.estimates[name]:.0f} s x {self.correction():.2f} from the runs done"
               if name in self.estimates else "the mean of the runs done")
        return f"{OUT_OF_TIME}: needs ~{need:.0f} s ({how}), {max(left, 0):.0f} s left before the deadline"

    def own_limit(self, name: str) -> float:
        """The seconds run `name` may take on its own account: RUN_SLACK times its expected time, at least
        RUN_FLOOR_S (beyond that it is stuck)."""
        return max(RUN_FLOOR_S, RUN_SLACK * self.expected(name))

    def run_limit(self, name: str) -> float:
        """The seconds run `name` may take once started: its own limit, and never past the deadline."""
        return max(0.0, min(self.own_limit(name), self.left()))

    def stopped(self, name: str, limit: float) -> str | None:
        """The error of a run stopped at `limit` seconds when that was the deadline's, not its own (a run cut for
        time, as one not started: out of time); None when it was its own limit (a stuck run: a failure)."""
        if limit >= self.own_limit(name):
            return None
        return (f"{OUT_OF_TIME}: stopped at the deadline after {limit:.0f} s (expected ~{self.expected(name):.0f} s)")

    def observe(self, name: str, seconds: float) -> None:
        """A run that ran (not one skipped) took `seconds` in all: it corrects the estimates of the rest."""
        self.done.append((self.estimates.get(name), seconds))
