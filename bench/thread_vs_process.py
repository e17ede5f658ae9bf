"""Should the ZenFlow host worker be a thread or a process?  python bench/thread_vs_process.py

The main thread, pinned to one core with one torch thread, runs a fixed amount of "device compute" (1024x1024 fp32
matmuls, calibrated to ~1 s). The host worker, pinned to another core with one torch thread, runs a fixed AdamW job
(zenflow.adam.adamw_ on 10M fp32 params, repeated to ~1 s so it spans the compute):

    thread   zenflow.worker.WorkerThread (a threading.Thread; it pins itself with os.sched_setaffinity(0, cores) and
             calls torch.set_num_threads inside the thread); the buffers are ordinary tensors
    process  a torch.multiprocessing "spawn" process pinned to the same core; the buffers are share_memory_()
             tensors handed over at start; jobs and results cross a multiprocessing Pipe

Measured for each: worker start-up (until it has answered its first message; for the process including the
share_memory_() of the buffers, also shown apart), per-job hand-off latency (submit a no-op job and wait, median of 50),
the AdamW job alone, the compute alone (each the mean of a run just before and one just after the concurrent run,
which damps drift on a shared machine), and both concurrently (wall time from submit to both done, and the
slow-down of each against its own alone time). Every figure is the median of REPEATS repeats, interleaved
(thread, process, thread, ...) so machine noise hits both alike; each repeat starts a fresh worker.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.multiprocessing as mp
from tabulate import tabulate

from zenflow.adam import AdamWHyper, adamw_
from zenflow.worker import WorkerThread

NUMEL = 10_000_000  # host AdamW params (fp32): 4 buffers, 160 MB
MM_SIZE = 1024
TARGET_SECONDS = 1.0  # both the compute and the AdamW job are calibrated to about this long
REPEATS = 5
HANDOFFS = 50
HYPER = AdamWHyper(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


# ---- the work ---------------------------------------------------------------------------------------------------
def make_buffers(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(NUMEL, generator=gen), torch.randn(NUMEL, generator=gen) * 1e-2,
            torch.zeros(NUMEL), torch.zeros(NUMEL)]  # param, grad, exp_avg, exp_avg_sq


def adamw_job(bufs: list[torch.Tensor], reps: int) -> float:
    """`reps` host AdamW updates in place; returns the seconds they took (measured where they ran)."""
    param, grad, exp_avg, exp_avg_sq = bufs
    start = time.perf_counter()
    for step in range(1, reps + 1):
        adamw_([param], [grad], [exp_avg], [exp_avg_sq], [step], HYPER)
    return time.perf_counter() - start


def device_compute(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        torch.mm(a, b, out=out)
    return time.perf_counter() - start


def noop() -> None:
    return None


# ---- the two workers, behind one interface ------------------------------------------------------------------------
class ThreadWorker:
    name = "thread"

    def __init__(self, bufs: list[torch.Tensor], core: int) -> None:
        self.bufs = bufs
        self.shm_seconds = 0.0
        start = time.perf_counter()
        self.worker = WorkerThread([core])
        self.worker.wait(self.worker.submit(noop))  # started, pinned, answering
        self.startup_seconds = time.perf_counter() - start

    def submit_adamw(self, reps: int) -> Callable[[], float]:
        future = self.worker.submit(lambda: adamw_job(self.bufs, reps))
        return lambda: self.worker.wait(future)

    def handoff(self) -> float:
        start = time.perf_counter()
        self.worker.wait(self.worker.submit(noop))
        return time.perf_counter() - start

    def close(self) -> None:
        self.worker.close()


def _process_main(conn, bufs: list[torch.Tensor], core: int) -> None:
    """The worker process: pin, then serve ("noop", None) and ("adamw", reps) until None arrives."""
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        kind, arg = msg
        conn.send(None if kind == "noop" else adamw_job(bufs, arg))


class ProcessWorker:
    name = "process"

    def __init__(self, bufs: list[torch.Tensor], core: int) -> None:
        start = time.perf_counter()
        for t in bufs:
            t.share_memory_()  # copies each storage into shared memory once
        self.shm_seconds = time.perf_counter() - start
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_process_main, args=(child, bufs, core), name="zenflow-host-process",
                                daemon=True)
        self.proc.start()
        child.close()
        if self.conn.recv() != "ready":
            raise RuntimeError("worker process did not start")
        self.startup_seconds = time.perf_counter() - start

    def run(self, msg: tuple[str, object]) -> object:
        self.conn.send(msg)
        return self.conn.recv()

    def submit_adamw(self, reps: int) -> Callable[[], float]:
        self.conn.send(("adamw", reps))
        return self.conn.recv

    def handoff(self) -> float:
        start = time.perf_counter()
        self.run(("noop", None))
        return time.perf_counter() - start

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join()
        self.conn.close()


# ---- one repeat ---------------------------------------------------------------------------------------------------
def measure(kind: type, core: int, seed: int, reps: int, mm: tuple[torch.Tensor, ...], n_mm: int) -> dict:
    bufs = make_buffers(seed)
    worker = kind(bufs, core)
    try:
        worker.submit_adamw(1)()  # warm-up: first touch of the buffers from the worker
        for _ in range(5):
            worker.handoff()
        handoff = statistics.median(worker.handoff() for _ in range(HANDOFFS))
        adamw_before, compute_before = worker.submit_adamw(reps)(), device_compute(*mm, n_mm)
        start = time.perf_counter()
        wait = worker.submit_adamw(reps)
        compute_both = device_compute(*mm, n_mm)
        adamw_both = wait()
        wall = time.perf_counter() - start
        adamw_after, compute_after = worker.submit_adamw(reps)(), device_compute(*mm, n_mm)
        adamw_alone, compute_alone = (adamw_before + adamw_after) / 2, (compute_before + compute_after) / 2
    finally:
        worker.close()
    return dict(startup=worker.startup_seconds, shm=worker.shm_seconds, handoff=handoff, adamw_alone=adamw_alone,
                compute_alone=compute_alone, wall=wall, serial=adamw_alone + compute_alone,
                compute_slowdown=compute_both / compute_alone, adamw_slowdown=adamw_both / adamw_alone)


ROWS = [  # (label, key, scale, format)
    ("worker start-up (ms)", "startup", 1e3, ".1f"),
    ("  of which share_memory_() of the buffers (ms)", "shm", 1e3, ".1f"),
    ("hand-off latency, no-op job round trip (us, median of 50)", "handoff", 1e6, ".1f"),
    ("host AdamW job alone (ms)", "adamw_alone", 1e3, ".0f"),
    ("compute alone (ms)", "compute_alone", 1e3, ".0f"),
    ("concurrent wall time (ms)", "wall", 1e3, ".0f"),
    ("  vs. one after the other (ms)", "serial", 1e3, ".0f"),
    ("compute slow-down when concurrent (x)", "compute_slowdown", 1, ".3f"),
    ("host AdamW slow-down when concurrent (x)", "adamw_slowdown", 1, ".3f"),
]


def main() -> None:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        sys.exit("needs at least two cores (main and worker each get one)")
    main_core, worker_core = cores[0], cores[1]
    os.sched_setaffinity(0, {main_core})
    torch.set_num_threads(1)

    gen = torch.Generator().manual_seed(0)
    mm = (torch.randn(MM_SIZE, MM_SIZE, generator=gen), torch.randn(MM_SIZE, MM_SIZE, generator=gen),
          torch.empty(MM_SIZE, MM_SIZE))
    device_compute(*mm, 3)
    per_mm = statistics.median(device_compute(*mm, 1) for _ in range(5))
    n_mm = max(1, math.ceil(TARGET_SECONDS / per_mm))
    bufs = make_buffers(0)
    adamw_job(bufs, 1)
    per_adamw = statistics.median(adamw_job(bufs, 1) for _ in range(3))
    reps = max(1, round(TARGET_SECONDS / per_adamw))
    del bufs

    print(f"torch {torch.__version__}, cores {cores}: main on {main_core}, worker on {worker_core}, "
          f"1 torch thread each")
    print(f"compute: {n_mm} x mm({MM_SIZE}x{MM_SIZE} fp32) ({per_mm * 1e3:.1f} ms each, calibrated alone)")
    print(f"host AdamW job: {reps} x zenflow.adam.adamw_ on {NUMEL / 1e6:.0f}M fp32 params "
          f"({per_adamw * 1e3:.1f} ms each, {28 * NUMEL / per_adamw / 1e9:.1f} GB/s, calibrated alone)")
    print(f"medians (min-max) of {REPEATS} interleaved repeats, a fresh worker each\n")

    results: dict[str, list[dict]] = {"thread": [], "process": []}
    for r in range(REPEATS):
        for kind in (ThreadWorker, ProcessWorker):
            results[kind.name].append(measure(kind, worker_core, r + 1, reps, mm, n_mm))
            print(f"  repeat {r + 1}/{REPEATS} {kind.name:7s} done", file=sys.stderr)

    def cell(name: str, key: str, scale: float, fmt: str) -> str:
        if key == "shm" and name == "thread":
            return "-"
        values = sorted(x[key] * scale for x in results[name])
        return f"{statistics.median(values):{fmt}} ({values[0]:{fmt}}-{values[-1]:{fmt}})"

    table = [[label] + [cell(name, key, scale, fmt) for name in ("thread", "process")]
             for label, key, scale, fmt in ROWS]
    print(tabulate(table, headers=["median (min-max)", "thread", "process"], tablefmt="github",
                   colalign=("left", "right", "right")))


if __name__ == "__main__":
    main()
