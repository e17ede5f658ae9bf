"""Host optimizer kernels side by side: torch's fused AdamW (what our engines and the projection use) and DeepSpeed's
CPU Adam (its AVX kernel in AdamW mode: what the paper's ZeRO-Offload baseline ran), on the same flat fp32 buffers,
at 1 thread and at every allowed thread. Rates in G elements/s; the inverse check and the projection band read them
(docs/cost-model.md, "Inverse check").

    python -m zenflow.costmodel.host_adam            # -> results/costmodel/<hardware-id>/host-adam.json (≈1 min)
    python -m zenflow.costmodel.host_adam --numel 1000000 --out /tmp/h.json

Each kernel runs `--steps` timed steps after 3 untimed ones, kernels interleaved round by round (a machine state that
lasts a few seconds hits both), `--rounds` rounds; the rate is the median step. The record is written whole or not
at all (a temporary file renamed into place).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from zenflow.adam import AdamWHyper, adamw_
from zenflow.harness.atomic import write_text_atomic
from zenflow.telemetry.environment import capture_environment

SCHEMA = "costmodel-host-adam/1"
HYPER = AdamWHyper(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def _torch_step(numel: int) -> Callable[[], None]:
    gen = torch.Generator().manual_seed(0)
    param, grad = torch.randn(numel, generator=gen), torch.randn(numel, generator=gen) * 1e-2
    m, v, step = torch.zeros(numel), torch.zeros(numel), [0]

    def run() -> None:
        step[0] += 1
        adamw_([param], [grad], [m], [v], [step[0]], HYPER)
    return run


def _deepspeed_step(numel: int) -> Callable[[], None]:
    from deepspeed.ops.adam import DeepSpeedCPUAdam  # builds (or loads the cached) cpu_adam op

    gen = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(numel, generator=gen))
    param.grad = torch.randn(numel, generator=gen) * 1e-2
    opt = DeepSpeedCPUAdam([param], lr=HYPER.lr, betas=(HYPER.beta1, HYPER.beta2), eps=HYPER.eps,
                           weight_decay=HYPER.weight_decay, adamw_mode=True)
    return opt.step


def _median_ms(step: Callable[[], None], steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


KERNELS = {"torch-fused-adamw": _torch_step, "deepspeed-cpu-adam": _deepspeed_step}


def measure(numel: int, threads: list[int], rounds: int = 3, steps: int = 9,
            kernels: tuple[str, ...] = tuple(KERNELS)) -> dict[str, Any]:
    """{kernel: {threads: {"ms": median step, "gelem_s": rate}}} for the named `kernels` (default: both);
    DeepSpeed's entry says why when its op is missing."""
    makers = {name: KERNELS[name] for name in kernels}
    results: dict[str, Any] = {}
    built: dict[str, Callable[[], None]] = {}
    for name, make in makers.items():
        try:
            built[name] = make(numel)
        except Exception as exc:  # noqa: BLE001  (no deepspeed, or its op cannot build here: recorded, not fatal)
            results[name] = {"unavailable": f"{type(exc).__name__}: {exc}".splitlines()[0]}
    before = torch.get_num_threads()
    samples: dict[tuple[str, int], list[float]] = {}
    try:
        for _ in range(rounds):
            for n in threads:
                torch.set_num_threads(n)  # DeepSpeed's op uses OpenMP too: torch's setting is its thread count
                for name, step in built.items():
                    for _ in range(3):
                        step()  # untimed: first touches, op dispatch caches
                    samples.setdefault((name, n), []).append(_median_ms(step, steps))
    finally:
        torch.set_num_threads(before)
    for (name, n), ms in samples.items():
        median = statistics.median(ms)
        results.setdefault(name, {})[str(n)] = {"ms": median, "gelem_s": numel / median / 1e6,
                                                "rounds_ms": ms}
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zenflow.costmodel.host_adam", description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=16_000_000, help="elements of the flat buffer (default 16M)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--out", type=Path, default=None, help="default results/costmodel/<hardware-id>/host-adam.json")
    args = ap.parse_args(argv)
    for name in ("numel", "rounds", "steps"):
        if getattr(args, name) < 1:
            ap.error(f"argument --{name}: {getattr(args, name)} is not allowed: expected an integer >= 1")
    env = capture_environment()
    out = args.out or Path(__file__).resolve().parents[2] / "results" / "costmodel" / env["hardware_id"] \
        / "host-adam.json"
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = sorted({1, allowed})
    kernels = measure(args.numel, threads, args.rounds, args.steps)
    record = {"schema": SCHEMA, "hardware_id": env["hardware_id"], "cpu": env.get("cpu"), "numel": args.numel,
              "threads": threads, "rounds": args.rounds, "steps": args.steps, "kernels": kernels,
              "command": " ".join(["python -m zenflow.costmodel.host_adam",
                                   *(argv if argv is not None else sys.argv[1:])])}
    write_text_atomic(out, json.dumps(record, indent=1) + "\n")
    for name, by_threads in kernels.items():
        rates = ", ".join(f"{n} thread(s) {v['gelem_s']:.3f}" for n, v in by_threads.items() if isinstance(v, dict))
        print(f"{name}: {rates or by_threads.get('unavailable')} G elements/s")
    print(f"-> {out}")
    return 0


def load_host_adam(path: str | Path) -> dict[str, Any] | None:
    """The record, or None when it does not exist (the band then uses torch's kernel only)."""
    path = Path(path)
    if not path.exists():
        return None
    record = json.loads(path.read_text())
    if record.get("schema") != SCHEMA:
        raise ValueError(f"{path}: schema = {record.get('schema')!r}, expected {SCHEMA!r}")
    return record


def per_core_ratio(record: dict[str, Any] | None) -> float | None:
    """DeepSpeed's CPU Adam rate over torch's fused AdamW, one thread (the per-core ratio the band applies)."""
    if not record:
        return None
    kernels = record["kernels"]
    ds, ours = kernels.get("deepspeed-cpu-adam", {}).get("1"), kernels.get("torch-fused-adamw", {}).get("1")
    return ds["gelem_s"] / ours["gelem_s"] if ds and ours else None


if __name__ == "__main__":
    sys.exit(main())
