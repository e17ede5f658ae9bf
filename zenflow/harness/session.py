"""One run, one loop, one record: the child side of every measurement (runner, bench's stepper, GLUE).

    session = Session(spec)      # workload, model, engine, the record's environment and protocol
    session.step(n)              # n training steps, timed from outside by the StepTimeline
    record = session.finish()    # drain, evaluate (GLUE), close, summarize
    record = session.fail(exc)   # or a complete failed record

`run_in_subprocess` (runner.py) calls `Session(spec).run()` in a fresh child; `SteppedEngine` (stepper.py) drives
the same session over a pipe, a few steps per benchmark round. A workload is an object with `model`, `device`,
`description`, `batches()`, and optionally a fixed number of `steps`, its own `warmup_steps`, extra `protocol`
fields, a `label`, `require_finite` and `evaluate(model) -> metrics` (the GLUE workload, glue/workload.py).
"""

from __future__ import annotations

import copy
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from zenflow.harness.engines.build import init_warnings, make_engine
from zenflow.harness.engines.registry import engine_spec, is_deepspeed
from zenflow.harness.glue.workload import GlueWorkload
from zenflow.harness.placement import DEVICE_SHARE, check_placement, placement_for
from zenflow.harness.processes import bind_rank_cores
from zenflow.harness.records import RunRecord, summarize_steps
from zenflow.harness.when import utc_now
from zenflow.harness.workloads import Tokenizer, Workload, batches, build_model, load_texts
from zenflow.telemetry.environment import capture_environment
from zenflow.telemetry.machine_load import LoadWindow
from zenflow.telemetry.nvml import NvmlSampler
from zenflow.telemetry.timeline import StepTimeline


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
    num_gpus: int = 1  # ranks (processes) per run, one per GPU, or a share of the cores each on the CPU
    extra: dict[str, Any] = field(default_factory=dict)
    placement: str = "shared"  # where the device's and the host's phases run (harness/placement.py)

    def __post_init__(self) -> None:
        if not isinstance(self.num_gpus, int) or self.num_gpus < 1:
            raise ValueError(f"num_gpus = {self.num_gpus!r} is not allowed: expected an int >= 1")
        check_placement(self.placement)

    @property
    def cycle(self) -> int:
        """Steps per update cycle, by the engine's registry rule (EngineSpec.cycle)."""
        return engine_spec(self.engine).cycle(self.ds_config)


class LMWorkload:
    """The causal-LM workloads (cpu-scale Llama, or a hub model on a GPU host): endless packed token batches."""

    steps = None  # as many as the spec asks for
    require_finite = False
    evaluate = None

    def __init__(self, spec: RunSpec) -> None:
        self.spec = Workload(**spec.workload)
        texts, source = load_texts(self.spec)
        self.tokenizer = Tokenizer(self.spec)
        self.texts = texts
        self.model = build_model(self.spec)
        self.device = self.spec.device
        self.description = {**self.spec.to_dict(), "data_source": source, "tokenizer": self.tokenizer.name}
        self.label = f"{spec.label} {spec.engine}"

    def batches(self) -> Iterator[Any]:
        return batches(self.spec, self.tokenizer, self.texts)  # workloads.batches: a method's name is not in scope


def build_workload(spec: RunSpec) -> Any:
    if spec.workload.get("kind") == "glue":
        return GlueWorkload(spec)  # fine-tune + evaluate
    return LMWorkload(spec)


class Session:
    """The one training loop of the harness: every step timed from outside, the step kind decided once."""

    def __init__(self, spec: RunSpec) -> None:
        self.started = time.perf_counter()
        # before a rank is bound to its cores: the record names the machine it ran on
        machine = environment(import_deepspeed=is_deepspeed(spec.engine))
        rank_cores = None
        if spec.num_gpus > 1 and not torch.cuda.is_available():
            rank_cores = bind_rank_cores()  # CPU ranks: each its own share of the cores (--bind_cores_to_rank)
        torch.set_num_threads(spec.threads or len(os.sched_getaffinity(0)))
        self.spec = spec
        self.workload = build_workload(spec)
        model = self.workload.model
        self.record = RunRecord(engine=spec.engine, label=spec.label, config=spec.ds_config,
                                workload=self.workload.description, environment=machine,
                                model=model_facts(model))
        self.timeline = StepTimeline()
        spec_config = copy.deepcopy(spec.ds_config)  # as asked for, copied before an engine sees it: --resume's key
        self.placement = placement_for(spec.placement, compute_share(spec.ds_config))  # from every core of the run
        self.engine = make_engine(spec.engine, model, spec.ds_config, self.timeline, telemetry=spec.telemetry,
                                  device=self.workload.device)
        self.record.config = self.engine.ds_config  # as the engine resolved it (e.g. Twin-Flow's sub_group_size)
        # bound after the engine is built (an overlap worker has split the cores by then, from every core), before
        # the protocol notes the threads
        self.placement.bind(self.engine)
        fixed = self.workload.steps
        self.warmup_steps = (min(spec.warmup_steps, fixed - 1) if fixed else spec.warmup_steps)
        timed = fixed - self.warmup_steps if fixed else -(-spec.timed_steps // spec.cycle) * spec.cycle  # cycles
        self.planned_steps = self.warmup_steps + timed
        self.record.protocol = {
            "taken_at": utc_now(), "warmup_steps": self.warmup_steps, "timed_steps": timed, "cycle": spec.cycle,
            "num_gpus": spec.num_gpus, "world_size": world_size(), "device": str(self.engine.device),
            "placement": spec.placement,
            "threads": torch.get_num_threads(), "rank_cores": rank_cores, "telemetry": spec.telemetry,
            "stall_includes_io": self.engine.stall_includes_io,
            "attribution": self.timeline.use_device(self.engine.device), "peak_memory": self.timeline.memory,
            "weights_changed_at_init": len(self.engine.weights_changed_at_init), "spec_config": spec_config,
            **({"ds_weight_view": self.engine.weight_view} if self.engine.weight_view else {}),
            **getattr(self.workload, "protocol", {}), **spec.extra}
        self.record.warnings += init_warnings(self.engine)
        self.batches = self.workload.batches()
        self.sampler, self.sampling, self.sampled = NvmlSampler(), False, False  # sampling now / ever
        self.i, self.closed = 0, False
        self.train_start: float | None = None
        self.load: LoadWindow | None = None  # the rest of the machine's CPU time over the timed steps
        # Accuracy against training time: the workload's dev-set evaluation every `eval_every` steps,
        # between steps; `training_s` is the wall time spent inside steps only, so evaluations cost none of it.
        self.eval_every: int | None = getattr(self.workload, "eval_every", None)
        self.curve: list[dict[str, Any]] = []
        self.training_s = 0.0

    def run(self) -> RunRecord:
        """Every planned step (with a progress bar), then the record."""
        from tqdm import tqdm

        with tqdm(total=self.planned_steps, desc=self.workload.label, disable=not self.spec.progress,
                  file=sys.stderr, dynamic_ncols=True, mininterval=1.0) as bar:
            for _ in range(self.planned_steps):
                self.step(1)
                if self.eval_every and self.i % self.eval_every == 0 and self.i < self.planned_steps:
                    self._evaluate_midway()
                last = self.timeline.steps[-1]
                bar.update(1)
                bar.set_postfix(loss=f"{last.loss:.3f}", kind=last.kind, refresh=False)
        return self.finish()

    def step(self, n: int) -> None:
        """`n` training steps; the last one's period ends here (time between calls belongs to no step)."""
        entered = time.perf_counter()
        if self.train_start is None:
            self.train_start = entered
        for _ in range(n):
            if self.i == self.warmup_steps:
                self.sampling = self.sampled = bool(self.sampler.__enter__())  # NVML: the timed steps only
                self.load = LoadWindow.start()
            timing = self.timeline.start_step(self.i)
            # Phase marks are CUDA events on a GPU: forward_backward_ms / optimizer_ms say when the device got
            # there, not when the host launched the work; read once the step's events completed.
            self.timeline.use_device(self.engine.device)
            self.timeline.mark("forward")
            loss = self.engine.forward_backward(next(self.batches))
            self.placement.note_device()
            self.timeline.mark("backward")
            with self.placement.optimizer_step():  # a split: the step's last host phase hands the cores back
                kind = self.engine.optimizer_step()
            self.timeline.mark("optimizer", stall_since="backward" if self.engine.stall_includes_io else None)
            timing.loss = loss.item()  # device->host sync point, once per step: the next step starts device-idle
            timing.kind = "warmup" if self.i < self.warmup_steps else kind
            if self.workload.require_finite and not math.isfinite(timing.loss):
                raise FloatingPointError(f"loss is {timing.loss} at step {self.i}")
            self.i += 1
        self.timeline.end_step()
        self.training_s += time.perf_counter() - entered  # after the last step's loss.item(): its work is done

    def finish(self) -> RunRecord:
        """Close the timeline, apply outstanding host updates, evaluate (when the workload can), summarize."""
        self.timeline.finish()
        train_seconds = time.perf_counter() - (self.train_start or self.started)
        self._stop_sampler()
        record, spec = self.record, self.spec
        record.nvml = self.sampler.result() if self.sampled else {"available": False, "reason": "no timed steps"}
        record.protocol["timed_steps"] = max(0, self.i - self.warmup_steps)
        record.protocol["machine_load"] = (self.load.stop() if self.load else
                                           {"measured": False, "reason": "no timed steps"})
        record.steps = [step_row(t) for t in self.timeline.steps]
        if self.engine.transfer_bytes() is None:
            record.warnings.append(f"{spec.engine}: bytes not measured (no counters inside the engine; NVML needs "
                                   "a GPU)")
        record.summary = summarize_steps(record.steps, spec.cycle, record.model["model_bytes"])
        host_state = self.engine.host_state_bytes()  # this rank's host buffers (ZenFlow engines)
        zenflow = self.engine.zenflow_facts()  # before close(): what ZenFlow decided
        record.protocol["cores"] = self.placement.facts()  # where each phase ran (shared: the same cores)
        evaluated = self._evaluate() if self.workload.evaluate is not None else None
        self.close()
        record.metrics["final_loss"] = record.summary["final_loss"]
        if evaluated is not None:
            metrics, eval_seconds = evaluated
            record.metrics = {**metrics, "final_loss": record.summary["final_loss"], "steps": self.i,
                              "train_seconds": train_seconds, "eval_seconds": eval_seconds,
                              "child_seconds": time.perf_counter() - self.started,
                              **getattr(self.workload, "final_metrics", {})}
            if self.eval_every:  # the last point: after the drain, as the final score is
                record.metrics["curve"] = [*self.curve, {"step": self.i, "train_s": self.training_s,
                                                         "score": metrics["score"]}]
        if host_state is not None:
            record.metrics["host_state_bytes"] = host_state
        if zenflow is not None:
            record.metrics["zenflow"] = zenflow
        record.metrics["peak_rss_bytes"] = peak_rss_bytes()  # what the memory plan's host estimate is checked against
        return record

    def _evaluate_midway(self) -> None:
        """A dev-set evaluation between two steps: the model as it stands. Nothing is drained (that would change
        what the next steps compute), so an overlapped host update in flight runs on meanwhile, uncounted: at most
        one update per evaluation (docs/glue.md, "Accuracy against training time")."""
        metrics = self.workload.evaluate(self.workload.model)
        self.workload.model.train()  # evaluate() left it in eval mode (dropout off)
        self.curve.append({"step": self.i, "train_s": self.training_s, "score": metrics["score"]})

    def _evaluate(self) -> tuple[dict[str, Any], float]:
        optimizer = getattr(self.engine, "optimizer", None)
        if hasattr(optimizer, "drain"):
            optimizer.drain()  # the last in-flight host update is part of the trained model
        if not is_deepspeed(self.spec.engine):
            self.close()  # gives the worker's core back for evaluation
        start = time.perf_counter()
        return self.workload.evaluate(self.workload.model), time.perf_counter() - start

    def fail(self, error: str) -> RunRecord:
        """A complete failed record (the protocol and environment gathered so far are kept)."""
        self.close()
        self.record.status, self.record.error = "failed", error
        return self.record

    def close(self) -> None:
        self._stop_sampler()
        if not self.closed:
            self.closed = True
            self.engine.close()

    def _stop_sampler(self) -> None:
        if self.sampling:
            self.sampler.__exit__(None, None, None)
            self.sampling = False  # stopped; result() still holds what it sampled


def failed_record(spec: RunSpec, error: str, stderr_tail: str = "", status: str = "failed") -> RunRecord:
    """A failed (or skipped) record built from the spec alone, when no session could be built or the child died."""
    return RunRecord(engine=spec.engine, label=spec.label, status=status, error=error + "\n" + stderr_tail,
                     config=spec.ds_config, workload=spec.workload,
                     protocol={"warmup_steps": spec.warmup_steps, "timed_steps": spec.timed_steps,
                               "num_gpus": spec.num_gpus, "world_size": spec.num_gpus,
                               "telemetry": spec.telemetry, "placement": spec.placement})


def compute_share(ds_config: dict[str, Any]) -> float:
    """The share of the cores a split keeps for the device: the run's `pt_reserved_cores_perc` (its ZenFlow block),
    so the split is the one ZenFlow's worker makes; ZenFlow's default without one."""
    block = (ds_config.get("zero_optimization") or {}).get("zenflow") or {}
    return float(block.get("pt_reserved_cores_perc", DEVICE_SHARE))


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM). Not getrusage's ru_maxrss: Linux carries the parent's peak into a
    child across fork and exec there, so a run started from a large process would report that process's peak."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def world_size() -> int:
    """Processes training together: torch.distributed's world when initialised (DeepSpeed engines), else 1."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def step_row(t: Any) -> dict[str, Any]:
    return {"step": t.step, "kind": t.kind, "period_ms": t.period_ms, "compute_ms": t.compute_ms,
            "io_ms": t.io_ms, "stall_ms": t.stall_ms, "forward_backward_ms": t.forward_backward_ms,
            "optimizer_ms": t.optimizer_ms, "telemetry_ms": t.telemetry_ms, "bytes": dict(t.bytes) or None,
            "loss": t.loss, "peak_memory_allocated_bytes": t.peak_memory_allocated_bytes,
            "peak_memory_reserved_bytes": t.peak_memory_reserved_bytes, "blocks_ms": dict(t.blocks_ms) or None,
            "decisions": dict(t.decisions) or None}


def model_facts(model: Any) -> dict[str, Any]:
    params = [p for p in model.parameters() if p.requires_grad]
    column = [p for p in params if p.dim() >= 2]
    element = params[0].element_size() if params else 0
    return {"parameters": sum(p.numel() for p in params), "column_parameters": sum(p.numel() for p in column),
            "dense_parameters": sum(p.numel() for p in params if p.dim() < 2),
            "dtype": str(params[0].dtype) if params else None,
            "model_bytes": sum(p.numel() for p in column) * element}


def environment(import_deepspeed: bool = True) -> dict[str, Any]:
    try:
        return capture_environment(import_deepspeed)
    except Exception as exc:  # the record says why instead of failing the run
        return {"error": f"environment capture failed: {exc!r}"}
