"""A training engine in its own process, stepped from outside: what `bench/` times.

The parent (one pytest-benchmark round) asks the child for `n` training steps and waits for the reply, so every
timed round is real steps of a real engine driven by the harness's one run loop (`session.Session`, as in
`runner.run_in_subprocess`), in a fresh process like every run: DeepSpeed initialises cleanly once per process, changes
affinity and threads, and its overlap worker re-imports `__main__`. Model building and engine initialisation happen
before the first request (untimed). At the end the child writes a complete run record of every step it ran.

Protocol, one JSON line each way: parent -> {"steps": n} | {"finish": true}; child -> {"ok": true} or
{"error": "<traceback>"}. The child's file descriptor 1 is moved to stderr before the engine is built (DeepSpeed
logs to stdout), so library output cannot corrupt a reply.

    python -m zenflow.harness.stepper SPEC.json RECORD.json     # the child side
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any

from zenflow.harness.engines.registry import is_deepspeed
from zenflow.harness.preflight import check_build_locks
from zenflow.harness.processes import start_group, stop_group
from zenflow.harness.records import RunRecord
from zenflow.harness.runner import child_env, exit_on_sigterm
from zenflow.harness.session import RunSpec, Session, failed_record


class StepperError(RuntimeError):
    """The child failed (its traceback is in the message) or stopped answering."""


class SteppedEngine:
    """Parent side: `with SteppedEngine(spec, out) as eng: eng.steps(4) ...; record = eng.finish()`."""

    def __init__(self, spec: RunSpec, out: str | Path, timeout_s: float = 3600) -> None:
        if spec.num_gpus != 1:
            raise ValueError(f"num_gpus = {spec.num_gpus}: a stepped engine is one process (bench is single-GPU)")
        self.spec, self.out, self.timeout_s = spec, Path(out), timeout_s
        self.out.unlink(missing_ok=True)
        if is_deepspeed(spec.engine):
            check_build_locks()  # raises PreflightError naming the file: never a silent hang on a stale lock
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(asdict(spec), f)
        self._spec_file = Path(f.name)
        self._buffer = b""
        # A group of its own: close() stops the child and anything it started (DeepSpeed's overlap worker).
        self.proc = start_group([sys.executable, "-m", "zenflow.harness.stepper", f.name, str(self.out)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0, env=child_env(spec))
        try:
            self._reply()  # the child is ready: model built, engine initialised
        except BaseException:  # no `with` block owns the child yet: stop it here
            self.close()
            raise

    def steps(self, n: int) -> None:
        """Run `n` training steps in the child; returns when the last one finished (its loss was read)."""
        self._request({"steps": n})

    def finish(self) -> RunRecord:
        """Close the timeline, stop the engine, and return the record the child wrote."""
        self._request({"finish": True})
        self.proc.wait(timeout=60)
        return RunRecord.read(self.out)

    def close(self) -> None:
        # Never leave a child or its children running (failed test, Ctrl-C, timeout): SIGTERM the group, grace,
        # SIGKILL. Also after a clean finish, for anything the child left behind.
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()  # a child still reading its requests sees EOF and shuts its engine down
            except OSError:
                pass
        stop_group(self.proc)
        self._spec_file.unlink(missing_ok=True)
        if not self.out.exists():
            failed_record(self.spec, f"stepped child exited ({self.proc.returncode}) without a record").write(self.out)

    def __enter__(self) -> SteppedEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _request(self, message: dict[str, Any]) -> dict[str, Any]:
        try:
            self.proc.stdin.write((json.dumps(message) + "\n").encode())
        except BrokenPipeError:
            raise StepperError(f"{self.spec.engine}: the child exited ({self.proc.poll()})") from None
        return self._reply()

    def _reply(self) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout_s
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:  # the wait is a blocking read: the parent is idle while the child steps
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise StepperError(f"{self.spec.engine}: no reply within {self.timeout_s:.0f} s")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise StepperError(f"{self.spec.engine}: the child exited ({self.proc.wait()}) without a reply")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        reply = json.loads(line)
        if "error" in reply:
            raise StepperError(f"{self.spec.engine} failed in the child:\n{reply['error']}")
        return reply


def main(argv: list[str]) -> int:
    exit_on_sigterm()  # a stopped child still releases build locks and writes its failed record
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything printed from here on (DeepSpeed's logs included) goes to stderr
    sys.stdout = sys.stderr
    spec_path, out = argv

    def reply(**message: Any) -> None:
        replies.write(json.dumps(message) + "\n")

    spec = RunSpec(**json.loads(Path(spec_path).read_text()))
    spec.extra = {**spec.extra, "stepped": True}  # the record says its steps came in rounds
    session = None
    try:
        session = Session(spec)
        reply(ok=True)
        for line in sys.stdin:  # ends when the parent closes the pipe (or dies)
            request = json.loads(line)
            if "steps" in request:
                session.step(int(request["steps"]))
                reply(ok=True)
            elif request.get("finish"):
                session.finish().write(out)
                reply(ok=True)
                return 0
    except BaseException:
        error = traceback.format_exc()
        (failed_record(spec, error) if session is None else session.fail(error)).write(out)
        reply(error=error)
        if session is not None:
            try:
                session.close()  # stop a ZenFlow worker / DeepSpeed engine so the process can exit
            except Exception:
                pass
        return 1
    if session is not None:
        session.close()
    return 1  # the parent went away without asking to finish


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
