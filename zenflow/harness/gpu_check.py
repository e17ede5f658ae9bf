"""`make gpu-check`: the checks a GPU host must pass, in one process (docs/gpu-check.md).

    environment  driver, torch and its CUDA build, the run's GPUs and their PCIe link, NVML counter support
    differential the same seed, model and batches trained on CUDA and on the CPU agree (catches stream races)
    memory       extra device memory of overlap vs sync <= one set of the unselected gradient columns
    pcie         NVML's PCIe byte counters of the run's own GPU vs the optimizer's byte counters (pcie_check.py)
    engines      every engine on a small Llama through the harness, with the compute / I/O / stall breakdown

Every check ends as "pass", "fail" or "not checked" with the reason; nothing is skipped silently. Rendering of the
table and figure is at the end; `reproduce/gpu_check.py` is the command line.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import math
import os
import tempfile
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from zenflow import ZenFlowAdamW
from zenflow.harness.configs import DEEPSPEED_EXAMPLES_BLOCK
from zenflow.selection import num_selected

SCHEMA = "gpu-check/1"
# fp32 on both sides; they differ only in summation order (cuBLAS vs the CPU BLAS, reductions), a few ulp (~1e-7
# relative) per op. TF32 is switched off for the run. Adam divides by sqrt(v) + eps: with the default eps 1e-8 a
# rounding difference in a near-zero gradient can move a weight by up to lr, so eps is 1e-6 (the update is then
# Lipschitz in the gradient near 0) and lr 1e-4. Measured on the CPU (tests/test_cuda_differential.py): 16-ulp noise
# on every batch ends at <= 5% of the tolerance after 24 steps (with eps 1e-8 and lr 1e-3, 1-ulp noise exceeds it
# 3x). What a race does is far above it: a stale host update is off by ~lr (10x the tolerance), another tensor's
# values in whole rows or columns by the size of the weights (~1e-2, 1000x).
RTOL, ATOL = 1e-4, 1e-5
DIFF_HYPER = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01)
ZENFLOW_CASE = {"topk_ratio": 0.25, "update_interval": 3, "select_interval": 6, "full_warm_up_rounds": 2,
                "select_strategy": "step"}  # reselects at steps 2, 8, 14, 20 of 24
CASES: dict[str, tuple[dict[str, Any], float]] = {  # name: (zenflow block, gradient clipping)
    "ref-offload": ({"topk_ratio": 0.0, "update_interval": 1, "select_interval": 1, "overlap_step": False}, 0.0),
    "ref-zenflow-sync": ({**ZENFLOW_CASE, "overlap_step": False}, 1.0),
    "ref-zenflow-overlap": ({**ZENFLOW_CASE, "overlap_step": True}, 1.0),
}
# On a GPU the differential's model is wider (≈1.3M parameters): copies long enough for a race to have room.
CUDA_WIDTHS = (256, 1024, 1024, 256)
# The engines' zenflow block is reproduce/llama7b.py's (DeepSpeedExamples' Llama-2 settings).
ENGINE_BLOCK = DEEPSPEED_EXAMPLES_BLOCK


def check(name: str, status: str, reason: str | None = None, **details: Any) -> dict[str, Any]:
    """One line of the verdict: status "pass" | "fail" | "not checked", why (always for the last two)."""
    assert status in ("pass", "fail", "not checked"), status
    return {"name": name, "status": status, "reason": reason, **details}


def guarded(name: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """fn(...), or a failed check with the exception when it raises: one broken check must not lose the others'
    results on a host that is lent for minutes."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:
        return check(name, "fail", f"raised {type(exc).__name__}: {exc}", traceback=traceback.format_exc())


# ---- environment ------------------------------------------------------------------------------------------------
def environment_report(env: dict[str, Any]) -> dict[str, Any]:
    """What a reader needs first: driver, torch and its CUDA build, and the run's GPUs with their PCIe link."""
    from zenflow.telemetry.environment import visible_gpus

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


# ---- CUDA-vs-CPU differential -----------------------------------------------------------------------------------
class SmallNet(torch.nn.Module):
    """Linear layers with LayerNorm and GELU between them, fp32: column params, dense params, clipping all used."""

    def __init__(self, widths: tuple[int, ...], seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        layers: list[torch.nn.Module] = []
        for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
            layers.append(torch.nn.Linear(a, b))
            if i < len(widths) - 2:
                layers += [torch.nn.LayerNorm(b), torch.nn.GELU()]
        self.net = torch.nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def make_batches(widths: tuple[int, ...], steps: int, seed: int, rows: int = 32) -> list[tuple[torch.Tensor, ...]]:
    """(input, target) per step, made on the CPU from the seed alone, so every device trains on the same bits."""
    gen = torch.Generator().manual_seed(seed + 1)
    return [(torch.randn(rows, widths[0], generator=gen), torch.randn(rows, widths[-1], generator=gen))
            for _ in range(steps)]


@contextlib.contextmanager
def _fp32_matmuls() -> Iterator[None]:
    """No TF32 while comparing fp32 runs (restored after)."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def train_case(device: str, block: dict[str, Any], clipping: float, steps: int = 24, widths: tuple[int, ...] =
               (96, 192, 192, 96), seed: int = 0, batches: list | None = None) -> dict[str, torch.Tensor]:
    """Train SmallNet with ZenFlowAdamW on `device`; parameters (after close(), which applies every pending host
    update) and the per-step losses, on the CPU. The loop adds no sync of its own (losses stay on the device until
    the end), so copies and compute run as asynchronously as the optimizer lets them: a race has room to show."""
    model = SmallNet(widths, seed).to(device)
    data = [(x.to(device), y.to(device)) for x, y in (batches or make_batches(widths, steps, seed))]
    opt = ZenFlowAdamW(model.parameters(), zenflow=copy.deepcopy(block), gradient_clipping=clipping, **DIFF_HYPER)
    losses = []
    try:
        for x, y in data:
            loss = (model(x) - y).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
    finally:
        opt.close()
    out = {name: p.detach().to("cpu", copy=True) for name, p in model.named_parameters()}
    return out | {"<losses>": torch.stack(losses).cpu()}  # device->host sync point, once, at the end


def compare(ref: dict[str, torch.Tensor], other: dict[str, torch.Tensor], rtol: float = RTOL,
            atol: float = ATOL) -> dict[str, Any]:
    """Elementwise |other - ref| <= atol + rtol |ref| (torch.allclose's rule) for every tensor. `max_ratio` is the
    largest |other - ref| / (atol + rtol |ref|): <= 1 passes; `worst` names the tensor where it is reached."""
    if ref.keys() != other.keys():
        raise ValueError(f"different tensors: {sorted(ref.keys() ^ other.keys())}")
    worst, max_abs, max_ratio, n_bad = None, 0.0, 0.0, 0
    for name, a in ref.items():
        b = other[name].to(a.dtype)
        if b.shape != a.shape:
            raise ValueError(f"{name}: shape {tuple(b.shape)}, expected {tuple(a.shape)}")
        diff = (b - a).abs().nan_to_num(nan=math.inf)  # a NaN on one side is outside every tolerance
        ratio = float((diff / (atol + rtol * a.abs())).max()) if diff.numel() else 0.0
        if ratio > max_ratio:
            worst, max_ratio = name, ratio
        max_abs = max(max_abs, float(diff.max()) if diff.numel() else 0.0)
        n_bad += int((diff > atol + rtol * a.abs()).sum())
    return {"ok": n_bad == 0, "max_abs": max_abs, "max_ratio": max_ratio, "elements_outside": n_bad,
            "worst": worst, "rtol": rtol, "atol": atol}


def differential(devices: tuple[str, str], steps: int = 24, widths: tuple[int, ...] = (96, 192, 192, 96),
                 cases: dict[str, tuple[dict[str, Any], float]] = CASES) -> list[dict[str, Any]]:
    """Each case trained on devices[0] and devices[1] from the same seed and batches; one comparison per case."""
    rows = []
    with _fp32_matmuls():
        for name, (block, clipping) in cases.items():
            a, b = (train_case(d, block, clipping, steps, widths) for d in devices)
            rows.append({"case": name, "devices": f"{devices[0]} vs {devices[1]}", "steps": steps,
                         **compare(a, b)})
    return rows


def differential_check(cuda: bool, steps: int = 24) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """CUDA vs CPU on a GPU host; without one, the CPU-vs-CPU self-check (which must come out exactly equal)."""
    if cuda:
        rows = differential(("cuda", "cpu"), steps, CUDA_WIDTHS)
        bad = [r["case"] for r in rows if not r["ok"]]
        return check("differential", "fail" if bad else "pass", f"outside tolerance: {bad}" if bad else None), rows
    rows = differential(("cpu", "cpu"), steps)
    exact = all(r["max_abs"] == 0.0 for r in rows)
    note = "exactly equal)" if exact else "NOT equal: the CPU run is not deterministic)"
    return check("differential", "not checked" if exact else "fail",
                 "no CUDA: only the CPU-vs-CPU self-check ran (" + note), rows


# ---- device memory: overlap vs sync -----------------------------------------------------------------------------
def unselected_bound_bytes(model: torch.nn.Module, topk_ratio: float) -> int:
    """One set of the unselected gradient columns: sum over 2-D+ params of out * (in - k) * element size."""
    total = 0
    for p in model.parameters():
        if p.requires_grad and p.dim() >= 2:
            out, cols = p.shape[0], p[0].numel()
            total += out * (cols - num_selected(cols, topk_ratio)) * p.element_size()
    return total


def _peak_extra_bytes(block: dict[str, Any], widths: tuple[int, ...], steps: int) -> int:
    """CUDA: peak allocated bytes during `steps` steps (and the final drain) above what was allocated before."""
    model = SmallNet(widths, seed=0).cuda()
    data = [(x.cuda(), y.cuda()) for x, y in make_batches(widths, steps, 0, rows=8)]
    opt = ZenFlowAdamW(model.parameters(), zenflow=copy.deepcopy(block), gradient_clipping=1.0, **DIFF_HYPER)
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    try:
        for x, y in data:
            (model(x) - y).pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    finally:
        opt.close()  # applies the last host update: part of what overlap mode keeps on the device
    torch.cuda.synchronize()  # sync point: every queued copy and kernel has run
    return torch.cuda.max_memory_allocated() - start


def memory_check(cuda: bool, widths: tuple[int, ...] = (4096,) * 5, steps: int = 24) -> dict[str, Any]:
    """Wide layers at a small batch: the host part is slower than a device step, as with a large model."""
    if not cuda:
        return check("memory", "not checked", "no CUDA: device memory exists only on a GPU")
    sync = _peak_extra_bytes({**ZENFLOW_CASE, "overlap_step": False}, widths, steps)
    overlap = _peak_extra_bytes({**ZENFLOW_CASE, "overlap_step": True}, widths, steps)
    bound = unselected_bound_bytes(SmallNet(widths, seed=0), ZENFLOW_CASE["topk_ratio"])
    return memory_verdict(sync, overlap, bound, widths=list(widths), steps=steps)


def memory_verdict(sync: int, overlap: int, bound: int, **details: Any) -> dict[str, Any]:
    """Pass when overlap's peak is at most `bound` bytes above sync's (issue 11 item 2)."""
    extra = overlap - sync
    return check("memory", "pass" if extra <= bound else "fail", None if extra <= bound else
                 f"overlap used {extra / 2**20:.1f} MiB more than sync, bound {bound / 2**20:.1f} MiB",
                 sync_peak_bytes=sync, overlap_peak_bytes=overlap, extra_bytes=extra, bound_bytes=bound, **details)


# ---- every engine on a small Llama -------------------------------------------------------------------------------
def engine_plan(cuda: bool, smoke: bool, llama7b: bool = False) -> list[tuple[str, dict[str, Any], dict[str, int]]]:
    """(engine, workload, steps) per run: a small Llama (the cpu-scale shape, bf16, seq 512) on a GPU, then the
    Llama-2-7B shapes (random weights) when asked; the tiny shape with a few steps on the CPU and in --smoke."""
    from zenflow.harness.configs import CORE_ENGINES as ENGINES

    tiny = {"model": "cpu-scale", "dtype": "fp32", "seq_len": 16, "hidden": 64, "layers": 2, "intermediate": 128,
            "heads": 4, "data": "synthetic"}
    if smoke:
        return [(e, tiny, {"warmup_steps": 2, "timed_steps": 4}) for e in ("ref-offload", "ref-zenflow")]
    if not cuda:
        return [(e, tiny, {"warmup_steps": 2, "timed_steps": 4}) for e in ENGINES]
    small = {"model": "cpu-scale", "dtype": "bf16", "seq_len": 512, "micro_batch": 1, "data": "synthetic"}
    plan = [(e, small, {"warmup_steps": 8, "timed_steps": 16}) for e in ENGINES]
    if llama7b:
        shape = {"hidden": 4096, "layers": 32, "intermediate": 11008, "heads": 32}
        plan += [(e, {**small, **shape}, {"warmup_steps": 4, "timed_steps": 8}) for e in ENGINES]
    return plan


def run_engines(plan: list, out: Path, cuda: bool, timeout_s: float = 300) -> tuple[dict[str, Any], list[dict]]:
    """Each run in a fresh process (zenflow.harness.runner); DeepSpeed engines say "not installed" without it.
    `timeout_s` per run (x4 at Llama-2-7B shapes): a hung run becomes a failed record, not a hung check."""
    from zenflow.harness.engines import deepspeed_config
    from zenflow.harness.records import RunRecord
    from zenflow.harness.runner import RunSpec, run_in_subprocess

    have_ds = importlib.util.find_spec("deepspeed") is not None
    # The cpu-scale Llama's tokenizer (zenflow/harness/workloads.py): without these every run would fail alike.
    lacking = [m for m in ("transformers", "sentencepiece", "mistral_common") if importlib.util.find_spec(m) is None]
    rows = []
    for engine, workload, steps in plan:
        shape = f"h{workload.get('hidden', 512)}x{workload.get('layers', 8)}"
        row = {"engine": engine, "shape": shape, "status": "not installed", "record": None}
        if lacking or (engine.startswith("ds-") and not have_ds):
            rows.append(row | {"error": [f"not installed: {lacking or ['deepspeed']}"]})
            continue
        cfg = deepspeed_config(engine, ENGINE_BLOCK, workload["dtype"], 1, lr=2e-5, weight_decay=0.01,
                               clipping=1.0, cuda=cuda)
        spec = RunSpec(engine=engine, label="gpu-check", workload=workload, ds_config=cfg, progress=False, **steps)
        path = out / "runs" / f"{engine}-{shape}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        big = workload.get("hidden", 512) >= 4096
        rec: RunRecord = run_in_subprocess(spec, path, timeout_s=timeout_s * (4 if big else 1))
        s = rec.summary
        rows.append(row | {"status": rec.status, "record": str(path.relative_to(out)),
                           "error": (rec.error or "").strip().splitlines()[-1:] or None,
                           **{k: s.get(k) for k in ("cycle_mean_ms", "compute_ms", "io_ms", "stall_ms")},
                           "stall_includes_io": rec.protocol.get("stall_includes_io")})
    failed = [f"{r['engine']} ({r['shape']})" for r in rows if r["status"] == "failed"]
    missing = [r["engine"] for r in rows if r["status"] == "not installed"]
    reason = "; ".join(x for x in (failed and f"failed: {failed}", missing and f"not installed: {missing}") if x)
    status = "fail" if failed else "not checked" if lacking or not rows else "pass"
    return check("engines", status, reason or None, scale="gpu" if cuda else "cpu-scale"), rows


# ---- record, table, figure ----------------------------------------------------------------------------------------
def write_json(path: Path, data: dict[str, Any]) -> None:
    """Atomic: a reader sees the old record or the whole new one (temporary file in the same folder + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, default=str)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _fmt(v: Any, spec: str = ".1f") -> str:
    return "—" if v is None else format(v, spec) if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)


def counters(support: dict[str, str | None] | None) -> str:
    """NVML's PCIe byte counter support as words: None per field means it answered."""
    if not support:
        return "not read"
    if all(v is None for v in support.values()):
        return "answered"
    return ", ".join(f"{k} refused ({v})" if v else f"{k} answers" for k, v in support.items())


def markdown(record: dict[str, Any]) -> str:
    """The record as Markdown tables (tabulate)."""
    from tabulate import tabulate

    def tab(rows: list[list[Any]], headers: list[str]) -> str:
        return tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True)

    env, c = record["environment"], {x["name"]: x for x in record["checks"]}
    gpus = "; ".join(f"cuda:{g['cuda_index']} {g['name']} PCIe gen {g.get('pcie_gen')}/{g.get('pcie_gen_max')} "
                     f"x{g.get('pcie_width')}/{g.get('pcie_width_max')}, "
                     f"byte counters {counters(g.get('pcie_counters'))}"
                     for g in env["gpus"]) or "none"
    out = [f"# gpu-check — {env['hardware_id']}", "",
           f"Driver {env['driver'] or '—'}; NVML {env['nvml']}; torch {env['torch']} (CUDA build "
           f"{env['torch_cuda_build']}, usable: {env['cuda_available']}); "
           f"DeepSpeed {env['deepspeed'] or 'not installed'}.",
           f"GPUs of this run (current/max link): {gpus}.", "",
           tab([[x["name"], x["status"], x["reason"] or ""] for x in record["checks"]], ["check", "status", "reason"]),
           "", "## Differential", "",
           tab([[r["case"], r["devices"], r["steps"], _fmt(r["max_abs"], ".2e"), _fmt(r["max_ratio"], ".2e"),
                 r["elements_outside"], f"rtol {r['rtol']:g}, atol {r['atol']:g}"] for r in record["differential"]],
               ["case", "devices", "steps", "max abs diff", "diff / allowed (max)", "outside", "tolerance"])]
    if "extra_bytes" in c["memory"]:
        m = c["memory"]
        out += ["", "## Device memory (overlap vs sync)", "",
                tab([[_fmt(m["sync_peak_bytes"] / 2**20), _fmt(m["overlap_peak_bytes"] / 2**20),
                      _fmt(m["extra_bytes"] / 2**20), _fmt(m["bound_bytes"] / 2**20), m["status"]]],
                    ["sync peak MiB", "overlap peak MiB", "extra MiB", "bound MiB", "status"])]
    if "directions" in c["pcie"]:
        out += ["", "## PCIe bytes (NVML vs the optimizer)", "",
                "NVML counts packet headers and read requests too; plain copies of known size measure that "
                "overhead first (bytes per payload byte), and our bytes through it predict each counter "
                f"(tolerance ±{c['pcie'].get('tolerance', 0) * 100:.0f}%).", "",
                tab([[d, r["ours"], _fmt(r["nvml"], "d"), _fmt(r.get("predicted"), ".0f"),
                      _fmt(r["nvml"] / r["ours"] if r["nvml"] is not None and r["ours"] else None, ".3f"),
                      _fmt(r.get("overhead"), ".3f"), _fmt(r["idle_nvml"], "d"), r["status"]]
                     for d, r in c["pcie"]["directions"].items()],
                    ["direction", "ours", "NVML", "predicted", "NVML / ours", "copy overhead", "NVML idle",
                     "status"])]
    out += ["", "## Engines", "",
            tab([[r["engine"], r["shape"], r["status"], _fmt(r.get("cycle_mean_ms")), _fmt(r.get("compute_ms")),
                  "(in stall)" if r.get("stall_includes_io") else _fmt(r.get("io_ms")), _fmt(r.get("stall_ms")),
                  " ".join(r.get("error") or []) if r["status"] != "ok" else ""] for r in record["engines"]],
                ["engine", "shape", "status", "step ms", "compute ms", "I/O ms", "stall ms", "note"])]
    return "\n".join(out) + "\n"


def figure(record: dict[str, Any], path: Path) -> None:
    """Left: compute / I/O / stall per engine. Right: the differential's worst difference per case vs atol."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    ok = [r for r in record["engines"] if r["status"] == "ok" and r.get("cycle_mean_ms")]
    names = [f"{r['engine']}\n{r['shape']}" for r in ok]
    bottom = [0.0] * len(ok)
    for key, color, label in (("compute_ms", "#4C72B0", "compute"), ("io_ms", "#DD8452", "exposed I/O"),
                              ("stall_ms", "#C44E52", "stall")):
        vals = [r.get(key) or 0.0 for r in ok]
        left.bar(names, vals, bottom=bottom, color=color, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    left.set_ylabel("ms per step (mean over whole update cycles)")
    scale = next((c.get("scale") for c in record["checks"] if c["name"] == "engines"), "?")
    left.set_title(f"Engines ({scale})", fontsize=10)
    left.legend(fontsize=8, frameon=False)
    left.tick_params(axis="x", labelsize=7)
    diff = record["differential"]
    ratios = [max(r["max_ratio"], 1e-9) for r in diff]
    right.bar([r["case"] for r in diff], ratios, color=["#55A868" if r["ok"] else "#C44E52" for r in diff])
    for i, r in enumerate(diff):
        right.text(i, ratios[i] * 2, "0 (exactly equal)" if r["max_abs"] == 0 else f"{r['max_ratio']:.2g}",
                   ha="center", va="bottom", fontsize=8)
    right.axhline(1.0, color="k", linestyle="--", label=f"tolerance (atol {ATOL:g} + rtol {RTOL:g} |ref|)")
    right.set_yscale("log")
    right.set_ylim(1e-9, 1e3)
    right.set_ylabel("max |difference| / allowed")
    right.set_title(f"Differential after {diff[0]['steps'] if diff else '?'} steps "
                    f"({diff[0]['devices'] if diff else '—'})", fontsize=10)
    right.legend(fontsize=8, frameon=False)
    right.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"gpu-check — {record['environment']['hardware_id']}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def verdict(checks: list[dict[str, Any]]) -> int:
    """Exit code: 1 if any check failed, else 0 ("not checked" is reported, not failed)."""
    return 1 if any(c["status"] == "fail" for c in checks) else 0
