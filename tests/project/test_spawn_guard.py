"""The fast tier stays in-process: a test that starts an interpreter without `slow` fails (tests/support/spawn_guard.py,
tests/conftest.py), whether it lets the refusal through or swallows it; a marked one, or a cheap tool, passes."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest
from spawn_guard import SpawnRefused, starts_interpreter

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"
SUPPORT = CONFTEST.parent / "support"

INNER = '''
import subprocess, sys
import pytest

def test_lets_it_through():
    subprocess.run([sys.executable, "-c", "pass"])

def test_swallows_it():
    try:
        subprocess.run([sys.executable, "-c", "pass"])
    except Exception:
        pass

def test_through_a_fixture_that_marks_it(torchrun):
    subprocess.run([sys.executable, "-c", "pass"], check=True)

@pytest.mark.slow
def test_marked_slow():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

def test_a_cheap_tool():
    subprocess.run(["git", "--version"], check=True, capture_output=True)
'''


def test_what_counts_as_an_interpreter() -> None:
    assert all(starts_interpreter(p) for p in [sys.executable, "python3.12", "torchrun", "bash", "/bin/sh", "pip3"])
    assert not any(starts_interpreter(p) for p in ["git", "nvidia-smi", "sha256sum", "shasum", "lscpu"])


@pytest.mark.parametrize("start", ["popen", "fork", "multiprocessing"])
def test_an_unmarked_test_is_refused_before_the_process_starts(start: str, request: pytest.FixtureRequest,
                                                               spawn_guard) -> None:
    how = {"popen": lambda: subprocess.run([sys.executable, "-c", "pass"]),
           "fork": os.fork,
           "multiprocessing": lambda: multiprocessing.get_context("spawn").Process(target=print).start()}[start]
    with pytest.raises(SpawnRefused, match="is not marked slow"):
        how()
    assert "is not marked slow" in spawn_guard.take_refusal(request.node)  # else this test would fail at its report


@pytest.mark.slow
def test_a_test_that_starts_an_interpreter_unmarked_fails_even_if_it_swallows_the_refusal(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile(test_inner=INNER)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(SUPPORT), os.environ.get("PYTHONPATH", "")]))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q")
    result.assert_outcomes(passed=3, failed=2)
    result.stdout.fnmatch_lines(["*test_lets_it_through*not marked slow*", "*test_swallows_it*not marked slow*"])
