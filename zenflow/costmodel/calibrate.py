"""Calibration microbenchmarks for the cost model (docs/cost-model.md), stored as a record.

Each constant is measured alone, outside any end-to-end run, on the machine at hand:

- short training loops of the workload at three sequence lengths (8, 32, 128; the validation runs use 4, 16, 64,
  256, 512), forward+backward timed alone (piecewise linear: fixed + per-token time), with each optimizer in the
  layout it runs in: plain fused `torch.optim.AdamW` on 2 threads (no-offload); `ZenFlowAdamW` synchronous, topk 0
  on 2 threads (ZeRO-Offload) and topk 0.1 / topk 0 on 1 thread (the overlap layout's per-core rates). The
  optimizer's blocking sections give gradient copy / gather to the host, host fp32 accumulation, host AdamW,
  parameter copy / scatter back; the rest of the step is clipping norm + device update;
- contention: forward+backward on one core while the other core runs host AdamW, against each alone.

So that it reproduces: the loops run in `rounds` rounds, each a fresh process that first runs every loop
once, discarded (first allocations, thread pools, the CPU kernels chosen for each new shape: without it the first
round of a point came out up to 2.3x slow), then every loop, each dropping its first steps and giving the median of
the rest. On this shared 2-core VM one round in five or so is off for a whole process, in either direction (one
process's 2-thread host AdamW 22 ms against 32.4-32.8 in the four others; a tiny model's seq-128 point 1.7x slow in
every round of one process), so rounds are processes and each number is the median over them (five by default).
The VM's speed also drifts between processes a minute apart, every number of a round alike (the AMD EPYC VM,
2026-11-28: a calibration refused at 52% and 39% spreads on a quiet machine): each round's speed relative to the
others (`round_speeds`: the median over every number of the round's value over that number's median) is factored
out before the medians and spreads are taken, so a drift moves nothing and an unstable number still stands out.
Its spread, the range of the middle rounds (one round each way of five left out) relative to the median,
differences under 1 ms not counted as relative, is recorded, and a calibration whose largest spread exceeds
SPREAD_BOUND is refused: it is written beside the record as `calibration.refused.json` and the committed one stays
(--force overrides). Either way the message says what was measured while it ran: the round speeds (the drift), the
load average, and the share of the machine other processes and the hypervisor (steal) took (machine_load.py).
`agreement()` compares two records.

    python -m zenflow.costmodel.calibrate [--out results/costmodel/<hardware-id>/calibration.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from zenflow.adam import AdamWHyper, adamw_
from zenflow.costmodel.model import CostModelError
from zenflow.costmodel.presets import load_calibration
from zenflow.costmodel.validate import utc_now
from zenflow.harness.atomic import write_text_atomic
from zenflow.harness.cli import int_at_least
from zenflow.harness.configs import TINY_LLAMA_SHAPE
from zenflow.harness.engines.build import deepspeed_config
from zenflow.harness.session import RunSpec, Session, model_facts
from zenflow.harness.workloads import Workload, build_model
from zenflow.telemetry.environment import capture_environment
from zenflow.telemetry.machine_load import LoadWindow, busy
from zenflow.telemetry.neighbours import NeighbourWatch, wait_until_quiet

ROOT = Path(__file__).resolve().parents[2]
CAL_SEQS = (8, 32, 128)  # calibration points; validation runs use other sequence lengths (4, 16, 64, 256, 512)
SCHEMA = "costmodel-calibration/1"
SMOKE_SHAPE = TINY_LLAMA_SHAPE
ROUNDS = 5
WARMUP_STEPS = 3  # per loop: selection, first allocations of that sequence length
# The largest spread (range of the middle rounds / median) a kept calibration may have. The median of five rounds
# is steadier than that range: two calibrations in a row here, spreads 19.7% and 4.6%, agreed within 10% on every
# number (AGREEMENT_BOUND is what `make project` twice must meet).
SPREAD_BOUND = 0.25
AGREEMENT_BOUND = 0.15
SPREAD_FLOOR_MS = 1.0  # a spread is relative to max(median, this): sub-millisecond jitter is not instability
KEYS = ("forward_backward_ms", "step_parts_ms")  # a loop's calibrated numbers


def _line(points: dict[int, float]) -> dict[str, float]:
    return {str(k): v for k, v in sorted(points.items())}


def _training_loop(w: Any, block: dict[str, Any] | None, threads: int, seqs: tuple[int, ...],
                   repeats: int) -> dict[str, Any]:
    """Short runs of the harness's one run loop (session.Session, in this process), one per sequence length:
    `block` None = no-offload (plain fused AdamW, clipping 1.0); otherwise ref-zenflow with that block,
    synchronous, selection once at the first step. The first WARMUP_STEPS steps (selection, allocation) are not used.
    Returns the median forward+backward per sequence length and the median step parts over all used steps: the
    optimizer's blocking sections from the record's `blocks_ms`, the rest of the optimizer step as "device"."""
    engine = "no-offload" if block is None else "ref-zenflow"
    zenflow = {**(block or {}), "overlap_step": False, "select_strategy": "step", "select_interval": 10**6}
    cfg = deepspeed_config(engine, zenflow, w.dtype, micro_batch=1, lr=1e-5, weight_decay=0.01, clipping=1.0,
                           cuda=False)
    fb: dict[int, float] = {}
    rows = []
    for seq in seqs:
        spec = RunSpec(engine=engine, label="calibration", workload={**w.to_dict(), "seq_len": seq,
                                                                    "data": "synthetic", "device": "cpu"},
                       ds_config=cfg, warmup_steps=WARMUP_STEPS, timed_steps=repeats, threads=threads,
                       progress=False)
        session = Session(spec)
        try:
            session.step(WARMUP_STEPS + repeats)
        finally:
            session.close()
        session.timeline.finish()
        used = session.timeline.steps[WARMUP_STEPS:]
        fb[seq] = statistics.median(t.forward_backward_ms for t in used)
        rows += [{**t.blocks_ms, "total": t.optimizer_ms} for t in used]
    keys = {k for r in rows for k in r}
    parts = {k: statistics.median(r.get(k, 0.0) for r in rows) for k in keys}
    parts["device"] = parts["total"] - sum(v for k, v in parts.items() if k != "total")  # clip norm + device update
    return {"threads": threads, "block": block, "forward_backward_ms": _line(fb), "step_parts_ms": parts}


def round_speeds(by_round: dict[str, list[dict[str, Any]]]) -> list[float]:
    """Each round's speed relative to the median round: the median, over every calibrated number whose median over
    the rounds is at least SPREAD_FLOOR_MS, of the round's value over that median (1.2: the whole round 20% slow)."""
    ratios: list[list[float]] = []
    for runs in by_round.values():
        ratios = ratios or [[] for _ in runs]
        for key in KEYS:
            for name in {n for r in runs for n in r[key]}:
                values = [r[key].get(name, 0.0) for r in runs]
                middle = statistics.median(values)
                if middle >= SPREAD_FLOOR_MS:
                    for i, v in enumerate(values):
                        ratios[i].append(v / middle)
    speeds = [statistics.median(r) if r else 1.0 for r in ratios]
    level = statistics.median(speeds) if speeds else 1.0
    return [v / level for v in speeds]


def at_speed(loop: dict[str, Any], speed: float) -> dict[str, Any]:
    """One loop's round with every calibrated number divided by the round's speed (the drift factored out)."""
    return {**loop, **{key: {n: v / speed for n, v in loop[key].items()} for key in KEYS}}


def _spread(values: list[float]) -> float:
    """The range of the middle rounds (a quarter of the rounds at each end left out: one each way of five), relative
    to the median (with the SPREAD_FLOOR_MS floor)."""
    ordered, cut = sorted(values), len(values) // 4
    middle = ordered[cut:len(ordered) - cut]
    return (middle[-1] - middle[0]) / max(statistics.median(values), SPREAD_FLOOR_MS)


def combine(rounds: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """One loop's rounds -> (the loop's record with every number the median over the rounds, the spread of each)."""
    first = rounds[0]
    combined = {k: v for k, v in first.items() if k not in ("forward_backward_ms", "step_parts_ms")}
    spread: dict[str, Any] = {}
    for key in KEYS:
        names = sorted({n for r in rounds for n in r[key]}, key=str)
        values = {n: [r[key].get(n, 0.0) for r in rounds] for n in names}
        combined[key] = {n: statistics.median(v) for n, v in values.items()}
        spread[key] = {n: _spread(v) for n, v in values.items()}
    return combined, spread


def largest_spread(spreads: dict[str, Any]) -> tuple[float, str]:
    """(largest spread, where) over every calibrated number of every loop."""
    found = [(v, f"{loop} {key} {name}") for loop, parts in spreads.items() for key, by in parts.items()
             for name, v in by.items()]
    return max(found) if found else (0.0, "nothing")


def unstable(record: dict[str, Any], loop: str, key: str, name: str) -> bool:
    """Whether the record's own rounds spread this number beyond its bound (what a refusal is for)."""
    spread = record.get("spread", {}).get(loop, {}).get(key, {}).get(name, 0.0)
    return spread > record.get("spread_bound", SPREAD_BOUND)


def agreement(a: dict[str, Any], b: dict[str, Any], bound: float = AGREEMENT_BOUND,
              stable_only: bool = False) -> list[str]:
    """The calibrated numbers on which two calibration records differ by more than `bound` (relative to their mean,
    differences under SPREAD_FLOOR_MS not counted as relative); empty when they agree. `stable_only`: compare only
    the numbers both records measured within their spread bound (forced records: the rest is what refusal is for)."""
    out = []
    for loop in sorted(a["loops"].keys() & b["loops"].keys()):  # a loop only one has (added later): not compared
        for key in ("forward_backward_ms", "step_parts_ms"):
            for name, x in a["loops"][loop][key].items():
                if stable_only and (unstable(a, loop, key, name) or unstable(b, loop, key, name)):
                    continue
                y = b["loops"][loop][key].get(name, 0.0)
                if abs(x - y) / max((x + y) / 2, SPREAD_FLOOR_MS) > bound:
                    out.append(f"{loop} {key} {name}: {x:.2f} vs {y:.2f} ms")
    return out


# name: (zenflow block, or None for plain fused AdamW; threads)
# The 1-thread loops are also the split placement's rates (docs/design.md §3: one core each side on 2 cores): the
# device's forward+backward and optimizer on one core, the host's copies, accumulation and AdamW on the other.
LOOPS = {"no_offload_2t": (None, 2), "offload_2t": ({"topk_ratio": 0.0, "update_interval": 1}, 2),
         "zenflow_r0.1_1t": ({"topk_ratio": 0.1, "update_interval": 1}, 1),
         "zenflow_r0_1t": ({"topk_ratio": 0.0, "update_interval": 1}, 1), "no_offload_1t": (None, 1)}


def measure_round(smoke: bool, seq_lens: tuple[int, ...], repeats: int) -> dict[str, dict[str, Any]]:
    """One round of every loop in this process, after a discarded warm-up round of every loop (first allocations,
    thread pools, the CPU kernels chosen for each new shape)."""
    w = Workload(**(SMOKE_SHAPE if smoke else {}))
    for block, threads in LOOPS.values():
        _training_loop(w, block, threads, seq_lens, 1)
    return {name: _training_loop(w, block, threads, seq_lens, repeats) for name, (block, threads) in LOOPS.items()}


def _round_in_child(smoke: bool, seq_lens: tuple[int, ...], repeats: int) -> dict[str, dict[str, Any]]:
    """measure_round in a fresh interpreter: a process can stay in a slow state for all its rounds (seen here:
    one point 1.7x slow in every round of one process, fast in the next process), so rounds are processes."""
    with tempfile.TemporaryDirectory(prefix="calibration-") as tmp:
        out = Path(tmp) / "round.json"
        cmd = [sys.executable, "-m", "zenflow.costmodel.calibrate", "--one-round", str(out), "--repeats",
               str(repeats), "--seqs", *map(str, seq_lens), *(["--smoke"] if smoke else [])]
        subprocess.run(cmd, check=True, timeout=3600)
        return json.loads(out.read_text())


def calibrate(seq_lens: tuple[int, ...] = CAL_SEQS, repeats: int = 5, smoke: bool = False,
              rounds: int = ROUNDS) -> dict[str, Any]:
    env = capture_environment()
    taken_at = utc_now()  # validated only against runs near it (the same clock as the runs' taken_at)
    w = Workload(**(SMOKE_SHAPE if smoke else {}))
    model = build_model(w)
    facts = model_facts(model)
    by_round: dict[str, list[dict[str, Any]]] = {name: [] for name in LOOPS}
    load_average, whole, round_load = os.getloadavg()[0], LoadWindow.start(), []
    for _ in range(rounds):  # each round every loop, so a neighbour's burst lands in one round of all, not one loop
        window = LoadWindow.start()
        for name, loop in _round_in_child(smoke, seq_lens, repeats).items():
            by_round[name].append(loop)
        round_load.append(window.stop())
    speeds = round_speeds(by_round)
    measured, spreads = {}, {}
    for name, runs in by_round.items():
        measured[name], spreads[name] = combine([at_speed(r, v) for r, v in zip(runs, speeds)])
    worst, where = largest_spread(spreads)
    contention = _contention(build_model(w), w, repeats)
    return {"schema": SCHEMA, "hardware_id": env["hardware_id"], "environment": env, "taken_at": taken_at,
            "workload": w.to_dict(), "model": facts, "element_bytes": model.lm_head.weight.element_size(),
            "column_elements": facts["column_parameters"], "calibration_seq_lens": list(seq_lens),
            "loops": measured, "contention": contention, "repeats": repeats, "rounds": rounds,
            "loops_by_round": by_round, "round_speeds": speeds, "spread": spreads, "largest_spread": worst,
            "largest_spread_at": where, "spread_bound": SPREAD_BOUND, "load_average_at_start": load_average,
            "machine_load": whole.stop(), "round_machine_load": round_load, "method": __doc__.split("\n\n")[1]}


def _contention(model: torch.nn.Module, w: Any, repeats: int) -> dict[str, float]:
    """Slow-down of forward+backward (main thread, pinned to one core) while host AdamW runs on a thread pinned to
    the other core, and of host AdamW while forward+backward runs; 1.0 = no contention. Alone and together are
    interleaved round by round and the ratio is the median of per-round ratios, so a neighbour's load on a shared
    machine hits both sides of each ratio alike."""
    torch.set_num_threads(1)
    n = 12_000_000
    host = [torch.zeros(n) for _ in range(3)]
    grad = torch.randn(n) * 1e-3
    hyper = AdamWHyper(lr=1e-5, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    ids = torch.randint(0, 32000, (1, 32))
    cores = sorted(os.sched_getaffinity(0))
    run, stop, adam_times = threading.Event(), threading.Event(), []

    def fwd_bwd() -> float:
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
        return (time.perf_counter() - start) * 1e3

    def worker() -> None:
        if len(cores) > 1:
            os.sched_setaffinity(0, {cores[-1]})
        torch.set_num_threads(1)
        while not stop.is_set():
            if not run.wait(0.01):
                continue
            start = time.perf_counter()
            adamw_([host[0]], [grad], [host[1]], [host[2]], [1], hyper)
            adam_times.append(((time.perf_counter() - start) * 1e3, busy_main[0]))
    busy_main = [False]
    saved = set(cores)
    if len(cores) > 1:
        os.sched_setaffinity(0, {cores[0]})
    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    fb_alone, fb_busy = [], []
    try:
        fwd_bwd()
        for _ in range(repeats + 1):
            fb_alone.append(fwd_bwd())          # worker idle
            run.set()
            time.sleep(0.05)                    # worker alone (main thread sleeping)
            busy_main[0] = True
            fb_busy.append(fwd_bwd())           # both busy
            busy_main[0] = False
            time.sleep(0.05)
            run.clear()
    finally:
        stop.set()
        thread.join()
        os.sched_setaffinity(0, saved)
    adam_alone = [t for t, busy in adam_times if not busy] or [t for t, _ in adam_times]
    adam_busy = [t for t, busy in adam_times if busy] or adam_alone
    fb_ratio = statistics.median(b / a for a, b in zip(fb_alone, fb_busy))
    return {"fb_alone_ms": statistics.median(fb_alone), "fb_with_host_adamw_ms": statistics.median(fb_busy),
            "compute_slowdown": max(1.0, fb_ratio), "adamw_alone_ms": statistics.median(adam_alone),
            "adamw_with_fb_ms": statistics.median(adam_busy),
            "host_slowdown": max(1.0, statistics.median(adam_busy) / statistics.median(adam_alone)),
            "adamw_elements": n}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Calibrate the cost model on this machine (≈1 minute).")
    ap.add_argument("--out", type=Path, default=None, help="default: results/costmodel/<hardware-id>/calibration.json")
    ap.add_argument("--repeats", type=int_at_least(1), default=5)
    ap.add_argument("--rounds", type=int_at_least(1), default=ROUNDS,
                    help="rounds, each a fresh process; each number is their median")
    ap.add_argument("--force", action="store_true", help=f"keep a calibration whose spread exceeds {SPREAD_BOUND}")
    ap.add_argument("--smoke", action="store_true", help="a tiny model (tests only; not a calibration)")
    ap.add_argument("--wait-quiet", type=float, default=180, help="wait up to this many seconds until no other "
                    "heavy job (training run, benchmark, compiler) runs on this machine")
    ap.add_argument("--compare", type=_calibration_record, nargs=2, metavar=("A", "B"), default=None,
                    help=f"compare two calibration records: the numbers differing by more than "
                    f"{100 * AGREEMENT_BOUND:.0f}%%")
    ap.add_argument("--seqs", type=int, nargs="+", default=list(CAL_SEQS), help=argparse.SUPPRESS)
    ap.add_argument("--one-round", type=Path, default=None, help=argparse.SUPPRESS)  # a round's child process
    args = ap.parse_args(argv)
    if args.compare:
        differ = agreement(*args.compare)
        print("\n".join(differ) if differ else f"agree within {AGREEMENT_BOUND:.0%} on every calibrated number")
        return 1 if differ else 0
    if args.one_round:
        write_text_atomic(args.one_round, json.dumps(measure_round(args.smoke, tuple(args.seqs), args.repeats)))
        return 0
    wait_until_quiet(args.wait_quiet)
    out = args.out or ROOT / "results" / "costmodel" / capture_environment()["hardware_id"] / "calibration.json"
    with NeighbourWatch() as watch:
        record = calibrate(tuple(args.seqs), repeats=args.repeats, smoke=args.smoke, rounds=args.rounds)
    record["neighbour_busy_fraction"] = watch.busy_fraction
    return keep_or_refuse(record, out, args.force)


def _calibration_record(value: str) -> dict[str, Any]:
    """A `type=` for --compare: a calibration record of any machine, or one line saying what is wrong with it."""
    try:
        return load_calibration(value, expect_hardware_id=None)
    except CostModelError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def keep_or_refuse(record: dict[str, Any], out: Path, force: bool = False) -> int:
    """Write the record to `out` (0), or, when its largest spread exceeds its bound and not `force`, to
    `calibration.refused.json` beside it, leaving `out` as it was (1)."""
    refused = record["largest_spread"] > record["spread_bound"] and not force
    path = out.with_name("calibration.refused.json") if refused else out
    write_text_atomic(path, json.dumps(record, indent=1, default=str) + "\n")  # never a half-written record
    if refused:
        print(f"calibration refused: spread {record['largest_spread']:.1%} at {record['largest_spread_at']} over "
              f"{record['rounds']} rounds exceeds {record['spread_bound']:.0%}; {conditions(record)}; {out} is "
              f"kept, this one is {path}. {_advice(record)}", file=sys.stderr)
        return 1
    print(f"wrote {out} (largest spread over {record['rounds']} rounds: {record['largest_spread']:.1%}; "
          f"{conditions(record)})")
    return 0


def conditions(record: dict[str, Any]) -> str:
    """What was measured while the calibration ran, in one clause: the drift, the load average, the kernel's
    counters of other processes and of the hypervisor's steal."""
    parts = []
    if record.get("round_speeds"):
        low, high = min(record["round_speeds"]), max(record["round_speeds"])
        parts.append(f"round speeds {low:.2f}-{high:.2f}x the median round (factored out)")
    if "load_average_at_start" in record:
        parts.append(f"load average {record['load_average_at_start']:.2f} at the start")
    load = record.get("machine_load") or {}
    if load.get("measured"):
        parts.append(f"other processes {load['outside_cpu_fraction']:.0%} and hypervisor steal "
                     f"{load['steal_fraction']:.0%} of the machine")
    return ", ".join(parts) or "no machine load measured"


def _advice(record: dict[str, Any]) -> str:
    """What to do, from what was measured (never a guess)."""
    if busy(record.get("machine_load")):
        return "The machine was busy: rerun when it is quiet, or --force."
    return ("The machine was quiet and its drift is factored out: the number itself varies between processes; "
            "rerun, or --force.")


if __name__ == "__main__":
    sys.exit(main())
