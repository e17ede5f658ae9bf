"""telemetry.machine_load: other processes' CPU time, from the kernel's counters, counted outside this run's process
tree and not inside it (issue 24). Linux only (the record says "not measured" elsewhere)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

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


def test_tree_ticks_include_reaped_children() -> None:
    before = ml.tree_ticks(os.getpid())
    subprocess.run([sys.executable, "-c", "import time\nend = time.time() + 0.5\nwhile time.time() < end: pass"],
                   check=True)
    assert ml.tree_ticks(os.getpid()) - before >= 0.3 * os.sysconf("SC_CLK_TCK")  # its time moved to our cutime


def test_not_linux_says_so(monkeypatch) -> None:
    monkeypatch.setattr(ml, "machine_ticks", lambda: None)
    load = ml.LoadWindow.start().stop()
    assert load == {"measured": False, "reason": "no /proc/stat (not Linux)"} and not ml.busy(load)
