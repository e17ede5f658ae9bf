"""The host side's executor (overlap_step): the worker thread on its own cores, the jobs in flight, the bound on
them (backpressure) and the waits for them, each booked as a `host_wait` stall of the training thread.

Cores: DeepSpeed's `pt_reserved_cores_perc` split (reserved_cores) is made when the thread starts (`start`, or
the first job); `close` stops the thread and gives the training thread its compute layout back. A later job
starts a new thread (a Trainer that trains again after train end).

`before_job` is a hook for tests and diagnostics: called on the worker thread with the job's kind
("accumulate" or "host_update") before the job runs. What it raises fails that job (SystemExit ends the thread
with the job unfinished, as a crash would); a sleep makes the host part slow.

Why a thread and not a process: the host update is one fused torch kernel that releases the GIL, so a thread runs
it on its own cores at full speed while sharing the buffers with no copies, no pickling, no `__main__`
re-import (a plain script without an `if __name__ == "__main__":` guard works), and nothing to leave behind at exit.
docs/host-worker.md has the measurement behind this choice. What the jobs compute is host.py's.
"""

from __future__ import annotations

import functools
import os
import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from zenflow.hooks import Observers


class HostWorkerError(RuntimeError):
    """The host worker failed or died; the optimizer cannot continue without its result."""


class WorkerThread:
    """One background thread running jobs in submission order, pinned to its reserved cores."""

    POLL_SECONDS = 0.05  # how often a waiting step checks that the worker is still alive

    def __init__(self, cores: list[int] | None) -> None:
        self.cores = cores
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="zenflow-host-worker", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self.cores and hasattr(os, "sched_setaffinity"):
            pin_thread(self.cores)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, future = job
            del job  # hold nothing of a finished job (its gradients) while waiting for the next one
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn()
            except Exception as exc:  # surfaced to the training loop by wait()
                del fn
                future.set_exception(exc)
                continue
            del fn
            future.set_result(result)
            # anything else (SystemExit, a crash in C++) ends the thread: wait() notices the death

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, fn: Callable[[], object]) -> Future:
        if not self.alive:
            raise HostWorkerError("zenflow host worker is not running (closed or died); cannot submit a host update")
        future: Future = Future()
        self._jobs.put((fn, future))
        return future

    def wait(self, future: Future) -> object:
        """Block until the job is done (a sync point of the training loop); raise if the worker died."""
        while True:
            try:
                return future.result(timeout=self.POLL_SECONDS)
            except FutureTimeout:
                if not self.alive and not future.done():
                    raise HostWorkerError("zenflow host worker died before finishing a host update") from None
            except Exception as exc:
                raise HostWorkerError(f"zenflow host update failed on the worker: {exc!r}") from exc

    def close(self) -> None:
        if self.alive:
            self._jobs.put(None)
            self._thread.join()


class HostWorker:
    """An optimizer's `worker` (both optimizers'): one WorkerThread at a time, its core split, and its jobs (module
    docstring). The optimizer decides only what is submitted when."""

    def __init__(self, compute_fraction: float, observers: Observers,
                 before_job: Callable[[str], None] | None = None) -> None:
        self.compute_fraction = compute_fraction
        self.observers = observers
        self.before_job = before_job
        self.jobs: list[Future] = []  # every job not yet known to be finished, in submission order
        self.accumulations: list[Future] = []  # accumulations maybe still running (backpressure)
        self._thread: WorkerThread | None = None
        self._saved_layout: tuple[set[int], int] | None = None  # the training thread's cores and threads

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.alive

    @property
    def dead(self) -> bool:
        """Started and its thread ended without close(): it failed."""
        return self._thread is not None and not self._thread.alive

    def start(self) -> None:
        """Start the thread (once): it gets its own cores and the training thread computes on the rest."""
        if self._thread is not None:
            return
        split = reserved_cores(self.compute_fraction)
        if split is not None:
            worker_cores, compute_cores = split
            self._saved_layout = (os.sched_getaffinity(0), torch.get_num_threads())
            pin_thread(compute_cores)
        self._thread = WorkerThread(split[0] if split else None)
        weakref.finalize(self, self._thread.close)  # a dropped optimizer leaves no thread behind

    def submit(self, kind: str, job: Callable[[], object]) -> Future:
        """Queue `job` behind every earlier one (FIFO); kind: "accumulate" or "host_update"."""
        self.start()
        hook = self.before_job
        future = self._thread.submit(job if hook is None else functools.partial(_hooked, hook, kind, job))
        self.jobs.append(future)
        if kind == "accumulate":
            self.accumulations.append(future)
        return future

    def backpressure(self) -> None:
        """At most one accumulation queued behind the running one: wait (a stall) for older ones. This bounds
        the gradient sets background work holds (CPU device) and frees the staging buffer about to be reused."""
        while len(self.accumulations) > 1:
            oldest = self.accumulations.pop(0)
            if not oldest.done():
                with self.observers.blocking("host_wait"):
                    self._thread.wait(oldest)  # sync point: the host part is slower than a step

    def wait(self, future: Future) -> object:
        """The job's result; a sync point, booked as a stall."""
        with self.observers.blocking("host_wait"):
            return self._thread.wait(future)

    def result(self, future: Future) -> object:
        """The job's result; waits (a booked stall) only if it is not done yet."""
        return self._thread.wait(future) if future.done() else self.wait(future)

    def quiesce(self) -> None:
        """Wait until the worker has finished every job submitted so far (a sync point)."""
        if self.jobs:
            with self.observers.blocking("host_wait"):
                for future in self.jobs:
                    self._thread.wait(future)
            self.jobs.clear()
        self.accumulations.clear()

    def check(self) -> None:
        """Raise now if a job failed or the thread died with jobs in flight (never hang)."""
        for future in [f for f in self.jobs if f.done()]:
            self.jobs.remove(future)
            if future.exception() is not None:
                raise HostWorkerError(f"zenflow host worker job failed: {future.exception()!r}") \
                    from future.exception()
        if self.jobs and not self._thread.alive:
            raise HostWorkerError("zenflow host worker died with host work in flight; restart from a checkpoint")

    def close(self) -> None:
        """Stop the thread (queued jobs finish first) and give the training thread its cores back."""
        if self._thread is not None:
            self._thread.close()
            self._thread = None
            self.jobs.clear()
            self.accumulations.clear()
        if self._saved_layout is not None:
            cores, threads = self._saved_layout
            os.sched_setaffinity(0, cores)
            torch.set_num_threads(threads)
            self._saved_layout = None


def _hooked(hook: Callable[[str], None], kind: str, job: Callable[[], object]) -> object:
    hook(kind)  # on the worker thread
    return job()


def pin_thread(cores: list[int] | set[int]) -> None:
    """The calling thread on `cores` (Linux: pid 0 is the calling thread only) with one OpenMP thread per core (its
    team is this thread's own)."""
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))


def reserved_cores(compute_fraction: float) -> tuple[list[int], list[int]] | None:
    """Split this process's cores into (worker cores, compute cores); None if there is only one core.

    DeepSpeed's meaning of `pt_reserved_cores_perc`: the fraction kept for PyTorch compute; the rest run the
    host worker. Each side gets at least one core; 1.0 means no split at all.
    """
    if not hasattr(os, "sched_getaffinity") or compute_fraction >= 1.0:
        return None  # 1.0: compute keeps every core and the worker is not pinned (it shares them)
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None
    n_compute = min(len(cores) - 1, max(1, round(compute_fraction * len(cores))))
    return cores[n_compute:], cores[:n_compute]
