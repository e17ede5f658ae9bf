"""No silent hang on DeepSpeed's op builds: a killed build's lock file is found and named, and a
stopped run child releases the lock it holds instead of leaving it behind."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from zenflow.harness.preflight import PreflightError, check_build_locks, stale_build_locks
from zenflow.harness.processes import start_group, stop_group
from zenflow.harness.runner import RunSpec, run_in_subprocess


def _lock(root: Path, age_s: float) -> Path:
    lock = root / "py311_cpu" / "cpu_adam" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    os.utime(lock, (time.time() - age_s, time.time() - age_s))
    return lock


def test_an_old_build_lock_is_named_with_the_command_that_removes_it(tmp_path):
    lock = _lock(tmp_path, age_s=3600)
    assert [p for p, _ in stale_build_locks(tmp_path)] == [lock]
    with pytest.raises(PreflightError, match=f"rm {lock}"):
        check_build_locks(tmp_path)


def test_a_build_in_progress_is_not_stale(tmp_path):
    _lock(tmp_path, age_s=30)
    assert stale_build_locks(tmp_path) == []
    check_build_locks(tmp_path)


def test_a_deepspeed_run_fails_at_once_on_a_stale_lock_instead_of_hanging(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    _lock(tmp_path / "ext", age_s=3600)
    spec = RunSpec(engine="ds-zero-offload", label="t", workload={"model": "cpu-scale"}, ds_config={},
                   progress=False)
    start = time.monotonic()
    record = run_in_subprocess(spec, tmp_path / "r.json", timeout_s=60)
    assert record.status == "failed" and "stale torch-extensions build lock" in record.error
    assert time.monotonic() - start < 10


@pytest.mark.slow
def test_a_stopped_child_releases_the_build_lock_it_holds(tmp_path):
    """What torch's cpp_extension does while DeepSpeed builds an op: hold a FileBaton in try/finally. SIGTERM used
    to end the process before `finally`, leaving the lock; the run child turns it into SystemExit."""
    lock, ready = tmp_path / "lock", tmp_path / "ready"
    child = textwrap.dedent(f"""
        import time
        from torch.utils.file_baton import FileBaton
        from zenflow.harness.runner import exit_on_sigterm
        exit_on_sigterm()
        baton = FileBaton({str(lock)!r})
        assert baton.try_acquire()
        try:
            open({str(ready)!r}, "w").close()
            time.sleep(60)  # "building"
        finally:
            baton.release()
    """)
    proc = start_group([sys.executable, "-c", child], stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert time.monotonic() < deadline and proc.poll() is None, "the child did not start building"
        time.sleep(0.05)
    assert lock.exists()
    stop_group(proc, grace_s=10)
    assert not lock.exists()
