"""Scaling across ranks, from run records only: step time and bytes per rank of every engine at each world size
(reproduce/scaling.py), and the bytes a selection exchanges between ranks (measured and computed)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from zenflow.costmodel.model import selection_exchange_bytes
from zenflow.costmodel.presets import model_columns, model_counts
from zenflow.harness.records import RunRecord
from zenflow.harness.tables import fmt, markdown, pyplot, save_figure, write_text_atomic
from zenflow.reports.scenario import check_one_placement, engine_rank, run_world_size, runs_hardware_label

LINK_KEYS = ("_grads", "_params")  # device<->host bytes (PCIe on a GPU), per rank


def scaling_rows(records: list[RunRecord]) -> list[dict[str, Any]]:
    """One row per (engine, world size): medians over runs (with telemetry) of step time and bytes per rank."""
    ok = [r for r in records if r.status == "ok" and r.protocol.get("telemetry", True)]
    rows = []
    for engine, world in sorted({(r.engine, run_world_size(r)) for r in ok}, key=lambda k: (engine_rank(k[0]), k[1])):
        runs = [r for r in ok if r.engine == engine and run_world_size(r) == world]
        cycle = statistics.median(r.summary["cycle_mean_ms"] for r in runs)
        per_step = [r.summary.get("bytes_per_step") or {} for r in runs]
        link = [sum(v for k, v in b.items() if k.endswith(LINK_KEYS)) for b in per_step if b]
        net = [sum(v for k, v in b.items() if k.startswith("net_")) for b in per_step if b]
        host = [r.metrics["host_state_bytes"] for r in runs if r.metrics.get("host_state_bytes") is not None]
        micro = runs[0].workload.get("micro_batch", 1)
        rows.append({"engine": engine, "world_size": world, "runs": len(runs), "cycle_mean_ms": cycle,
                     "samples_per_s": 1000 * world * micro / cycle,
                     "link_bytes_per_step_per_rank": statistics.median(link) if link else None,
                     "net_bytes_per_step_per_rank": statistics.median(net) if net else None,
                     "host_state_bytes_per_rank": statistics.median(host) if host else None})
    base = {r["engine"]: r for r in rows if r["world_size"] == 1}
    for r in rows:
        one = base.get(r["engine"])
        r["throughput_vs_w1"] = r["samples_per_s"] / one["samples_per_s"] if one else None
        r["step_time_vs_w1"] = r["cycle_mean_ms"] / one["cycle_mean_ms"] if one else None
        r["host_state_vs_w1"] = (r["host_state_bytes_per_rank"] / one["host_state_bytes_per_rank"]
                                 if one and one["host_state_bytes_per_rank"] and r["host_state_bytes_per_rank"]
                                 else None)
    return rows


def selection_rows(records: list[RunRecord]) -> list[dict[str, Any]]:
    """Bytes a rank contributes to one selection: column norms (ours) vs the gradients an all-gather would send.
    cpu-scale: counted by our counters at the run's first step (its selection), from a W > 1 ref-zenflow record;
    Llama-2-7B: computed (zenflow/costmodel/model.py: selection_exchange_bytes)."""
    rows = []
    counted = [r for r in records if r.status == "ok" and r.engine == "ref-zenflow" and run_world_size(r) > 1
               and r.protocol.get("telemetry", True)]  # runs without telemetry count no bytes
    if counted:
        r = counted[0]
        norms = (r.steps[0].get("bytes") or {}).get("net_column_norms")
        if norms:
            rows.append({"model": f"cpu-scale ({r.model['column_parameters'] / 1e6:.1f}M column params)",
                         "how": "counted (our counters, first step)", "norm_bytes": norms,
                         "gradient_bytes": r.model["model_bytes"], "ratio": r.model["model_bytes"] / norms})
    for name, label in (("llama2-7b", "Llama-2-7B"), ("llama2-13b", "Llama-2-13B")):
        x = selection_exchange_bytes(model_columns(name), model_counts(name)["column"])
        rows.append({"model": label, "how": "computed", **x})
    return rows


def _mb(v: float | None) -> str:
    return fmt(None if v is None else v / 1e6, ".2f")


def _x(v: float | None) -> str:
    return fmt(v, ".2f", suffix="×")


def scaling_report(records: list[RunRecord], out: Path, env: dict[str, Any]) -> str:
    check_one_placement(records)
    rows, sel = scaling_rows(records), selection_rows(records)
    label = runs_hardware_label(records, env)
    body = [[r["engine"], r["world_size"], r["runs"], f"{r['cycle_mean_ms']:.1f}", f"{r['samples_per_s']:.2f}",
             _x(r["throughput_vs_w1"]), _mb(r["link_bytes_per_step_per_rank"]), _mb(r["net_bytes_per_step_per_rank"]),
             _mb(r["host_state_bytes_per_rank"]), _x(r["host_state_vs_w1"])] for r in rows]
    heads = ["engine", "ranks", "runs", "step ms (cycle mean)", "samples/s", "throughput vs 1 rank",
             "device↔host MB/step per rank", "between ranks MB/step per rank", "host state MB per rank",
             "host state vs 1 rank"]
    sel_body = [[s["model"], s["how"], f"{s['norm_bytes'] / 1e6:.3f}", f"{s['gradient_bytes'] / 1e6:.1f}",
                 f"{s['ratio']:,.0f}×"] for s in sel]
    text = "\n".join([
        f"# Scaling across ranks — {label}", "",
        "Every engine at each world size, each rank on its own shard of every batch with the same micro-batch per "
        "rank (so samples/s, not step time, is the comparable rate). Medians of the runs; step times are means over "
        "whole update cycles. On one CPU host the ranks share the machine (each its share of the cores, gloo between "
        "them): this measures the exchange's cost and correctness, not a multi-GPU speedup.", "",
        markdown(body, heads), "",
        "## Bytes a rank sends to agree on one selection", "",
        markdown(sel_body, ["model", "how", "column norms MB (fp32)", "gradients MB (bf16 all-gather)", "ratio"]), "",
        "The paper: \"reducing communication volume by over 4,000×\". Ours sends one fp32 norm per column, so the "
        "ratio is about a weight's rows / 2 (bf16 gradient vs fp32 norm): "
        + "; ".join(f"{s['model']} {s['ratio']:,.0f}×" for s in sel if s["how"] == "computed")
        + "; norms sent in bf16 would double it."])
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "table.md", text + "\n")
    figure(rows, out / "figure.png", label)
    print(text)
    return text


def figure(rows: list[dict[str, Any]], path: Path, label: str) -> None:
    """Throughput and bytes between ranks per engine, one bar per world size."""
    plt = pyplot()
    engines = sorted({r["engine"] for r in rows}, key=engine_rank)
    worlds = sorted({r["world_size"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / len(worlds)
    for i, w in enumerate(worlds):
        index = {r["engine"]: r for r in rows if r["world_size"] == w}
        xs = [j + i * width for j in range(len(engines))]
        axes[0].bar(xs, [index[e]["samples_per_s"] if e in index else 0 for e in engines], width,
                    label=f"{w} rank{'s' if w > 1 else ''}")
        axes[1].bar(xs, [(index[e]["net_bytes_per_step_per_rank"] or 0) / 1e6 if e in index else 0
                         for e in engines], width, label=f"{w} rank{'s' if w > 1 else ''}")
    for ax, title in zip(axes, ("throughput (samples/s, higher is better)",
                                "bytes between ranks per step per rank (MB; our counters, ours only)")):
        ax.set_xticks([j + width * (len(worlds) - 1) / 2 for j in range(len(engines))], engines, fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8, frameon=False)
    fig.suptitle(f"Scaling across ranks — {label}", fontsize=10)
    save_figure(fig, path)
