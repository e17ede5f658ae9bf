"""`make gpu-check`: the checks a GPU host must pass, in one process (docs/gpu-check.md).

The checks are the rows of CHECKS, in the order they run: each names its function, the record's key for its rows,
its section of the table (render.py) and whether the GPU window runs it. Every check ends as "pass", "fail" or
"not checked" with the reason; nothing is skipped silently (verdict.py). The record and table are written after
every check (`save_record`), so a command killed midway leaves the checks it finished. `reproduce/gpu_check.py` is
the command line.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zenflow.harness.checks import render
from zenflow.harness.checks.differential import differential_check
from zenflow.harness.checks.memory import memory_check
from zenflow.harness.checks.pcie import pcie_check
from zenflow.harness.checks.verdict import check, guarded, pending
from zenflow.harness.configs import BEYOND_ENGINES, CORE_ENGINES, DEEPSPEED_EXAMPLES_BLOCK, SMOKE_ENGINES
from zenflow.harness.engines.build import deepspeed_config
from zenflow.harness.engines.registry import is_deepspeed
from zenflow.harness.records import RunRecord
from zenflow.harness.runner import run_in_subprocess
from zenflow.harness.session import RunSpec
from zenflow.harness.tables import write_text_atomic
from zenflow.telemetry.environment import visible_gpus

SCHEMA = "gpu-check/2"
# The engines' zenflow block is reproduce/llama7b.py's (DeepSpeedExamples' Llama-2 settings).
ENGINE_BLOCK = DEEPSPEED_EXAMPLES_BLOCK


# ---- environment ------------------------------------------------------------------------------------------------
def environment_report(env: dict[str, Any]) -> dict[str, Any]:
    """What a reader needs first: driver, torch and its CUDA build, and the run's GPUs with their PCIe link."""
    nvml, tv = env.get("nvml") or {}, env.get("torch") or {}
    keys = ("cuda_index", "index", "pci_bus_id", "name", "pcie_gen", "pcie_width", "pcie_gen_max", "pcie_width_max",
            "pcie_counters")
    return {"hardware_id": env.get("hardware_id"), "driver": nvml.get("driver"),
            "nvml": "available" if nvml.get("available") else f"unavailable: {nvml.get('reason')}",
            "gpus_on_host": len(nvml.get("devices") or []), "mapping_errors": nvml.get("mapping_errors") or [],
            "torch": tv.get("version"), "torch_cuda_build": tv.get("cuda"), "cuda_available": tv.get("cuda_available"),
            "deepspeed": (env.get("deepspeed") or {}).get("version"), "gpus": [
                {k: d.get(k) for k in keys} for d in visible_gpus(env)]}


def cuda_unusable(env: dict[str, Any]) -> str | None:
    """The message to stop with when NVML sees GPUs but torch cannot use CUDA; None otherwise."""
    nvml, tv = env.get("nvml") or {}, env.get("torch") or {}
    if not (nvml.get("available") and nvml.get("devices")) or tv.get("cuda_available"):
        return None
    names = ", ".join(dict.fromkeys(d.get("name") or "?" for d in nvml["devices"]))
    return (f"NVML sees {len(nvml['devices'])} GPU(s) ({names}, driver {nvml.get('driver')}) but torch "
            f"{tv.get('version')} cannot use CUDA (torch.version.cuda = {tv.get('cuda')}): a CPU build of torch, or "
            "a CUDA build newer than this driver supports. Every number would be a CPU number under a GPU's name. "
            "Use the host's CUDA build of torch (make gpu-check VENV=, docs/gpu-check.md).")


def environment_check(report: dict[str, Any], cuda: bool) -> dict[str, Any]:
    """Pass on a GPU host (noting GPUs left out and devices NVML cannot match); "not checked" without CUDA."""
    if not cuda:
        return check("environment", "not checked", f"no CUDA GPU (NVML: {report['nvml']}; torch CUDA build: "
                                                   f"{report['torch_cuda_build']}): GPU facts and link not read")
    notes = [f"{report['gpus_on_host']} GPUs on the host, this run uses {len(report['gpus'])}"] \
        if report["gpus_on_host"] > len(report["gpus"]) else []
    notes += [f"NVML cannot match: {e}" for e in report["mapping_errors"]]  # never guessed by index
    return check("environment", "pass", "; ".join(notes) or None)


# ---- every engine on a small Llama -------------------------------------------------------------------------------
def engine_plan(cuda: bool, smoke: bool) -> list[tuple[str, dict[str, Any], dict[str, int]]]:
    """(engine, workload, steps) per run: a small Llama (the cpu-scale shape, bf16, seq 512) on a GPU; the tiny
    shape with a few steps on the CPU and in --smoke. (Llama-2-7B's layer shapes: reproduce/gpu_window.py.)"""
    tiny = {"model": "cpu-scale", "dtype": "fp32", "seq_len": 16, "hidden": 64, "layers": 2, "intermediate": 128,
            "heads": 4, "data": "synthetic"}
    small = {"model": "cpu-scale", "dtype": "bf16", "seq_len": 512, "micro_batch": 1, "data": "synthetic"}
    engines = CORE_ENGINES + BEYOND_ENGINES  # the paper's comparison and ours beyond it (ref-zenflow-da)
    if smoke:
        return [(e, tiny, {"warmup_steps": 2, "timed_steps": 4}) for e in SMOKE_ENGINES]
    if not cuda:
        return [(e, tiny, {"warmup_steps": 2, "timed_steps": 4}) for e in engines]
    return [(e, small, {"warmup_steps": 8, "timed_steps": 16}) for e in engines]


def run_engines(plan: list, out: Path, cuda: bool, timeout_s: float = 300,
                on_row: Callable[[list[dict]], None] | None = None) -> tuple[dict[str, Any], list[dict]]:
    """Each run in a fresh process (zenflow.harness.runner); DeepSpeed engines say "not installed" without it.
    `timeout_s` per run: a hung run becomes a failed record, not a hung check. `on_row(rows)` after every run (the
    command saves its record there, so a kill mid-check keeps the finished runs)."""
    have_ds = importlib.util.find_spec("deepspeed") is not None
    # The model (zenflow/harness/workloads.py): without it every run would fail alike. Not the tokenizer's
    # sentencepiece and mistral-common: without them the runs train on UTF-8 bytes and their records say so.
    lacking = [] if importlib.util.find_spec("transformers") else ["transformers"]
    rows: list[dict] = []
    for engine, workload, steps in plan:
        shape = f"h{workload.get('hidden', 512)}x{workload.get('layers', 8)}"
        row = {"engine": engine, "shape": shape, "status": "not installed", "record": None}
        if lacking or (is_deepspeed(engine) and not have_ds):
            rows.append(row | {"error": [f"not installed: {lacking or ['deepspeed']}"]})
        else:
            cfg = deepspeed_config(engine, ENGINE_BLOCK, workload["dtype"], 1, lr=2e-5, weight_decay=0.01,
                                   clipping=1.0, cuda=cuda)
            spec = RunSpec(engine=engine, label="gpu-check", workload=workload, ds_config=cfg, progress=False,
                           **steps)
            path = out / "runs" / f"{engine}-{shape}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            rec: RunRecord = run_in_subprocess(spec, path, timeout_s=timeout_s)
            s = rec.summary
            rows.append(row | {"status": rec.status, "record": str(path.relative_to(out)),
                               "error": (rec.error or "").strip().splitlines()[-1:] or None,
                               **{k: s.get(k) for k in ("cycle_mean_ms", "compute_ms", "io_ms", "stall_ms")},
                               "stall_includes_io": rec.protocol.get("stall_includes_io")})
        if on_row:
            on_row(rows)
    failed = [f"{r['engine']} ({r['shape']})" for r in rows if r["status"] == "failed"]
    missing = [r["engine"] for r in rows if r["status"] == "not installed"]
    reason = "; ".join(x for x in (failed and f"failed: {failed}", missing and f"not installed: {missing}") if x)
    status = "fail" if failed else "not checked" if lacking or not rows else "pass"
    return check("engines", status, reason or None, scale="gpu" if cuda else "cpu-scale"), rows


# ---- the checks as rows -----------------------------------------------------------------------------------------
@dataclass
class Context:
    """What a check's run reads: the host, the command's mode, the record it adds to and where it is saved."""

    cuda: bool
    smoke: bool
    out: Path
    record: dict[str, Any]
    say: Callable[[str], None] = print


@dataclass(frozen=True)
class Check:
    """One GPU check. `run(context)` returns its verdict (verdict.check), or (verdict, rows) when `rows` names the
    record's key for its rows; `section` renders its part of table.md from the record (None: the verdict alone)."""

    name: str
    title: str  # what the command says when it starts the check
    run: Callable[[Context], Any]
    rows: str | None = None
    section: render.Section | None = None
    window: bool = True  # reproduce/gpu_window.py runs it


def _environment(ctx: Context) -> dict[str, Any]:
    return environment_check(ctx.record["environment"], ctx.cuda)


def _differential(ctx: Context) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    ctx.say("CUDA vs CPU" if ctx.cuda else "no CUDA: CPU-vs-CPU self-check")
    return differential_check(ctx.cuda, steps=8 if ctx.smoke else 24)


# --smoke: a GPU host's `make test` stays short; the PCIe windows keep their 4096-wide layers, so the link's
# background traffic (launches, doorbells) stays far below the 1% tolerance
def _memory(ctx: Context) -> dict[str, Any]:
    return memory_check(ctx.cuda, **({"widths": (1024,) * 3, "steps": 6} if ctx.smoke else {}))


def _pcie(ctx: Context) -> dict[str, Any]:
    return pcie_check(ctx.cuda, steps=6 if ctx.smoke else 12)


def _engines(ctx: Context) -> tuple[dict[str, Any], list[dict]]:
    def saved(rows: list[dict]) -> None:  # after every run: a kill mid-check keeps the finished runs
        ctx.record["engines"] = rows
        save_record(ctx.record, ctx.out)

    plan = engine_plan(ctx.cuda, ctx.smoke)
    ctx.say(f"engines: {len(plan)} runs")
    return run_engines(plan, ctx.out, ctx.cuda, on_row=saved)


CHECKS = (
    Check("environment", "environment", _environment),
    Check("differential", "differential", _differential, rows="differential", section=render.differential_section),
    Check("memory", "device memory, overlap vs sync", _memory, section=render.memory_section),
    Check("pcie", "PCIe bytes, NVML vs ours", _pcie, section=render.pcie_section),
    # on a small Llama: an H100 record of it exists, and the window's scenario runs the engines at 7B's shapes
    Check("engines", "engines", _engines, rows="engines", section=render.engines_section, window=False),
)
CHECK_NAMES = tuple(c.name for c in CHECKS)


def run_check(row: Check, ctx: Context) -> dict[str, Any]:
    """The check's verdict (a raise is a failed check: verdict.guarded); its rows, if any, into the record (none
    when it raised)."""
    result = guarded(row.name, row.run, ctx)
    verdict, rows = result if isinstance(result, tuple) else (result, [])
    if row.rows:
        ctx.record[row.rows] = rows
    return verdict


# ---- record and table ---------------------------------------------------------------------------------------------
def new_record(mode: str, cuda: bool, report: dict[str, Any], env: dict[str, Any]) -> dict[str, Any]:
    """The record before any check has run: every check "not run" until it finishes."""
    return {"schema": SCHEMA, "mode": mode, "cuda": cuda, "complete": False, "elapsed_s": 0.0, "environment": report,
            "checks": [pending(c.name) for c in CHECKS], **{c.rows: [] for c in CHECKS if c.rows},
            "full_environment": env}


def markdown(record: dict[str, Any]) -> str:
    """The record as Markdown tables, each check's section in CHECKS order (render.page)."""
    return render.page(record, [(c.name, c.section) for c in CHECKS])


def save_record(record: dict[str, Any], out: Path) -> None:
    """gpu-check.json, then table.md, each atomically: a kill at any moment leaves whole files, the record first."""
    write_json(out / "gpu-check.json", record)
    write_text_atomic(out / "table.md", markdown(record))


def write_json(path: Path, data: dict[str, Any]) -> None:
    """The record as JSON, atomically (tables.write_text_atomic: a command killed mid-write leaves the old file or
    the whole new one)."""
    write_text_atomic(path, json.dumps(data, indent=1, default=str))

