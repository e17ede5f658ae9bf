"""The `differential` check of `make gpu-check`: the same seed, model and batches trained with ZenFlowAdamW on CUDA
and on the CPU must agree within a stated tolerance (docs/gpu-check.md). It is the check that catches stream races.

What makes it able to tell the paths apart:
- maxima reported separately for column params (the ZenFlow paths: offload, host AdamW, upload, reselection),
  dense params (1-D, updated on the device by the same code in every case) and the losses;
- per case, the host updates applied and the columns moved at reselections (a path that never ran shows 0);
- a stress case: wider layers, no clipping (so no per-step `.item()` sync) and, on CUDA, a compute backlog (a spin
  kernel queued before each step's optimizer), so copies and uploads are issued while compute is behind;
- negative controls that must FAIL (CUDA only): the run with one Link ordering removed, injected for that run only
  by replacing a Link method with a broken copy of it (`broken_link`).
"""

from __future__ import annotations

import contextlib
import copy
import math
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from zenflow import ZenFlowAdamW
from zenflow.harness.checks.verdict import blind_spots, check, control
from zenflow.link import Link
from zenflow.state import column_states

# fp32 on both sides; they differ only in summation order (cuBLAS vs the CPU BLAS, reductions), a few ulp (~1e-7
# relative) per op. TF32 is switched off for the run. Adam divides by sqrt(v) + eps: with the default eps 1e-8 a
# rounding difference in a near-zero gradient can move a weight by up to lr, so eps is 1e-6 (the update is then
# Lipschitz in the gradient near 0) and lr 1e-4. Measured on the CPU (tests/harness/checks/test_cuda_differential.py):
# 16-ulp noise on every batch ends at <= 5% of the tolerance after 24 steps (with eps 1e-8 and lr 1e-3, 1-ulp noise
# exceeds it 3x). What a race does is far above it: a stale host update is off by ~lr (10x the tolerance), another
# tensor's values in whole rows or columns by the size of the weights (~1e-2, 1000x).
RTOL, ATOL = 1e-4, 1e-5
RAISED = "raised"  # how a control whose run raised starts its detail
DIFF_HYPER = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01)
ZENFLOW_CASE = {"topk_ratio": 0.25, "update_interval": 3, "select_interval": 6, "full_warm_up_rounds": 2,
                "select_strategy": "step"}  # reselects at steps 2, 8, 14, 20 of 24
# name: (zenflow block, gradient clipping, ZenFlowAdamW's accumulate_on keyword: the block refuses that key)
CASES: dict[str, tuple[dict[str, Any], float, str]] = {
    "ref-offload": ({"topk_ratio": 0.0, "update_interval": 1, "select_interval": 1, "overlap_step": False}, 0.0,
                    "host"),
    "ref-zenflow-sync": ({**ZENFLOW_CASE, "overlap_step": False}, 1.0, "host"),
    "ref-zenflow-overlap": ({**ZENFLOW_CASE, "overlap_step": True}, 1.0, "host"),
    # Device accumulation (the CUDA add of device_accumulation.add_on_device_, which no CPU run reaches). Clipping
    # 0.25 is below every step's gradient norm here (0.6-0.85; 1.0 never clips), so every add has a coefficient < 1:
    # an add that dropped it ends 54-79x the tolerance away on the CPU (tests/harness/checks/test_cuda_differential.py).
    "ref-zenflow-da-overlap": ({**ZENFLOW_CASE, "overlap_step": True}, 0.25, "device"),
}
SMALL_WIDTHS = (96, 192, 192, 96)
# On a GPU the differential's model is wider (≈1.3M parameters): copies long enough for a race to have room.
CUDA_WIDTHS = (256, 1024, 1024, 256)
# The stress case: overlap without clipping, on 4096-wide layers on CUDA (≈25M parameters), with a compute backlog.
STRESS = "ref-zenflow-stress"
STRESS_CASE = ({**ZENFLOW_CASE, "overlap_step": True}, 0.0, "host")
STRESS_WIDTHS = (1024, 4096, 4096, 1024)
# torch.cuda._sleep spins this many GPU clock cycles (H100: 1.6-2.0 GHz). Backlog: ~3 ms of compute queued per step
# before the optimizer. Slow link: ~10 ms before each copy of a negative control, so the side stream is far behind.
BACKLOG_CYCLES = 5_000_000
SLOW_LINK_CYCLES = 20_000_000
LOSSES = "<losses>"
KINDS = ("column", "dense", "losses")


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
def fp32_matmuls() -> Iterator[None]:
    """No TF32 while comparing fp32 runs (restored after)."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


# ---- one training run ---------------------------------------------------------------------------------------------
@dataclass
class Trained:
    tensors: dict[str, torch.Tensor]  # parameters after close() and the per-step losses, on the CPU
    host_updates: int                 # opt.host_updates after close(): boundaries whose host AdamW was applied
    columns_moved: int                # columns that changed owner at reselections (either way), summed


def _host_columns(opt: ZenFlowAdamW) -> list[torch.Tensor]:
    """Each column param's host-owned column list (a CPU tensor; whole rows: less the shadows)."""
    return [st.host.offloaded_cols for _, st in column_states(opt.param_groups, opt.state)]


def _moved(before: list[torch.Tensor], after: list[torch.Tensor]) -> int:
    """Columns that changed owner between two snapshots: the symmetric difference of the host-owned columns (CPU
    tensors: this reads no device tensor and adds no sync)."""
    return sum(len(set(old.tolist()) ^ set(new.tolist())) for old, new in zip(before, after))


def train_run(device: str, block: dict[str, Any], clipping: float, steps: int = 24,
              widths: tuple[int, ...] = SMALL_WIDTHS, seed: int = 0, batches: list | None = None,
              backlog_cycles: int = 0, accumulate_on: str = "host") -> Trained:
    """Train SmallNet with ZenFlowAdamW on `device`. The loop adds no sync of its own (losses stay on the device
    until the end), so copies and compute run as asynchronously as the optimizer lets them: a race has room to
    show. `backlog_cycles` (CUDA): a spin kernel queued on the compute stream after backward, before the optimizer,
    so the optimizer's copies and uploads are issued while compute is that far behind. `accumulate_on`: the
    optimizer's keyword (a case's third field)."""
    model = SmallNet(widths, seed).to(device)
    data = [(x.to(device), y.to(device)) for x, y in (batches or make_batches(widths, steps, seed))]
    opt = ZenFlowAdamW(model.parameters(), zenflow=copy.deepcopy(block), gradient_clipping=clipping,
                       accumulate_on=accumulate_on, **DIFF_HYPER)
    losses, moved, owners = [], 0, _host_columns(opt)
    try:
        for x, y in data:
            loss = (model(x) - y).pow(2).mean()
            loss.backward()
            if backlog_cycles and device.startswith("cuda"):
                torch.cuda._sleep(backlog_cycles)  # queued on the compute stream: no host wait
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
            now = _host_columns(opt)
            moved, owners = moved + _moved(owners, now), now
    finally:
        opt.close()
    out = {name: p.detach().to("cpu", copy=True) for name, p in model.named_parameters()}
    out[LOSSES] = torch.stack(losses).cpu()  # device->host sync point, once, at the end
    return Trained(out, opt.host_updates, moved)


def train_case(device: str, block: dict[str, Any], clipping: float, steps: int = 24,
               widths: tuple[int, ...] = SMALL_WIDTHS, seed: int = 0,
               batches: list | None = None, accumulate_on: str = "host") -> dict[str, torch.Tensor]:
    """train_run's tensors: parameters (after close(), which applies every pending host update) and losses."""
    return train_run(device, block, clipping, steps, widths, seed, batches, accumulate_on=accumulate_on).tensors


# ---- comparison ---------------------------------------------------------------------------------------------------
def kind_of(name: str, tensor: torch.Tensor) -> str:
    """"column" (2-D+: ZenFlow splits it by columns), "dense" (1-D: always updated on the device) or "losses"."""
    return "losses" if name == LOSSES else "column" if tensor.dim() >= 2 else "dense"


def compare(ref: dict[str, torch.Tensor], other: dict[str, torch.Tensor], rtol: float = RTOL,
            atol: float = ATOL) -> dict[str, Any]:
    """Elementwise |other - ref| <= atol + rtol |ref| (torch.allclose's rule) for every tensor. `max_ratio` is the
    largest |other - ref| / (atol + rtol |ref|): <= 1 passes; `worst` names the tensor where it is reached.
    `by_kind`: the same maxima over column params, dense params and losses separately."""
    if ref.keys() != other.keys():
        raise ValueError(f"different tensors: {sorted(ref.keys() ^ other.keys())}")
    total = {"max_abs": 0.0, "max_ratio": 0.0, "elements_outside": 0, "worst": None}
    by_kind: dict[str, dict[str, Any]] = {}
    for name, a in ref.items():
        b = other[name].to(a.dtype)
        if b.shape != a.shape:
            raise ValueError(f"{name}: shape {tuple(b.shape)}, expected {tuple(a.shape)}")
        diff = (b - a).abs().nan_to_num(nan=math.inf)  # a NaN on one side is outside every tolerance
        allowed = atol + rtol * a.abs()
        one = {"max_abs": float(diff.max()) if diff.numel() else 0.0,
               "max_ratio": float((diff / allowed).max()) if diff.numel() else 0.0,
               "elements_outside": int((diff > allowed).sum()), "worst": name}
        kind = by_kind.setdefault(kind_of(name, a), {"max_abs": 0.0, "max_ratio": 0.0, "elements_outside": 0,
                                                     "worst": None})
        for acc in (total, kind):
            acc["max_abs"] = max(acc["max_abs"], one["max_abs"])
            acc["elements_outside"] += one["elements_outside"]
            if one["max_ratio"] > acc["max_ratio"]:
                acc["max_ratio"], acc["worst"] = one["max_ratio"], name
    return {"ok": total["elements_outside"] == 0, **total, "rtol": rtol, "atol": atol,
            "by_kind": {k: by_kind[k] for k in KINDS if k in by_kind}}


def case_row(name: str, devices: tuple[str, str], steps: int, a: Trained, b: Trained, **details: Any) -> dict:
    """One differential row: the comparison, and what each device's run did (host updates, columns moved)."""
    return {"case": name, "devices": f"{devices[0]} vs {devices[1]}", "steps": steps, **compare(a.tensors, b.tensors),
            "host_updates": [a.host_updates, b.host_updates], "columns_moved": [a.columns_moved, b.columns_moved],
            **details}


def crashed_row(name: str, devices: tuple[str, str], steps: int, exc: BaseException, **details: Any) -> dict:
    """The row of a case whose run raised: failed, with the exception, so the other cases keep their rows (code
    that has never run on a GPU must cost one row, not the check)."""
    return {"case": name, "devices": f"{devices[0]} vs {devices[1]}", "steps": steps, "ok": False, "max_abs": None,
            "max_ratio": None, "elements_outside": "raised", "worst": None, "rtol": RTOL, "atol": ATOL,
            "host_updates": [None, None], "columns_moved": [None, None], "raised": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(), **details}


def row_problems(row: dict[str, Any]) -> list[str]:
    """Why a row fails: its run raised, outside the tolerance, or the runs applied different numbers of host updates
    (the schedule is fixed by the config). Moved columns are only recorded: a near tie in the column norms may rank
    differently on two devices, which moves another column but changes no value beyond rounding."""
    if "raised" in row:
        return [f"{row['case']}: raised {row['raised']}"]
    problems = [] if row["ok"] else [f"{row['case']}: outside tolerance ({_kinds_outside(row)})"]
    if len(set(row["host_updates"])) > 1:
        problems.append(f"{row['case']}: host updates differ ({row['host_updates'][0]} vs {row['host_updates'][1]})")
    return problems


def _kinds_outside(row: dict[str, Any]) -> str:
    kinds = [k for k, v in row["by_kind"].items() if v["elements_outside"]]
    return ", ".join(kinds) or "—"


# ---- negative controls (CUDA): one Link ordering removed for one run ------------------------------------------------
def _scatter_without_wait(self: Link, src: torch.Tensor, columns: torch.Tensor, dst: torch.Tensor,
                          kind: str) -> torch.cuda.Event:
    """Link.scatter_to_device with `compute.wait_event(done)` removed, on a slow link: the compute stream reads the
    landing buffer before the upload has written it."""
    self.observers.transfer("h2d", kind, src.numel() * src.element_size())
    compute = torch.cuda.current_stream(self.device)
    with torch.cuda.stream(self.h2d_stream):
        torch.cuda._sleep(SLOW_LINK_CYCLES)  # the upload lands late
        landing = torch.empty(src.shape, dtype=src.dtype, device=self.device)
        landing.copy_(src, non_blocking=True)
        done = torch.cuda.Event()
        done.record(self.h2d_stream)
    dst.index_copy_(1, columns, landing)  # BROKEN ON PURPOSE: no compute.wait_event(done) before this read
    landing.record_stream(compute)
    return done


def _gather_without_record_stream(self: Link, src: torch.Tensor, columns: torch.Tensor,
                                  dst: torch.Tensor) -> torch.cuda.Event:
    """Link.gather_to_host with `block.record_stream(d2h)` removed, on a slow link: the gathered block goes back to
    the compute stream's pool while its copy is still queued, and the next compute-stream tensor of its size gets it
    at once (made here, as the allocator would) and overwrites it before the copy reads it."""
    compute = torch.cuda.current_stream(self.device)
    partial = columns.numel() != src.shape[1]
    block = src.index_select(1, columns) if partial else src
    gathered = torch.cuda.Event()
    gathered.record(compute)
    with torch.cuda.stream(self.d2h_stream):
        torch.cuda._sleep(SLOW_LINK_CYCLES)  # the copy reads the block late
        self.d2h_stream.wait_event(gathered)
        dst.copy_(block, non_blocking=True)  # BROKEN ON PURPOSE: no block.record_stream(self.d2h_stream)
        done = torch.cuda.Event()
        done.record(self.d2h_stream)
    if partial:
        shape, dtype = block.shape, block.dtype
        del block  # freed to the compute stream's pool with no stream use recorded
        torch.empty(shape, dtype=dtype, device=self.device).fill_(float("nan"))  # compute stream, before the copy
    return done


CONTROLS: dict[str, tuple[str, Callable]] = {  # name: (Link method replaced, broken variant)
    "upload without compute.wait_event": ("scatter_to_device", _scatter_without_wait),
    "gather without record_stream": ("gather_to_host", _gather_without_record_stream),
}
CONTROL_CASE = "ref-zenflow-overlap"


@contextlib.contextmanager
def broken_link(method: str, variant: Callable) -> Iterator[None]:
    """Replace one Link method with a broken variant for the duration of one run (restored after, also on error)."""
    original = getattr(Link, method)
    setattr(Link, method, variant)
    try:
        yield
    finally:
        setattr(Link, method, original)


def negative_controls(steps: int, cpu_runs: dict[str, Trained]) -> tuple[list[dict], list[dict]]:
    """CUDA: each control trains CONTROL_CASE with one ordering removed; it must come out outside the tolerance
    against the CPU run of the same case. Returns (controls, their rows)."""
    block, clipping, accumulate_on = CASES[CONTROL_CASE]
    controls, rows = [], []
    for name, (method, variant) in CONTROLS.items():
        if CONTROL_CASE not in cpu_runs:
            controls.append(control(name, None, f"not run: its case {CONTROL_CASE} raised"))
            continue
        try:
            with broken_link(method, variant):
                raced = train_run("cuda", block, clipping, steps, CUDA_WIDTHS, accumulate_on=accumulate_on)
        except Exception as exc:  # this control's row only: the others still run
            rows.append(crashed_row(f"control: {name}", ("cuda", "cpu"), steps, exc))
            controls.append(control(name, None, f"{RAISED} {type(exc).__name__}: {exc}"))
            continue
        row = case_row(f"control: {name}", ("cuda", "cpu"), steps, raced, cpu_runs[CONTROL_CASE])
        rows.append(row)
        controls.append(control(name, not row["ok"], f"{CONTROL_CASE} with Link.{method} broken: max diff / "
                                f"allowed {row['max_ratio']:.3g}, {row['elements_outside']} elements outside"))
    return controls, rows


# ---- the check ----------------------------------------------------------------------------------------------------
def run_cases(devices: tuple[str, str], steps: int, cuda: bool) -> tuple[list[dict], dict[str, Trained]]:
    """Every case (and the stress case) on both devices; the rows and the second device's runs by case."""
    widths = CUDA_WIDTHS if cuda else SMALL_WIDTHS
    cases = {name: (*case, widths, 0) for name, case in CASES.items()}
    cases[STRESS] = (*STRESS_CASE, STRESS_WIDTHS if cuda else SMALL_WIDTHS, BACKLOG_CYCLES if cuda else 0)
    rows, second = [], {}
    for name, (block, clipping, accumulate_on, w, backlog) in cases.items():
        details = dict(widths=list(w), clipping=clipping, backlog_cycles=backlog, accumulate_on=accumulate_on)
        try:
            a, b = (train_run(d, block, clipping, steps, w, backlog_cycles=backlog, accumulate_on=accumulate_on)
                    for d in devices)
        except Exception as exc:  # this case's row only: the others still run
            rows.append(crashed_row(name, devices, steps, exc, **details))
            continue
        rows.append(case_row(name, devices, steps, a, b, **details))
        second[name] = b
    return rows, second


def differential_check(cuda: bool, steps: int = 24) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """CUDA vs CPU on a GPU host, then the negative controls; without CUDA, the CPU-vs-CPU self-check (which must
    come out exactly equal) and the controls are "not run"."""
    with fp32_matmuls():
        if not cuda:
            rows, _ = run_cases(("cpu", "cpu"), steps, cuda=False)
            controls = [control(name, None, "needs CUDA streams") for name in CONTROLS]
            return self_check_verdict(rows, controls), rows
        rows, cpu_runs = run_cases(("cuda", "cpu"), steps, cuda=True)
        controls, control_rows = negative_controls(steps, cpu_runs)
    return differential_verdict(rows, controls, control_rows=control_rows), rows


def self_check_verdict(rows: list[dict[str, Any]], controls: list[dict[str, Any]]) -> dict[str, Any]:
    """CPU vs CPU: "not checked" (no CUDA) when bit-identical and on the same paths, else "fail"."""
    crashed = [p for r in rows if "raised" in r for p in row_problems(r)]
    if crashed:
        return check("differential", "fail", "; ".join(crashed), controls=controls)
    exact = all(r["max_abs"] == 0.0 for r in rows) and not any(row_problems(r) for r in rows)
    note = "exactly equal)" if exact else "NOT equal: the CPU run is not deterministic)"
    return check("differential", "not checked" if exact else "fail",
                 "no CUDA: only the CPU-vs-CPU self-check ran (" + note, controls=controls)


def differential_verdict(rows: list[dict[str, Any]], controls: list[dict[str, Any]], **details: Any) -> dict:
    """Pass when every case agrees within the tolerance on the same paths and every negative control failed."""
    problems = [p for r in rows for p in row_problems(r)]
    problems += [f"negative control passed: {name}" for name in blind_spots(controls)]
    problems += [f"negative control {c['control']}: {c['detail']}" for c in controls
                 if c["detail"].startswith(RAISED)]
    return check("differential", "fail" if problems else "pass", "; ".join(problems) or None, controls=controls,
                 **details)
