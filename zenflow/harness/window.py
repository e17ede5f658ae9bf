"""A device window: one command, one deadline, every phase's output packed to come back (reproduce/gpu_window.py).

A borrowed GPU host gives one command of a few minutes, then takes the machine back with whatever the command did
not copy out. So the window (1) counts every phase against one deadline, (2) runs each phase as a child whose output
goes both to the screen and to `run.log`, stopped with SIGTERM (then SIGKILL) when its time is up, (3) records each
phase's seconds and outcome in `phases.json`, and (4) packs its work folder into the archive that comes back after
every phase, whenever a run record appears, and on SIGTERM (evidence.py): a command killed at any moment leaves the
evidence of every phase that finished, and of every run that ended.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from zenflow.harness import evidence
from zenflow.harness.atomic import copy_atomic, write_text_atomic

ARCHIVE = "gpu-evidence.tar.gz"
LOG = "run.log"
PHASES = "phases.json"
TERM_GRACE_S = 20  # a child asked to stop (SIGTERM) gets this long to write its records, then SIGKILL
TIMED_OUT = 124  # the exit status of a child stopped for time (Window.run), as timeout(1) says
CUT = "cut"  # a phase stopped for time: the budget's doing, not a failure


def outcome(code: int, ok: tuple[int, ...] = (0,)) -> str:
    """A phase's status from its exit code: stopped for time (TIMED_OUT) is CUT, not a failure."""
    return "ok" if code in ok else CUT if code == TIMED_OUT else "failed"


def memory_now() -> dict[str, float | None]:
    """MemTotal, MemAvailable and /dev/shm's free GiB now: a microVM's RAM grows as it is used, so each phase says
    what the host had when it ended."""
    try:
        meminfo = {k: int(v.split()[0]) * 1024 for k, v in
                   (line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)}
    except (OSError, ValueError):
        meminfo = {}
    shm = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else None
    return {"total_gib": _gib(meminfo.get("MemTotal")), "available_gib": _gib(meminfo.get("MemAvailable")),
            "shm_free_gib": _gib(shm)}


def _gib(n: int | None) -> float | None:
    return None if n is None else round(n / 2**30, 1)


@dataclass(frozen=True)
class Phase:
    """One row of a window's table of phases (reproduce/gpu_window.py's PHASES), each callable given the window's
    shared state: a child (`command`) that Window.phase times and records, or a `step` in this process that
    records itself. `cap_s` bounds the child within the time left (None: all of it); `done` says, on --resume, that
    an earlier window on this machine finished it; `ok` are the exit codes that are not a failure; `facts(state,
    code)` adds to its entry in phases.json; `watch(state)` is a folder whose new run records pack the archive at
    once; `fails_window`: its failure fails the window."""

    name: str
    command: Callable[[Any], list[str]] | None = None
    step: Callable[[Any], object] | None = None
    cap_s: float | None = None
    done: Callable[[Any], bool] | None = None
    ok: tuple[int, ...] = (0,)
    facts: Callable[[Any, int], dict[str, Any]] | None = None
    watch: Callable[[Any], Path] | None = None
    fails_window: bool = True


class WindowClosed(Exception):
    """The window was told to stop (SIGTERM): pack what is there and leave."""


class Window:
    """The work folder, the deadline, the log and the phases of one window; `out` receives the archive and the log."""

    def __init__(self, work: Path, out: Path, budget_s: float, info: dict[str, Any]) -> None:
        self.work, self.out, self.info = work, out, info
        self.began = time.monotonic()
        self.end = self.began + budget_s
        self.phases: list[dict[str, Any]] = []
        work.mkdir(parents=True, exist_ok=True)
        out.mkdir(parents=True, exist_ok=True)
        self.log: IO[str] = open(work / LOG, "a", buffering=1)
        self._child: subprocess.Popen | None = None
        self._previous = signal.signal(signal.SIGTERM, self._closed)

    # ---- time -------------------------------------------------------------------------------------------------
    def elapsed(self) -> float:
        return time.monotonic() - self.began

    def left(self) -> float:
        return self.end - time.monotonic()

    # ---- output -----------------------------------------------------------------------------------------------
    def say(self, text: str) -> None:
        """A line of the window's own, on the screen and in the log, stamped with the seconds since the start."""
        line = f"[window {self.elapsed():5.0f} s] {text}"
        print(line, flush=True)
        self.log.write(line + "\n")

    def record(self, phase: str, seconds: float, status: str, **facts: Any) -> None:
        """One phase's outcome in phases.json (rewritten whole, atomically), then a fresh archive."""
        self.phases.append({"phase": phase, "started_s": round(self.elapsed() - seconds, 1),
                            "seconds": round(seconds, 1), "status": status, **facts, "memory": memory_now()})
        write_text_atomic(self.work / PHASES, json.dumps(self.phases, indent=1, default=str) + "\n")
        self.pack()

    def phase(self, name: str, cmd: list[str], timeout_s: float, env: dict[str, str] | None = None,
              ok: tuple[int, ...] = (0,), watch: Path | None = None,
              facts: Callable[[int], dict[str, Any]] | None = None) -> int:
        """One phase run as a child (`run`), timed and recorded: its seconds, its status from its exit code
        (`outcome`, `ok` the codes that are not a failure), the code, and `facts(code)`; the exit code."""
        began = time.monotonic()
        code = self.run(cmd, timeout_s, env, watch=watch)
        self.record(name, time.monotonic() - began, outcome(code, ok), exit=code, **(facts(code) if facts else {}))
        return code

    def run_phase(self, phase: Phase, state: Any, env: dict[str, str] | None, resume: bool = False) -> None:
        """A step, or a child with its cap (`phase`), unless `resume` and the phase is done already."""
        if phase.step:
            phase.step(state)
        elif not (resume and phase.done and phase.done(state)):
            cmd = phase.command(state)
            cap = self.left() if phase.cap_s is None else min(phase.cap_s, self.left())
            self.phase(phase.name, cmd, cap, env, ok=phase.ok, watch=phase.watch(state) if phase.watch else None,
                       facts=(lambda code: phase.facts(state, code)) if phase.facts else None)

    def seconds_by_phase(self) -> str:
        """Each phase's seconds and status in one line (phases.json has them too)."""
        return ", ".join(f"{p['phase']} {p['seconds']:.0f} s" + ("" if p["status"] == "ok" else f" ({p['status']})")
                         for p in self.phases) or "no phase ended"

    def pack(self) -> None:
        """The archive and a copy of the log into `out` (2 of the 8 files that may come back)."""
        done = [p["phase"] for p in self.phases if p["status"] == "ok"]
        evidence.pack(self.work, self.out / ARCHIVE, {**self.info, "phases_ok": done,
                                                      "elapsed_s": round(self.elapsed(), 1)})
        self.log.flush()
        copy_atomic(self.work / LOG, self.out / LOG)

    # ---- children ---------------------------------------------------------------------------------------------
    def run(self, cmd: list[str], timeout_s: float, env: dict[str, str] | None = None,
            watch: Path | None = None, preexec: Callable[[], None] | None = None) -> int:
        """Run `cmd` with its output teed to the screen and the log; SIGTERM after `timeout_s` (then SIGKILL after
        TERM_GRACE_S); the exit status (TIMED_OUT when stopped for time). With `watch`, a new
        `*.json` under it (a run's record) packs the archive at once."""
        self.say("$ " + " ".join(cmd))
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                preexec_fn=preexec, bufsize=1)
        self._child = proc
        tee = threading.Thread(target=self._tee, args=(proc.stdout,), daemon=True)
        tee.start()
        stop_at, seen, timed_out = time.monotonic() + max(timeout_s, 0), self._records(watch), False
        try:
            while proc.poll() is None:
                time.sleep(0.5)
                if watch is not None and self._records(watch) != seen:
                    seen = self._records(watch)
                    self.pack()
                if time.monotonic() > stop_at and not timed_out:
                    self.say(f"out of time: stopping {Path(cmd[1]).name if len(cmd) > 1 else cmd[0]} (SIGTERM)")
                    timed_out = True
                    self.stop_child()
        finally:  # also when the window itself is told to stop (WindowClosed): the child first, with its grace
            self.stop_child()
            self._child = None
            tee.join(timeout=5)
        return TIMED_OUT if timed_out else proc.returncode

    def start(self, cmd: list[str], log: Path, env: dict[str, str] | None = None,
              preexec: Callable[[], None] | None = None) -> subprocess.Popen:
        """A background child (the op build) writing to its own log file; the caller waits for it."""
        self.say("$ (background) " + " ".join(cmd) + f"  > {log.relative_to(self.work)}")
        with open(log, "w") as f:
            return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, preexec_fn=preexec)

    def stop_child(self) -> None:
        proc = self._child
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(TERM_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def _tee(self, stream: IO[str]) -> None:
        for line in stream:
            sys.stdout.write(line)
            self.log.write(line)
        sys.stdout.flush()

    @staticmethod
    def _records(folder: Path | None) -> frozenset[tuple[str, float]]:
        if folder is None or not folder.is_dir():
            return frozenset()
        found = set()
        for p in folder.rglob("*.json"):
            try:
                found.add((str(p), p.stat().st_mtime))
            except FileNotFoundError:  # moved while we looked
                continue
        return frozenset(found)

    # ---- the end ----------------------------------------------------------------------------------------------
    def _closed(self, signum: int, frame: object) -> None:
        raise WindowClosed(f"signal {signum}")

    def close(self, status: str) -> None:
        """Stop a child still running, record the end, pack a last time, restore the SIGTERM handler."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the last pack short
        try:
            self.stop_child()
            self.say(f"window closed: {status} after {self.elapsed():.0f} s; " + self.seconds_by_phase())
            self.record("end", 0.0, status)
        finally:
            self.log.close()
            signal.signal(signal.SIGTERM, self._previous)
