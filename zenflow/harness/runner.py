"""Run one (engine, workload, config) in a fresh subprocess and write its run record.

Fresh process per run: DeepSpeed changes process affinity and threads, and its overlap worker re-imports
`__main__`. The child writes its record atomically, also when it fails; if it dies without one (killed, out of
memory), the parent writes a `status: "failed"` record with the exit code and the end of its stderr. The child is
`Session(spec).run()` (session.py): the one training loop every measurement drives.

    python -m zenflow.harness.runner SPEC.json RECORD.json     # the child side
"""

from __future__ import annotations

import collections
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from dataclasses import asdict
from pathlib import Path

from zenflow.harness.engines.registry import is_deepspeed, unavailable
from zenflow.harness.preflight import PreflightError, check_build_locks, torch_extensions_dir
from zenflow.harness.processes import start_group, stop_group
from zenflow.harness.records import RunRecord, skip_error
from zenflow.harness.session import RunSpec, Session, failed_record

# How the record of a run stopped by Ctrl-C (or SIGTERM, which plans.py turns into one) starts: publish leaves it out
INTERRUPTED = "interrupted"


def run_in_subprocess(spec: RunSpec, out: str | Path, timeout_s: float = 3600) -> RunRecord:
    """Run `spec` in a child interpreter; always returns a complete record (ok, failed, or skipped when a DeepSpeed
    engine is asked for and DeepSpeed is not installed). On timeout, Ctrl-C or any error the child's whole process
    group is stopped (SIGTERM, grace, SIGKILL: processes.py), so no rank or worker outlives the run."""
    out = Path(out)
    out.unlink(missing_ok=True)
    why_not = unavailable(spec.engine, spec.workload.get("device", "auto"), spec.placement)
    if why_not:  # by design: the library is absent, or the engine cannot run on this device
        _skipped(spec, skip_error(why_not, sys.executable)).write(out)
        return RunRecord.read(out)
    if is_deepspeed(spec.engine):
        try:
            check_build_locks()  # a stale op-build lock would make this run wait forever, silently
        except PreflightError as exc:
            failed_record(spec, str(exc)).write(out)
            return RunRecord.read(out)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(asdict(spec), f)
    stderr_tail, code = "", None
    try:
        proc = start_group([*_launcher(spec), f.name, str(out)], stderr=subprocess.PIPE, text=True,
                           env=child_env(spec))
        tail: collections.deque[str] = collections.deque(maxlen=40)
        relay = threading.Thread(target=_relay_stderr, args=(proc, tail), daemon=True)
        relay.start()
        try:
            code = proc.wait(timeout=timeout_s)
        finally:  # timeout, Ctrl-C, or a clean exit that left something behind: stop the whole group
            stop_group(proc)
            relay.join(timeout=5)
            stderr_tail = "".join(tail)
    except subprocess.TimeoutExpired:
        code = f"timeout after {timeout_s:.0f} s"
        child_error = RunRecord.read(out).error if out.exists() else ""  # the stopped child's own record, if any
        failed_record(spec, f"{code}: stopped (SIGTERM, then SIGKILL after a grace period)\n{child_error}",
                stderr_tail).write(out)
    except KeyboardInterrupt:
        failed_record(spec, f"{INTERRUPTED} (KeyboardInterrupt)", stderr_tail).write(out)
        raise
    finally:
        Path(f.name).unlink(missing_ok=True)
    if not out.exists():
        _died(spec, code, stderr_tail).write(out)
    return RunRecord.read(out)


def exit_reason(code: int | str | None) -> str:
    """Why a child left no record, in words: a negative exit code is the signal that killed it (Popen's way)."""
    if not isinstance(code, int) or code >= 0:
        return f"child exited ({code}) without a record"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = "an unknown signal"
    reason = f"child killed by {name} (signal {-code}) without a record"
    # The harness SIGKILLs a child only after SIGTERM, on a timeout or Ctrl-C, and those paths write their own
    # record: this one came from outside, on a training host almost always the kernel's OOM killer.
    return reason + (", likely the host's OOM killer (see dmesg)" if -code == signal.SIGKILL else "")


def _died(spec: RunSpec, code: int | str | None, stderr_tail: str) -> RunRecord:
    """The failed record of a child that left none. A killed child's stderr ends wherever it was cut (a progress
    bar), so the reason also closes the error: the console shows the error's last line (plans._outcome)."""
    reason = exit_reason(code)
    if isinstance(code, int) and code < 0:
        stderr_tail = f"{stderr_tail.rstrip()}\n{reason}" if stderr_tail.strip() else ""
    return failed_record(spec, reason, stderr_tail)


def _launcher(spec: RunSpec) -> list[str]:
    """One plain child process; for W > 1 ranks, torchrun (our engines: nccl on GPUs, gloo on the CPU with each rank
    on its share of the cores) or the DeepSpeed launcher (DeepSpeed engines). Rank 0 writes the record.

    The launcher deletes CUDA_VISIBLE_DEVICES when `--num_gpus` is given (its ranks would land on GPUs 0..N-1, not
    on the ones this job was given), so with CUDA_VISIBLE_DEVICES set the ranks are named with `--include`. A free
    `--master_port` lets two runs share a host (the launcher's default is a fixed 29500)."""
    if spec.num_gpus == 1:
        return [sys.executable, "-m", "zenflow.harness.runner"]
    if not is_deepspeed(spec.engine):
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={spec.num_gpus}",
                "-m", "zenflow.harness.runner"]
    # The `deepspeed` command's own module, run by this interpreter: no reliance on a script next to it (VENV=).
    return [sys.executable, "-m", "deepspeed.launcher.runner",
            *_gpu_selection(spec.num_gpus, os.environ.get("CUDA_VISIBLE_DEVICES")),
            "--master_port", str(free_port()), "--module", "zenflow.harness.runner"]


def child_env(spec: RunSpec) -> dict[str, str]:
    """The run child's environment: ours, unbuffered, and DeepSpeed kept on the CPU for a cpu workload (it picks
    CUDA whenever it can, and the child's environment capture resolves its accelerator before the engine exists).
    DeepSpeed's op builds go where check_build_locks looks (preflight.torch_extensions_dir: the user's
    TORCH_EXTENSIONS_DIR, else the checkout's ignored build/, which a warm GPU machine keeps between commands)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TORCH_EXTENSIONS_DIR": str(torch_extensions_dir())}
    if spec.num_gpus == 1:  # a single process: a rank/world inherited from a torchrun or SLURM shell is not ours
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)
    if spec.workload.get("device") == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
        if spec.num_gpus > 1:
            env["LOCAL_SIZE"] = str(spec.num_gpus)  # DeepSpeed's CPU accelerator: its "device" count (ranks)
    return env


def _gpu_selection(num_gpus: int, visible: str | None) -> list[str]:
    """DeepSpeed launcher flags for `num_gpus` ranks: the first `num_gpus` of CUDA_VISIBLE_DEVICES when it is set."""
    if visible is None or not visible.strip():
        return ["--num_gpus", str(num_gpus)]
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    if not all(v.isdigit() for v in ids):
        raise ValueError(f"CUDA_VISIBLE_DEVICES = {visible!r}: the DeepSpeed launcher's --include takes GPU indices, "
                         "not UUIDs or MIG names; set CUDA_VISIBLE_DEVICES to indices")
    if len(ids) < num_gpus:
        raise ValueError(f"num_gpus = {num_gpus} but CUDA_VISIBLE_DEVICES = {visible!r} makes {len(ids)} visible")
    return ["--include", "localhost:" + ",".join(ids[:num_gpus])]


def free_port() -> int:
    """A TCP port free on the loopback now (the OS picks it; another process could take it before use: rare)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _relay_stderr(proc: subprocess.Popen, tail: collections.deque) -> None:
    """Show the child's progress bar live and keep the last lines for a failure record."""
    for line in proc.stderr:  # ends when the child closes stderr (exits or is killed)
        sys.stderr.write(line)
        tail.append(line)


def _skipped(spec: RunSpec, reason: str) -> RunRecord:
    """Not run, by design (an engine whose library is absent, or that cannot run on this device): tables show the
    engine as "not installed" or "not run here", with the reason."""
    return failed_record(spec, reason, status="skipped")


def exit_on_sigterm() -> None:
    """SIGTERM (how a timed-out run is stopped) raises SystemExit instead of ending the process at once, so
    `finally` blocks run: torch's op build releases its lock file, the failure record gets written."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def main(argv: list[str]) -> int:
    exit_on_sigterm()
    args = [a for a in argv if not a.startswith("--local_rank")]  # the DeepSpeed launcher may add it
    spec_path, out = args
    spec = RunSpec(**json.loads(Path(spec_path).read_text()))
    writer = int(os.environ.get("RANK", "0")) == 0  # under the DeepSpeed launcher only rank 0 writes
    session = None
    try:
        session = Session(spec)
        record = session.run()
    except BaseException:  # record the failure completely, then exit non-zero
        error = traceback.format_exc()
        record = failed_record(spec, error) if session is None else _fail_quietly(session, error)
        if writer:
            record.write(out)
        return 1
    if writer:
        record.write(out)
    return 0


def _fail_quietly(session: Session, error: str) -> RunRecord:
    try:
        return session.fail(error)
    except Exception:  # closing the engine failed too: the spec's record still says what went wrong
        return failed_record(session.spec, error)


if __name__ == "__main__":
    code = main(sys.argv[1:])
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # A rank leaves without the interpreter's teardown: the record is written, and gloo's destructors can
        # deadlock there (DDP's Reducer frees the process group holding the GIL while gloo's thread wants it)
        # or abort ("terminate called without an active exception"), either way hanging or failing the run.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
