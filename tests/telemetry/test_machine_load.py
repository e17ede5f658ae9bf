"""telemetry.machine_load: other processes' CPU time, from the kernel's counters, counted outside this run's process
tree and not inside it. Linux only (the record says "not measured" elsewhere)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zenflow.telemetry import machine_load as ml

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs Linux's /proc")
SPIN = "import time\nend = time.time() + 20\nwhile time.time() < end: pass"


def _window(seconds: float = 1.5) -> dict:
    window = ml.LoadWindow.start()
    time.sleep(seconds)
    return window.stop()


def _outside_spinner() -> int:
    """A busy process that is not in this test's tree: started by a shell that exits at once (so it is reparented
    away from us), as another user's job would be."""
    out = subprocess.run(["sh", "-c", f"{sys.executable} -c '{SPIN}' >/dev/null 2>&1 & echo $!"],
                         capture_output=True, text=True, check=True).stdout
    return int(out.strip())


@pytest.mark.slow
def test_a_busy_process_outside_the_tree_is_counted() -> None:
    pid = _outside_spinner()
    try:
        time.sleep(0.3)
        load = _window()
    finally:
        os.kill(pid, signal.SIGKILL)
    assert load["measured"] and load["outside_cpu_s"] > 0.8  # about one core for 1.5 s
    assert load["outside_cpu_fraction"] > 0.8 / (1.5 * os.cpu_count())
    assert ml.busy(load, bound=0.2 / os.cpu_count())
    # and not over-counted: the share is those CPU seconds over (CPUs x wall time), whatever else this shared machine
    # runs meanwhile (a bound on the share itself would fail on a busy machine); the slack is the ticks' granularity
    # and the /proc scan between the kernel's counters and the wall clock
    per_cpu_wall = load["outside_cpu_s"] / (load["cpus"] * load["window_s"])
    assert load["outside_cpu_fraction"] == pytest.approx(per_cpu_wall, rel=0.3), load


@pytest.mark.slow
def test_the_runs_own_children_are_not_counted() -> None:
    """Negative control of the test above: the same spinner as our child is our own work."""
    child = subprocess.Popen([sys.executable, "-c", SPIN])
    try:
        time.sleep(0.3)
        load = _window()
    finally:
        child.kill()
        child.wait()
    assert load["own_cpu_s"] > 0.8
    assert load["outside_cpu_s"] < 0.5, load


@pytest.mark.slow
def test_tree_ticks_include_reaped_children() -> None:
    before = ml.tree_ticks(os.getpid())
    subprocess.run([sys.executable, "-c", "import time\nend = time.time() + 0.5\nwhile time.time() < end: pass"],
                   check=True)
    assert ml.tree_ticks(os.getpid()) - before >= 0.3 * os.sysconf("SC_CLK_TCK")  # its time moved to our cutime


def test_not_linux_says_so(monkeypatch) -> None:
    monkeypatch.setattr(ml, "machine_ticks", lambda: None)
    load = ml.LoadWindow.start().stop()
    assert load == {"measured": False, "reason": "no /proc/stat (not Linux)"} and not ml.busy(load)


# ---- exact shares, from a fake /proc -----------------------------------------------------------------------------
ROOT_PID, CHILD_PID, STRANGER_PID = 4242, 4243, 5000


def _cpu_line(user: int, idle: int, steal: int, guest: int) -> str:
    """/proc/stat's first line: user nice system idle iowait irq softirq steal guest guest_nice."""
    return f"cpu  {user} 0 0 {idle} 0 0 0 {steal} {guest} 0\ncpu0 0 0 0 0 0 0 0 0 0 0\n"


def _pid_stat(pid: int, ppid: int, utime: int) -> str:
    """/proc/<pid>/stat: a comm with a space and a parenthesis (why the module splits after the last ')'), then
    state, ppid, ... utime at field 14; stime, cutime and cstime 0."""
    return f"{pid} (py (x) y) S {ppid} " + "0 " * 9 + f"{utime} 0 0 0 20 0 1 0\n"


def _fake_proc(proc: Path, user: int, idle: int, steal: int, guest: int, own_utime: int) -> None:
    """`proc` as the module reads it: the machine's counters, our root (own_utime, two thirds of it), its child
    (the other third) and a stranger outside the tree (whatever ticks: only the machine's busy counts it)."""
    (proc / "stat").write_text(_cpu_line(user, idle, steal, guest))
    for pid, ppid, utime in ((ROOT_PID, 1, own_utime * 2 // 3), (CHILD_PID, ROOT_PID, own_utime // 3),
                             (STRANGER_PID, 1, 9999)):
        (proc / str(pid)).mkdir(exist_ok=True)
        (proc / str(pid) / "stat").write_text(_pid_stat(pid, ppid, utime))


@pytest.fixture
def fake_proc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """ml._PROC at tmp_path, this run rooted at ROOT_PID, on a 4-CPU machine: exact ticks in, exact shares out."""
    monkeypatch.setattr(ml, "_PROC", tmp_path)
    monkeypatch.setattr(ml, "own_root", lambda: ROOT_PID)
    monkeypatch.setattr(os, "cpu_count", lambda: 4)  # not 1: a share multiplied by the CPU count must show
    return tmp_path


def test_outside_and_steal_shares_are_ticks_over_the_machines_ticks(fake_proc: Path) -> None:
    """Over the window the machine counts 1000 ticks: 350 busy (300 of them our tree's, 50 a stranger's), 350
    idle, 300 stolen by the hypervisor, and 40 of guest time that is already inside user: 5% outside, 30% steal,
    so the run is BUSY on steal alone."""
    _fake_proc(fake_proc, user=1000, idle=1000, steal=0, guest=0, own_utime=150)
    window = ml.LoadWindow.start()
    _fake_proc(fake_proc, user=1350, idle=1350, steal=300, guest=40, own_utime=450)
    load = window.stop()
    assert (load["outside_cpu_fraction"], load["steal_fraction"]) == pytest.approx((0.05, 0.30))
    assert (load["own_cpu_s"], load["outside_cpu_s"]) == pytest.approx((300 / ml._TICKS, 50 / ml._TICKS))
    assert load["cpus"] == 4 and ml.busy(load) and not ml.busy(load, bound=0.30)  # above the bound, not at it


def test_own_root_is_self_unless_a_launcher_runs_several_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A single process (LOCAL_WORLD_SIZE unset or 1) is its own tree: its launcher's tree can hold sibling jobs
    (make -j, CI), which must count as outside. A rank of a multi-rank run counts its launcher's (every rank)."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    assert ml.own_root() == os.getpid()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert ml.own_root() == os.getpid()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert ml.own_root() == os.getppid()
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setenv("LOCAL_SIZE", "2")  # DeepSpeed's launcher
    assert ml.own_root() == os.getppid()
    monkeypatch.setenv("LOCAL_SIZE", "1")
    assert ml.own_root() == os.getpid()


def test_busy_means_over_a_tenth_of_the_machine_elsewhere() -> None:
    """docs/records.md: a scenario table names every run above 10% as BUSY, by other processes or by steal."""
    def load(outside: float, steal: float = 0.0) -> dict:
        return {"measured": True, "outside_cpu_fraction": outside, "steal_fraction": steal}
    assert ml.busy(load(0.12)) and ml.busy(load(0.0, steal=0.12))
    assert not ml.busy(load(0.09)) and not ml.busy(load(0.09, steal=0.09))
