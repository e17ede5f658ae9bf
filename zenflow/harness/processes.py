"""Child processes that never outlive their run.

Every run child is started in a session (and process group) of its own, so that everything it starts -- DeepSpeed
launcher ranks, DeepSpeed's spawned ZenFlow worker, dataloader workers -- can be stopped together. `stop_group`
sends SIGTERM to the whole group (the DeepSpeed launcher cleans up its ranks on SIGTERM, SIGKILL would orphan them
with their GPU memory, NCCL ports and pinned host memory), waits a grace period, then SIGKILLs what is left.

A session of its own also keeps the child out of the terminal's foreground group: Ctrl-C reaches the parent only,
which then stops the group in order instead of every process dying at once.

The other side of that: a parent that is SIGKILLed (a host's 10-minute command limit, the OOM killer) cannot stop
anything, and the child, in a session of its own, would run on holding its GPU memory, pinned host memory and any
op-build lock into the next command. So on Linux the child asks the kernel for SIGTERM when its
parent dies (PR_SET_PDEATHSIG): SIGTERM, not SIGKILL, so the child's own cleanup runs (runner.exit_on_sigterm:
the build lock's `finally`, its failure record); a DeepSpeed launcher or torchrun child passes SIGTERM on to its
ranks. The kernel ties the signal to the *thread* that forked, not the process, so start_group asks for it only
from the main thread: a child started from a helper thread would be killed when that thread ends.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

GRACE_S = 10.0  # SIGTERM -> SIGKILL; DeepSpeed's launcher needs a moment to terminate its ranks
DEATH_SIGNAL = signal.SIGTERM  # what a child gets when its parent dies: catchable, so its cleanup runs
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}  # what stops a plan (plans.py turns SIGTERM into Ctrl-C)


def start_group(cmd: list[str], die_with_parent: bool = True, **popen_kwargs: Any) -> subprocess.Popen:
    """`subprocess.Popen(cmd, ...)` as the leader of a new session and process group (pgid == pid). With
    `die_with_parent` (Linux, called from the main thread) the child gets SIGTERM when this process dies, however
    it dies; False (or elsewhere) it outlives a parent that is killed without stopping it."""
    death_signal = _death_signal_setter() if die_with_parent else None
    if death_signal is None:
        return subprocess.Popen(cmd, start_new_session=True, **popen_kwargs)
    # With a preexec_fn, CPython runs its at-fork callbacks (logging's lock release) in this process after the
    # fork, where an exception from a signal handler is only printed ("Exception ignored"): a SIGTERM or Ctrl-C
    # there would be lost and the plan would carry on. So both wait, blocked, until the child exists; the child
    # restores the mask before exec, and a stop that came meanwhile is handled here, stopping the child too.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)

    def preexec() -> None:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        death_signal()

    proc = None
    try:
        proc = subprocess.Popen(cmd, start_new_session=True, preexec_fn=preexec, **popen_kwargs)
    finally:
        try:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # a pending SIGTERM or SIGINT is handled now
        except BaseException:
            if proc is not None:
                stop_group(proc)
            raise
    return proc


def _death_signal_setter() -> Callable[[], None] | None:
    """A preexec_fn (runs in the child between fork and exec) that sets PR_SET_PDEATHSIG, or None where that is
    unavailable (not Linux) or would fire too early (not the main thread: see the module docstring). Everything it
    needs is looked up here, in the parent: the child only makes two system calls."""
    prctl = _prctl()
    if prctl is None or threading.current_thread() is not threading.main_thread():
        return None
    parent = os.getpid()

    def set_death_signal() -> None:
        prctl(_PR_SET_PDEATHSIG, int(DEATH_SIGNAL), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect: no signal will come, act on it now
            os._exit(128 + int(DEATH_SIGNAL))
    return set_death_signal


@functools.lru_cache(maxsize=1)
def _prctl() -> Any:
    """libc's prctl, or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None).prctl  # the running interpreter's own libc
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, *[ctypes.c_ulong] * 4]  # variadic in C: give every argument its full width
    prctl.restype = ctypes.c_int
    return prctl


def group_alive(pgid: int) -> bool:
    """True while any process of the group is still running. A zombie (exited, waiting for whoever adopted it to
    reap it; in some containers nobody does) does not count: it holds no GPU, port or memory."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):  # PermissionError: the id now belongs to someone else's group
        return False
    try:
        return any(_running_in(pgid, entry) for entry in os.scandir("/proc") if entry.name.isdigit())
    except OSError:  # no /proc (not Linux): trust killpg
        return True


def _running_in(pgid: int, entry: os.DirEntry) -> bool:
    try:
        with open(os.path.join(entry.path, "stat")) as f:
            state, _ppid, pgrp = f.read().rsplit(")", 1)[1].split()[:3]  # after "pid (comm)"
    except (OSError, ValueError):
        return False  # exited while we looked
    return int(pgrp) == pgid and state != "Z"


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_group(proc: subprocess.Popen, grace_s: float | None = None) -> int | None:
    """Stop `proc` and every process of its group: SIGTERM, up to `grace_s` (default GRACE_S) for all of them to
    exit, then SIGKILL. Also called when the leader has already exited, to stop what it left behind. Returns the
    leader's exit code."""
    pgid = proc.pid  # start_group made it the group leader; the group id outlives the leader while members remain
    _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + (GRACE_S if grace_s is None else grace_s)
    while time.monotonic() < deadline:
        proc.poll()  # reap the leader, else it stays a zombie member of its own group
        if proc.returncode is not None and not group_alive(pgid):
            return proc.returncode
        time.sleep(0.05)
    _signal_group(pgid, signal.SIGKILL)
    return proc.wait()


def bind_rank_cores() -> list[int]:
    """Pin this rank (LOCAL_RANK of LOCAL_WORLD_SIZE, as torchrun sets them) to its contiguous share of the cores
    this process may use, so W ranks on one CPU host do not fight over cores (DeepSpeed's --bind_cores_to_rank)."""
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    # torchrun sets LOCAL_WORLD_SIZE; the DeepSpeed launcher on one host sets LOCAL_SIZE (and WORLD_SIZE)
    world = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or os.environ.get("WORLD_SIZE", "1"))
    cores = sorted(os.sched_getaffinity(0))
    share = max(1, len(cores) // world)
    mine = cores[rank * share:(rank + 1) * share] or cores[-share:]
    os.sched_setaffinity(0, mine)
    return mine
