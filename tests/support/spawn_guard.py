"""Fail a test that starts an interpreter without being marked `slow`.

The fast tier (`make test-fast`, `-m "not slow"`) is the in-process tests. Starting an interpreter (a run child, two
ranks, DeepSpeed, a reproduce script) costs seconds; a test that does so unmarked would slip into the fast tier and
slow it down unnoticed. So while an unmarked test runs, `subprocess.Popen` of an interpreter, `os.fork` and
`multiprocessing`'s `Process.start` are refused, and the test fails naming what it started. Cheap tools (git,
nvidia-smi, ...) are not interpreters and stay allowed."""

from __future__ import annotations

import contextlib
import multiprocessing.process
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Program names that start an interpreter (or a tool that starts one): what makes a launch cost seconds.
INTERPRETER = re.compile(r"(python|torchrun|deepspeed|bash|sh|make|pip|pytest)[0-9.]*")


class SpawnRefused(RuntimeError):
    pass


def command_line(args: Any) -> list[str]:
    if isinstance(args, (str, bytes, os.PathLike)):
        return os.fsdecode(args).split()
    return [os.fsdecode(a) for a in args]


def starts_interpreter(program: str) -> bool:
    name = Path(program).name
    return name == Path(sys.executable).name or INTERPRETER.fullmatch(name) is not None


class SpawnGuard:
    """Installed once for the session; `running(item, allowed)` says which test runs and whether it may spawn."""

    def __init__(self) -> None:
        self.item: Any = None
        self.allowed = True
        self.refusals: dict[str, str] = {}  # node id -> the refusal its next passing report turns into a failure
        self.saved: dict[str, Any] = {}

    def install(self) -> None:
        guard = self
        popen_init, fork, start = subprocess.Popen.__init__, os.fork, multiprocessing.process.BaseProcess.start
        self.saved = {"popen": popen_init, "fork": fork, "start": start}

        def guarded_popen(popen: subprocess.Popen, args: Any, *a: Any, **kw: Any) -> None:
            line = command_line(args)
            if line and starts_interpreter(line[0]):
                guard.check(" ".join(line)[:160])
            popen_init(popen, args, *a, **kw)

        def guarded_fork() -> int:
            guard.check("os.fork()")
            return fork()

        def guarded_start(process: multiprocessing.process.BaseProcess) -> None:
            guard.check(f"multiprocessing {type(process).__name__}.start()")
            start(process)

        subprocess.Popen.__init__ = guarded_popen  # type: ignore[method-assign]
        os.fork = guarded_fork
        multiprocessing.process.BaseProcess.start = guarded_start  # type: ignore[method-assign]

    def uninstall(self) -> None:
        if self.saved:
            subprocess.Popen.__init__ = self.saved["popen"]  # type: ignore[method-assign]
            os.fork = self.saved["fork"]
            multiprocessing.process.BaseProcess.start = self.saved["start"]  # type: ignore[method-assign]

    @contextlib.contextmanager
    def running(self, item: Any, allowed: bool) -> Iterator[None]:
        self.item, self.allowed = item, allowed
        try:
            yield
        finally:
            self.item, self.allowed = None, True

    def check(self, what: str) -> None:
        if self.allowed or self.item is None:  # a fork of a slow test inherits allowed; an unmarked one cannot fork
            return
        message = (f"{self.item.nodeid} starts a process ({what}) but is not marked slow: start ranks through "
                   f"the torchrun fixture, or mark the test slow, script or deepspeed (tests/README.md)")
        self.refusals.setdefault(self.item.nodeid, message)
        raise SpawnRefused(message)

    def take_refusal(self, item: Any) -> str | None:
        """The refusal `item` has not yet failed for (then it has)."""
        return self.refusals.pop(item.nodeid, None)
