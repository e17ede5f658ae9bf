"""Training-step benchmarks of every engine (docs/design.md §3) on the cpu-scale workload, and the GPU one with CUDA.

    .venv/bin/python -m pytest bench/test_train_step.py --benchmark-only
    ZENFLOW_BENCH_SMALL=1 ...          # a tiny Llama (workload id "cpu-scale-small", so it is never compared with
                                       # the real shape) and 5 rounds: the least the compare command accepts
    ZENFLOW_BENCH_PLACEMENT=split ...  # the GPU analog: every engine's device work on one core, its host work on
                                       # the other (workload id "...-split"; cpu-scale only)

With --benchmark-disable (the smoke run of `make test`) each engine runs one round; the two DeepSpeed engines are
skipped there unless ZENFLOW_BENCH_SMOKE_DEEPSPEED=1 (they need ~15 s each to start; tests/ runs DeepSpeed anyway).

Each engine runs in its own child process built by the harness (zenflow/harness/stepper.py driving the run loop of
zenflow/harness/session.py, the same Session every run uses), as every run does: DeepSpeed initialises once per
process. One benchmark round asks the child for STEPS_PER_ROUND real training steps (forward, backward, optimizer
step, loss read back: the sync point) and waits for them, so the round time is measured from outside around the real
steps; the pipe round-trip adds ~0.1 ms to rounds of hundreds of ms. STEPS_PER_ROUND is the ZenFlow update interval,
so every round is whole update cycles for every engine (ZenFlow's boundary step is in every round) and medians of
different engines are directly comparable: time per 4 training steps. Model building and engine initialisation are
untimed.

extra_info: the engine, the workload, per-step milliseconds (median round / STEPS_PER_ROUND), and the child's run
record summary (step-time split into accumulate/update steps, compute / I/O / stall, bytes per step); the full
record (every step) is written to $ZENFLOW_BENCH_RECORDS (default .benchmarks/records/<hardware_id>/).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from zenflow.harness.cli import interval
from zenflow.harness.configs import DEEPSPEED_EXAMPLES_BLOCK, ENGINES, TINY_LLAMA_SHAPE
from zenflow.harness.engines.build import deepspeed_config
from zenflow.harness.engines.registry import is_deepspeed, unavailable
from zenflow.harness.runner import RunSpec
from zenflow.harness.stepper import SteppedEngine

SMALL = os.environ.get("ZENFLOW_BENCH_SMALL", "0") not in ("", "0")
CUDA = torch.cuda.is_available()
# $ZENFLOW_BENCH_PLACEMENT (bench/conftest.py checked it): shared (default) or split, the GPU analog (docs/design.md
# §3); split is in the workload's id, so the two placements' benchmarks and records never meet
PLACEMENT = os.environ.get("ZENFLOW_BENCH_PLACEMENT") or "shared"
PLACED = "" if PLACEMENT == "shared" else f"-{PLACEMENT}"
# $ZENFLOW_BENCH_INTERVAL (bench/conftest.py checked it): DeepSpeedExamples' 4, another integer or "auto"; any other
# than 4 is in the workload's id, so its benchmarks and records never meet the default's
UPDATE_INTERVAL = interval(os.environ.get("ZENFLOW_BENCH_INTERVAL") or str(DEEPSPEED_EXAMPLES_BLOCK["update_interval"]))
SETTING = "" if UPDATE_INTERVAL == DEEPSPEED_EXAMPLES_BLOCK["update_interval"] else f"-U{UPDATE_INTERVAL}"
STEPS_PER_ROUND = UPDATE_INTERVAL if isinstance(UPDATE_INTERVAL, int) else 4  # whole cycles; "auto" has none
ROUNDS, WARMUP_ROUNDS = (5, 1) if SMALL else (10, 2)
# The Llama-2-7B scenario's settings (reproduce/llama7b.py): DeepSpeedExamples' ZenFlow fine-tuning.
ZENFLOW_BLOCK = {**DEEPSPEED_EXAMPLES_BLOCK, "update_interval": UPDATE_INTERVAL}
TINY_SHAPE = TINY_LLAMA_SHAPE

# The cpu-scale workloads run on the CPU on every host (device "cpu"), so "cpu-scale" means the same everywhere.
WORKLOADS: dict[str, dict] = (
    {f"cpu-scale-small{SETTING}{PLACED}": {"model": "cpu-scale", "dtype": "bf16", "seq_len": 16, "device": "cpu",
                                            **TINY_SHAPE}}
    if SMALL else {f"cpu-scale{SETTING}{PLACED}": {"model": "cpu-scale", "dtype": "bf16", "seq_len": 16,
                                                   "device": "cpu"}})
if CUDA and not SMALL and PLACEMENT == "shared":  # the GPU scenario: Llama-2-7B (or $MODEL), bf16, sequence 512
    WORKLOADS[f"gpu{SETTING}"] = {"model": os.environ.get("MODEL", "meta-llama/Llama-2-7b-hf"), "dtype": "bf16",
                                  "seq_len": 512}

SUMMARY_KEYS = ("step_ms", "cycle_mean_ms", "accumulate_step_ms", "update_step_ms", "compute_ms", "io_ms",
                "stall_ms", "forward_backward_ms", "optimizer_ms", "bytes_per_step",
                "grad_param_bytes_per_step_over_model_bytes", "final_loss")


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_train_step(benchmark, bench_records_dir: Path, workload: str, engine: str) -> None:
    if benchmark.disabled and is_deepspeed(engine) and os.environ.get("ZENFLOW_BENCH_SMOKE_DEEPSPEED") != "1":
        pytest.skip("smoke mode (--benchmark-disable): DeepSpeed engines take ~15 s each to start; "
                    "ZENFLOW_BENCH_SMOKE_DEEPSPEED=1 runs them too")
    shape = WORKLOADS[workload]
    why_not = unavailable(engine, shape.get("device", "auto"), PLACEMENT)
    if why_not:  # e.g. torchao-offload on the CPU: the table's "not run here", with its reason
        pytest.skip(f"not run here: {why_not}")
    ds_config = deepspeed_config(engine, ZENFLOW_BLOCK, shape["dtype"], micro_batch=1, lr=2e-5, weight_decay=0.01,
                                 clipping=1.0, cuda=CUDA and shape.get("device") != "cpu")
    spec = RunSpec(engine=engine, label=f"bench/{workload}", workload=shape, ds_config=ds_config,
                   warmup_steps=WARMUP_ROUNDS * STEPS_PER_ROUND, timed_steps=ROUNDS * STEPS_PER_ROUND,
                   progress=False, placement=PLACEMENT, extra={"steps_per_round": STEPS_PER_ROUND})
    out = bench_records_dir / f"{workload}-{engine}.json"
    benchmark.group = f"train-step-{workload}"
    benchmark.extra_info.update(engine=engine, workload=workload, steps_per_round=STEPS_PER_ROUND,
                                rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS, record=str(out))
    with SteppedEngine(spec, out) as child:
        benchmark.pedantic(child.steps, args=(STEPS_PER_ROUND,), rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS,
                           iterations=1)
        record = child.finish()
    assert record.status == "ok", record.error
    if benchmark.stats is not None:  # not when the benchmark is disabled (one call)
        benchmark.extra_info["step_ms_median"] = benchmark.stats.stats.median / STEPS_PER_ROUND * 1e3
    benchmark.extra_info["record_summary"] = {k: record.summary.get(k) for k in SUMMARY_KEYS}
    benchmark.extra_info["model"] = record.model
    benchmark.extra_info["warnings"] = record.warnings
