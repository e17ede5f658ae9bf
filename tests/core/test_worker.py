"""The overlap worker: failures surface as exceptions within 5 s, and nothing is left behind. Faults are injected
through the worker (`HostWorker.before_job`, run on the worker thread before each job)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import helpers
import pytest
import torch
from helpers import Interleaved, train_steps

from zenflow import HostWorkerError

OVERLAP = dict(topk_ratio=0.2, update_interval=2, overlap_step=True)


def worker_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "zenflow-host-worker" and t.is_alive()]


def fault(kind: str, action) -> object:
    """A HostWorker.before_job hook: `action()` on the worker thread before each job of that kind."""
    return lambda job_kind: action() if job_kind == kind else None


def crash() -> None:
    sys.exit()  # ends the worker thread without resolving its job, as a crash would


def wait_for_death(opt) -> None:
    deadline = time.monotonic() + 5
    while opt.worker.alive and time.monotonic() < deadline:
        time.sleep(0.01)
    assert opt.worker.dead


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the death is the point
def test_killed_worker_with_an_update_in_flight_raises_within_5s(zenflow_opt):
    model = Interleaved([8, 8, 3], seed=0)
    opt = zenflow_opt(model, **OVERLAP)
    train_steps(model, opt, 3, seed=0)
    opt.worker.before_job = fault("host_update", crash)
    train_steps(model, opt, 1, seed=0, start=3)  # a boundary: its host update is queued, the worker dies on it
    wait_for_death(opt)
    start = time.monotonic()
    with pytest.raises(HostWorkerError, match="died with host work in flight"):
        train_steps(model, opt, 1, seed=0, start=4)
    assert time.monotonic() - start < 5
    opt.close()


def test_failed_background_accumulation_surfaces_at_the_next_step(zenflow_opt):
    def broken() -> None:
        raise RuntimeError("gather failed (simulated)")

    model = Interleaved([8, 8, 3], seed=0)
    opt = zenflow_opt(model, **OVERLAP)
    opt.worker.before_job = fault("accumulate", broken)
    train_steps(model, opt, 1, seed=0)  # the first step is the selection; its accumulation fails on the worker
    time.sleep(0.2)
    with pytest.raises(HostWorkerError, match="simulated"):
        train_steps(model, opt, 1, seed=0, start=1)
    opt.close(flush=False)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the death is the point
def test_worker_thread_dying_in_the_middle_of_a_host_update_raises_within_5s(zenflow_opt):
    def dies() -> None:
        time.sleep(0.3)
        crash()

    model = Interleaved([8, 8, 3], seed=0)
    opt = zenflow_opt(model, **OVERLAP)
    opt.worker.before_job = fault("host_update", dies)
    train_steps(model, opt, 2, seed=0)  # boundary 1 submitted; the worker dies while running it
    start = time.monotonic()
    with pytest.raises(HostWorkerError, match="died"):
        train_steps(model, opt, 2, seed=0, start=2)  # boundary 2 waits for boundary 1
    assert time.monotonic() - start < 5
    opt.close(flush=False)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the death is the point
def test_worker_dead_at_a_boundary_raises_instead_of_submitting(zenflow_opt):
    model = Interleaved([8, 8, 3], seed=0)
    opt = zenflow_opt(model, **OVERLAP)
    train_steps(model, opt, 2, seed=0)
    opt.worker.before_job = fault("accumulate", crash)
    train_steps(model, opt, 1, seed=0, start=2)  # not a boundary: the worker dies on its accumulation
    wait_for_death(opt)
    with pytest.raises(HostWorkerError, match="not running"):
        opt.worker.submit("host_update", lambda: None)  # a dead worker takes no job: it raises, never queues
    start = time.monotonic()
    with pytest.raises(HostWorkerError):
        train_steps(model, opt, 3, seed=0, start=3)
    assert time.monotonic() - start < 5
    opt.close(flush=False)


def test_exception_in_host_update_surfaces_at_the_next_boundary(zenflow_opt):
    def broken() -> None:
        raise MemoryError("host out of memory (simulated)")

    model = Interleaved([8, 8, 3], seed=0)
    opt = zenflow_opt(model, **OVERLAP)
    opt.worker.before_job = fault("host_update", broken)
    start = time.monotonic()
    with pytest.raises(HostWorkerError, match="simulated"):
        train_steps(model, opt, 6, seed=0)
    assert time.monotonic() - start < 5
    opt.close(flush=False)


def test_close_and_with_block_stop_the_worker_and_restore_compute_cores(zenflow_opt):
    cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
    model = Interleaved([8, 8, 3], seed=0)
    with zenflow_opt(model, **OVERLAP) as opt:
        assert worker_threads()
        train_steps(model, opt, 5, seed=0)
    assert not worker_threads()
    assert os.sched_getaffinity(0) == cores and torch.get_num_threads() == threads
    assert opt.pending is None  # the with block drained the last host update


@pytest.mark.slow
def test_plain_script_without_main_guard_exits_cleanly_with_the_worker_running(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {os.path.dirname(helpers.__file__)!r})
        from helpers import Interleaved, train_steps, zenflow
        model = Interleaved([8, 8, 3], seed=0)
        opt = zenflow(model, topk_ratio=0.2, update_interval=2, overlap_step=True)
        train_steps(model, opt, 7, seed=0)
        print("trained", opt.host_updates)
        # no close(), no __main__ guard: interpreter exit must not hang or leave anything behind
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "trained 3" in done.stdout


@pytest.mark.parametrize("n_cores, fraction, worker, compute", [
    (2, 0.75, [1], [0]),             # 0.75 of 2 rounds to 2: compute would take both, the worker keeps one
    (2, 0.1, [1], [0]),              # 0.1 of 2 rounds to 0: compute keeps one
    (4, 0.5, [2, 3], [0, 1]),
    (8, 0.75, [6, 7], [0, 1, 2, 3, 4, 5]),
])
def test_reserved_cores_give_each_side_at_least_one_core(monkeypatch, n_cores, fraction, worker, compute):
    """`reserved_cores` splits the cores as DeepSpeed's pt_reserved_cores_perc does (the fraction for
    compute, the rest for the worker), and each side gets at least one core."""
    from zenflow.worker import reserved_cores

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(n_cores)))
    assert reserved_cores(fraction) == (worker, compute)
