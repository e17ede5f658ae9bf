"""`make gpu-check`: the checks a GPU host must pass, in one process (docs/gpu-check.md).

    environment  driver, torch and its CUDA build, the run's GPUs and their PCIe link, NVML counter support
    differential the same seed, model and batches trained on CUDA and on the CPU agree (differential.py)
    memory       extra device memory of overlap vs sync <= its bound (memory.py)
    pcie         NVML's PCIe byte counters of the run's own GPU vs the optimizer's byte counters (pcie.py)
    engines      every engine on a small Llama through the harness, with the compute / I/O / stall breakdown

Every check ends as "pass", "fail" or "not checked" with the reason; nothing is skipped silently (verdict.py). The
record and table are written after every check (`save_record`), so a command killed midway leaves the checks it
finished. Rendering of the table and figure is at the end; `reproduce/gpu_check.py` is the command line.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zenflow.harness.checks.differential import (  # noqa: F401  (re-exported: tests/harness/checks/test_cuda_differential.py reads them here)
    ATOL,
    CASES,
    CUDA_WIDTHS,
    DIFF_HYPER,
    RTOL,
    SmallNet,
    compare,
    differential_check,
    fp32_matmuls,
    make_batches,
    train_case,
)
from zenflow.harness.checks.memory import memory_check, memory_verdict, unselected_bound_bytes  # noqa: F401
from zenflow.harness.checks.verdict import check, guarded, pending, verdict  # noqa: F401  (verdict, guarded: re-exported)
from zenflow.harness.configs import BEYOND_ENGINES, CORE_ENGINES, DEEPSPEED_EXAMPLES_BLOCK, SMOKE_ENGINES
from zenflow.harness.engines.build import deepspeed_config
from zenflow.harness.engines.registry import is_deepspeed
from zenflow.harness.records import RunRecord
from zenflow.harness.runner import run_in_subprocess
from zenflow.harness.session import RunSpec
from zenflow.harness.tables import write_text_atomic
from zenflow.telemetry.environment import visible_gpus

SCHEMA = "gpu-check/2"
CHECK_NAMES = ("environment", "differential", "memory", "pcie", "engines")
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
    """The message to stop with when NVML sees GPUs but torch cannot use CUDA (audit item 16); None otherwise."""
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
    notes += [f"NVML cannot match: {e}" for e in report["mapping_errors"]]  # audit item 13: never guessed by index
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


# ---- record, table, figure ----------------------------------------------------------------------------------------
def new_record(mode: str, cuda: bool, report: dict[str, Any], env: dict[str, Any]) -> dict[str, Any]:
    """The record before any check has run: every check "not run" until it finishes."""
    return {"schema": SCHEMA, "mode": mode, "cuda": cuda, "complete": False, "elapsed_s": 0.0, "environment": report,
            "checks": [pending(name) for name in CHECK_NAMES], "differential": [], "engines": [],
            "full_environment": env}


def save_record(record: dict[str, Any], out: Path) -> None:
    """gpu-check.json, then table.md, each atomically: a kill at any moment leaves whole files, the record first."""
    write_json(out / "gpu-check.json", record)
    write_atomic(out / "table.md", markdown(record))


def write_atomic(path: Path, text: str) -> None:
    """Atomic (tables.write_text_atomic): a command killed mid-write leaves the old file or the whole new one."""
    write_text_atomic(path, text)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """The record as JSON, atomically (write_atomic)."""
    write_atomic(path, json.dumps(data, indent=1, default=str))


def _fmt(v: Any, spec: str = ".1f") -> str:
    return "—" if v is None else format(v, spec) if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)


def counters(support: dict[str, str | None] | None) -> str:
    """NVML's PCIe byte counter support as words: None per field means it answered."""
    if not support:
        return "not read"
    if all(v is None for v in support.values()):
        return "answered"
    return ", ".join(f"{k} refused ({v})" if v else f"{k} answers" for k, v in support.items())


def _tab(rows: list[list[Any]], headers: list[str]) -> str:
    from tabulate import tabulate

    return tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True)


def _pair(values: list[int] | None) -> str:
    """One number when both devices agree, "a / b" when they do not."""
    return "—" if not values else str(values[0]) if len(set(values)) == 1 else " / ".join(map(str, values))


def _differential_table(rows: list[dict[str, Any]]) -> str:
    """Records before gpu-check/2 had one maximum per case; later ones split it by kind and say what ran."""
    if not any("by_kind" in r for r in rows):
        return _tab([[r["case"], r["devices"], r["steps"], _fmt(r["max_abs"], ".2e"), _fmt(r["max_ratio"], ".2e"),
                      r["elements_outside"], f"rtol {r['rtol']:g}, atol {r['atol']:g}"] for r in rows],
                    ["case", "devices", "steps", "max abs diff", "diff / allowed (max)", "outside", "tolerance"])
    kind = lambda r, k: _fmt((r.get("by_kind", {}).get(k) or {}).get("max_ratio"), ".2e")  # noqa: E731
    return _tab([[r["case"], r["devices"], r["steps"], _fmt(r["max_abs"], ".2e"), kind(r, "column"), kind(r, "dense"),
                  kind(r, "losses"), r["elements_outside"], _pair(r.get("host_updates")), _pair(r.get("columns_moved")),
                  f"rtol {r['rtol']:g}, atol {r['atol']:g}"] for r in rows],
                ["case", "devices", "steps", "max abs diff", "diff / allowed: column params", "dense params", "losses",
                 "outside", "host updates", "columns moved", "tolerance"])


def _memory_section(m: dict[str, Any]) -> list[str]:
    mib = lambda key: _fmt(m[key] / 2**20)  # noqa: E731
    if "control_extra_bytes" not in m:
        return ["", "## Device memory (overlap vs sync)", "",
                _tab([[mib("sync_peak_bytes"), mib("overlap_peak_bytes"), mib("extra_bytes"), mib("bound_bytes"),
                       m["status"]]], ["sync peak MiB", "overlap peak MiB", "extra MiB", "bound MiB", "status"])]
    return ["", "## Device memory (overlap vs sync)", "",
            f"Peak `{m.get('metric')}` above the start of a window of {m.get('steps')} steps between reselections, "
            "copies slowed by a spin on the d2h stream; bound: two sets of the unselected gradient columns "
            "(docs/gpu-check.md).", "",
            _tab([[mib("sync_peak_bytes"), mib("overlap_peak_bytes"), mib("extra_bytes"), mib("bound_bytes"),
                   mib("control_extra_bytes"), m["status"]]],
                 ["sync peak MiB", "overlap peak MiB", "extra MiB", "bound MiB",
                  "without backpressure: extra MiB", "status"])]


def _pcie_section(p: dict[str, Any]) -> list[str]:
    """Per window and direction; an NVML total a 32-bit counter could have wrapped under is marked (F17)."""
    windows = p.get("windows") or {"ref-offload": p}  # before gpu-check/2: one ref-offload window, at the top
    rows, wrapped = [], []
    for name, w in windows.items():
        if "directions" not in w:  # its measurement raised (pcie_check): the reason is in the checks' table
            rows.append([name, "—", "—", "—", "—", "—", "—", "—", w["status"]])
            continue
        seen = any(r["nvml"] is not None for r in w["directions"].values())
        mark = "†" if seen and w.get("wrap_ambiguous") is not False else ""
        if mark:
            bits = "/".join(sorted({str(b) for b in (w.get("counter_bits") or {}).values()})) or "?"
            wrapped.append(f"{name}: {bits}-bit, longest gap between reads "
                           f"{_fmt(w.get('counter_max_gap_s'), '.3f')} s")
        rows += [[name, d, r["ours"], _fmt(r["nvml"], "d") + (mark if r["nvml"] is not None else ""),
                  _fmt(r.get("predicted"), ".0f"),
                  _fmt(r["nvml"] / r["ours"] if r["nvml"] is not None and r["ours"] else None, ".3f"),
                  _fmt(r.get("overhead"), ".3f"), _fmt(r["idle_nvml"], "d"), r["status"]]
                 for d, r in w["directions"].items()]
    out = ["", "## PCIe bytes (NVML vs the optimizer)", "",
           "NVML counts packet headers and read requests too; plain copies of known size measure that overhead "
           "first (bytes per payload byte), and our bytes through it predict each counter "
           f"(tolerance ±{p.get('tolerance', 0) * 100:.0f}%).", "",
           _tab(rows, ["window", "direction", "ours", "NVML", "predicted", "NVML / ours", "copy overhead",
                       "NVML idle", "status"])]
    if wrapped:
        out += ["", "† a counter of this width could have wrapped unseen between two reads at this link's speed "
                f"({'; '.join(wrapped)}): the total may be short by a multiple of its range."]
    return out


def _controls_section(checks: list[dict[str, Any]]) -> list[str]:
    rows = [[c["name"], x["control"], x["outcome"], x["detail"]] for c in checks for x in c.get("controls") or []]
    if not rows:
        return []
    return ["", "## Negative controls (each must fail)", "", _tab(rows, ["check", "control", "outcome", "detail"])]


def markdown(record: dict[str, Any]) -> str:
    """The record as Markdown tables (tabulate)."""
    env, c = record["environment"], {x["name"]: x for x in record["checks"]}
    gpus = "; ".join(f"cuda:{g['cuda_index']} {g['name']} PCIe gen {g.get('pcie_gen')}/{g.get('pcie_gen_max')} "
                     f"x{g.get('pcie_width')}/{g.get('pcie_width_max')}, "
                     f"byte counters {counters(g.get('pcie_counters'))}"
                     for g in env["gpus"]) or "none"
    out = [f"# gpu-check — {env['hardware_id']}", "",
           f"Driver {env['driver'] or '—'}; NVML {env['nvml']}; torch {env['torch']} (CUDA build "
           f"{env['torch_cuda_build']}, usable: {env['cuda_available']}); "
           f"DeepSpeed {env['deepspeed'] or 'not installed'}.",
           f"GPUs of this run (current/max link): {gpus}."]
    if record.get("complete") is False:
        done = sum(x["status"] != "not run" for x in record["checks"])
        out += ["", f"**Incomplete record**: {done} of {len(record['checks'])} checks finished (the command stopped, "
                "or is still running); the others say \"not run\"."]
    timed = any("seconds" in x for x in record["checks"])  # gpu-check/2 records from before 2026-11-27 have none
    out += ["", _tab([[x["name"], x["status"], *([_fmt(x.get("seconds"))] if timed else []), x["reason"] or ""]
                      for x in record["checks"]], ["check", "status", *(["seconds"] if timed else []), "reason"])]
    if record["differential"]:
        out += ["", "## Differential", "", _differential_table(record["differential"])]
    if "extra_bytes" in c.get("memory", {}):
        out += _memory_section(c["memory"])
    if "directions" in c.get("pcie", {}) or "windows" in c.get("pcie", {}):
        out += _pcie_section(c["pcie"])
    out += _controls_section(record["checks"])
    out += ["", "## Engines", "",
            _tab([[r["engine"], r["shape"], r["status"], _fmt(r.get("cycle_mean_ms")), _fmt(r.get("compute_ms")),
                   "(in stall)" if r.get("stall_includes_io") else _fmt(r.get("io_ms")), _fmt(r.get("stall_ms")),
                   " ".join(r.get("error") or []) if r["status"] != "ok" else ""] for r in record["engines"]],
                 ["engine", "shape", "status", "step ms", "compute ms", "I/O ms", "stall ms", "note"])]
    return "\n".join(out) + "\n"


def figure(record: dict[str, Any], path: Path) -> None:
    """Left: compute / I/O / stall per engine. Right: the differential's worst difference per case vs the
    tolerance, per kind (column params, dense params, losses) where the record has them. Without engine runs
    (gpu_window.py runs checks 1-4 only) the differential alone, not an empty panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in record["engines"] if r["status"] == "ok" and r.get("cycle_mean_ms")]
    if ok:
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
        _engines_panel(left, ok, next((c.get("scale") for c in record["checks"] if c["name"] == "engines"), "?"))
    else:
        fig, right = plt.subplots(figsize=(7, 4.2))
    _differential_panel(right, record["differential"])
    fig.suptitle(f"gpu-check — {record['environment']['hardware_id']}{'' if ok else ' (no engine runs)'}",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _engines_panel(ax: Any, ok: list[dict[str, Any]], scale: str) -> None:
    names = [f"{r['engine']}\n{r['shape']}" for r in ok]
    bottom = [0.0] * len(ok)
    for key, color, label in (("compute_ms", "#4C72B0", "compute"), ("io_ms", "#DD8452", "exposed I/O"),
                              ("stall_ms", "#C44E52", "stall")):
        vals = [r.get(key) or 0.0 for r in ok]
        ax.bar(names, vals, bottom=bottom, color=color, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("ms per step (mean over whole update cycles)")
    ax.set_title(f"Engines ({scale})", fontsize=10)
    ax.legend(fontsize=8, frameon=False)
    ax.tick_params(axis="x", labelsize=7)


def _differential_panel(ax: Any, diff: list[dict[str, Any]]) -> None:
    split = any("by_kind" in r for r in diff)
    kinds = [("column", "#4C72B0"), ("dense", "#8172B3"), ("losses", "#937860")] if split else [(None, None)]
    width = 0.8 / len(kinds)
    for i, r in enumerate(diff):
        if "raised" in r:  # no ratio: its run raised (differential.crashed_row)
            ax.text(i, 1.0, "raised", ha="center", va="bottom", fontsize=7, color="#C44E52")
    for j, (kind, color) in enumerate(kinds):
        for i, r in enumerate(diff):
            if "raised" in r:
                continue
            ratio = (r.get("by_kind", {}).get(kind) or {}).get("max_ratio", 0.0) if kind else r["max_ratio"]
            x, y = i + (j - (len(kinds) - 1) / 2) * width, max(ratio, 1e-9)
            label = None if not kind or i else kind if kind == "losses" else f"{kind} params"
            ax.bar(x, y, width, color=color or ("#55A868" if r["ok"] else "#C44E52"), label=label)
            if not kind or kind == "column":
                ax.text(x, y * 2, "0 (exactly equal)" if ratio == 0 else f"{ratio:.2g}", ha="center", va="bottom",
                        fontsize=7)
    ax.set_xticks(range(len(diff)), [r["case"] for r in diff])
    ax.axhline(1.0, color="k", linestyle="--", label=f"tolerance (atol {ATOL:g} + rtol {RTOL:g} |ref|)")
    ax.set_yscale("log")
    ax.set_ylim(1e-9, 1e3)
    ax.set_ylabel("max |difference| / allowed")
    ax.set_title(f"Differential after {diff[0]['steps'] if diff else '?'} steps "
                 f"({diff[0]['devices'] if diff else '—'})", fontsize=10)
    ax.legend(fontsize=7, frameon=False)
    ax.tick_params(axis="x", labelsize=7)
