"""Run one (engine, workload, config) in a fresh subprocess and write its run record.

Fresh process per run: DeepSpeed changes process affinity and threads, and its overlap worker re-imports
`__main__`. The child writes its record atomically, also when it fails; if it dies without one (killed, out of
memory), the parent writes a `status: "failed"` record with the exit code and the end of its stderr.

    python -m zenflow.harness.runner SPEC.json RECORD.json     # the child side
"""

from __future__ import annotations

import collections
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from zenflow.harness.preflight import PreflightError, check_build_locks
from zenflow.harness.processes import start_group, stop_group
from zenflow.harness.records import RunRecord, summarize_steps


@dataclass
class RunSpec:
    engine: str
    label: str
    workload: dict[str, Any]
    ds_config: dict[str, Any]
    warmup_steps: int = 8
    timed_steps: int = 16
    threads: int | None = None  # torch intra-op threads; None = every core this process may use
    telemetry: bool = True
    progress: bool = True
    num_gpus: int = 1  # > 1: DeepSpeed engines only, under the DeepSpeed launcher, one process (rank) per GPU
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.num_gpus, int) or self.num_gpus < 1:
            raise ValueError(f"num_gpus = {self.num_gpus!r} is not allowed: expected an int >= 1")
        if self.num_gpus > 1 and not self.engine.startswith("ds-"):
            raise ValueError(f"num_gpus = {self.num_gpus} for engine {self.engine!r}: our reference engines are "
                             "single-process (one device); only the ds-* engines run multi-GPU")

    @property
    def cycle(self) -> int:
        block = self.ds_config["zero_optimization"].get("zenflow") or {}
        interval = block.get("update_interval", 1)
        return interval if self.engine in ("ref-zenflow", "ds-zenflow") and isinstance(interval, int) else 1


def run_in_subprocess(spec: RunSpec, out: str | Path, timeout_s: float = 3600) -> RunRecord:
    """Run `spec` in a child interpreter; always returns a complete record (ok, failed, or skipped when a DeepSpeed
    engine is asked for and DeepSpeed is not installed). On timeout, Ctrl-C or any error the child's whole process
    group is stopped (SIGTERM, grace, SIGKILL: processes.py), so no rank or worker outlives the run."""
    out = Path(out)
    out.unlink(missing_ok=True)
    if spec.engine.startswith("ds-") and importlib.util.find_spec("deepspeed") is None:
        _skipped(spec, f"deepspeed not installed (in {sys.executable}): {spec.engine} needs it").write(out)
        return RunRecord.read(out)
    if spec.engine.startswith("ds-"):
        try:
            check_build_locks()  # a stale op-build lock would make this run wait forever, silently
        except PreflightError as exc:
            _failed(spec, str(exc)).write(out)
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
        _failed(spec, f"{code}: stopped (SIGTERM, then SIGKILL after a grace period)\n{child_error}",
                stderr_tail).write(out)
    except KeyboardInterrupt:
        _failed(spec, "interrupted (KeyboardInterrupt)", stderr_tail).write(out)
        raise
    finally:
        Path(f.name).unlink(missing_ok=True)
    if not out.exists():
        _failed(spec, f"child exited ({code}) without a record", stderr_tail).write(out)
    return RunRecord.read(out)


def _launcher(spec: RunSpec) -> list[str]:
    """One plain child process; the DeepSpeed launcher for multi-GPU DeepSpeed runs (rank 0 writes the record).
    Our reference engines are single-device: they always run as one process (RunSpec refuses num_gpus > 1).

    The launcher deletes CUDA_VISIBLE_DEVICES when `--num_gpus` is given (its ranks would land on GPUs 0..N-1, not
    on the ones this job was given), so with CUDA_VISIBLE_DEVICES set the ranks are named with `--include`. A free
    `--master_port` lets two runs share a host (the launcher's default is a fixed 29500)."""
    if spec.num_gpus == 1:
        return [sys.executable, "-m", "zenflow.harness.runner"]
    # The `deepspeed` command's own module, run by this interpreter: no reliance on a script next to it (VENV=).
    return [sys.executable, "-m", "deepspeed.launcher.runner",
            *_gpu_selection(spec.num_gpus, os.environ.get("CUDA_VISIBLE_DEVICES")),
            "--master_port", str(free_port()), "--module", "zenflow.harness.runner"]


def child_env(spec: RunSpec) -> dict[str, str]:
    """The run child's environment: ours, unbuffered, and DeepSpeed kept on the CPU for a cpu workload (it picks
    CUDA whenever it can, and the child's environment capture resolves its accelerator before the engine exists)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if spec.num_gpus == 1:  # a single process: a rank/world inherited from a torchrun or SLURM shell is not ours
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)
    if spec.workload.get("device") == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
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


def _failed(spec: RunSpec, error: str, stderr_tail: str = "", status: str = "failed") -> RunRecord:
    return RunRecord(engine=spec.engine, label=spec.label, status=status, error=error + "\n" + stderr_tail,
                     config=spec.ds_config, workload=spec.workload,
                     protocol={"warmup_steps": spec.warmup_steps, "timed_steps": spec.timed_steps,
                               "num_gpus": spec.num_gpus, "world_size": spec.num_gpus})


def _skipped(spec: RunSpec, reason: str) -> RunRecord:
    """Not run, by design (an engine whose library is absent): tables show the engine as "not installed"."""
    return _failed(spec, reason, status="skipped")


def world_size() -> int:
    """Processes training together: torch.distributed's world when initialised (DeepSpeed engines), else 1."""
    import torch

    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def execute(spec: RunSpec) -> RunRecord:
    """The child side: build workload and engine, warm up, time whole cycles, summarize."""
    if spec.workload.get("kind") == "glue":  # fine-tune + evaluate (zenflow/harness/glue_run.py)
        from zenflow.harness.glue_run import execute_glue

        return execute_glue(spec)
    import torch
    from tqdm import tqdm

    from zenflow.harness.engines import init_warnings, make_engine
    from zenflow.harness.workloads import Tokenizer, Workload, batches, build_model, load_texts
    from zenflow.telemetry.nvml import NvmlSampler
    from zenflow.telemetry.timeline import StepTimeline

    torch.set_num_threads(spec.threads or len(os.sched_getaffinity(0)))
    workload = Workload(**spec.workload)
    texts, source = load_texts(workload)
    data = batches(workload, tokenizer := Tokenizer(workload), texts)
    model = build_model(workload)
    record = RunRecord(engine=spec.engine, label=spec.label, config=spec.ds_config,
                       workload={**workload.to_dict(), "data_source": source, "tokenizer": tokenizer.name},
                       environment=_environment(), model=_model_facts(model))
    timeline = StepTimeline()
    engine = make_engine(spec.engine, model, spec.ds_config, timeline, telemetry=spec.telemetry,
                         device=workload.device)
    cycle = spec.cycle
    timed = -(-spec.timed_steps // cycle) * cycle  # whole update cycles
    record.protocol = {"warmup_steps": spec.warmup_steps, "timed_steps": timed, "cycle": cycle,
                       "num_gpus": spec.num_gpus, "world_size": world_size(), "device": str(engine.device),
                       "threads": torch.get_num_threads(), "telemetry": spec.telemetry,
                       "stall_includes_io": engine.stall_includes_io,
                       "attribution": timeline.use_device(engine.device), "peak_memory": timeline.memory,
                       "weights_changed_at_init": len(engine.weights_changed_at_init), **spec.extra}
    record.warnings += init_warnings(engine)
    total = spec.warmup_steps + timed
    sampler = NvmlSampler()  # a background thread on a GPU host; records why it is absent otherwise
    sampling = False
    try:
        bar = tqdm(range(total), desc=f"{spec.label} {spec.engine}", disable=not spec.progress, file=sys.stderr,
                   dynamic_ncols=True)
        for i in bar:
            if i == spec.warmup_steps:
                sampling = bool(sampler.__enter__())  # NVML counters cover the timed steps only
            timing = timeline.start_step(i)
            timing.loss = engine.train_step(next(data), timing)
            if i < spec.warmup_steps:
                timing.kind = "warmup"
            bar.set_postfix(loss=f"{timing.loss:.3f}", kind=timing.kind)
        timeline.finish()
    finally:
        if sampling:
            sampler.__exit__(None, None, None)
        engine.close()
    record.nvml = sampler.result() if sampling else {"available": False, "reason": "no timed steps"}
    record.steps = [_step_row(t) for t in timeline.steps]
    bytes_total = engine.transfer_bytes()
    if bytes_total is None:
        record.warnings.append(f"{spec.engine}: bytes not measured (no counters inside the engine; NVML needs a GPU)")
    record.summary = summarize_steps(record.steps, cycle, record.model["model_bytes"])
    record.metrics["final_loss"] = record.summary["final_loss"]
    return record


def _step_row(t: Any) -> dict[str, Any]:
    return {"step": t.step, "kind": t.kind, "period_ms": t.period_ms, "compute_ms": t.compute_ms,
            "io_ms": t.io_ms, "stall_ms": t.stall_ms, "forward_backward_ms": t.forward_backward_ms,
            "optimizer_ms": t.optimizer_ms, "telemetry_ms": t.telemetry_ms, "bytes": dict(t.bytes) or None,
            "loss": t.loss, "peak_memory_allocated_bytes": t.peak_memory_allocated_bytes,
            "peak_memory_reserved_bytes": t.peak_memory_reserved_bytes}


def _model_facts(model: Any) -> dict[str, Any]:
    params = [p for p in model.parameters() if p.requires_grad]
    column = [p for p in params if p.dim() >= 2]
    element = params[0].element_size() if params else 0
    return {"parameters": sum(p.numel() for p in params), "column_parameters": sum(p.numel() for p in column),
            "dense_parameters": sum(p.numel() for p in params if p.dim() < 2),
            "dtype": str(params[0].dtype) if params else None,
            "model_bytes": sum(p.numel() for p in column) * element}


def _environment() -> dict[str, Any]:
    try:
        from zenflow.telemetry.environment import capture_environment

        return capture_environment()
    except Exception as exc:  # the record says why instead of failing the run
        return {"error": f"environment capture failed: {exc!r}"}


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
    try:
        record = execute(spec)
    except BaseException:  # record the failure completely, then exit non-zero
        if writer:
            _failed(spec, traceback.format_exc()).write(out)
        return 1
    if writer:
        record.write(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
