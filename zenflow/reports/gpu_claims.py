"""The GPU sets beside the claims table of results/README.md: one row per GPU result set of the Llama-2-7B
layer scenario (reproduce/gpu_window.py --publish files them under results/llama7b/<gpu hardware-id>/llama2-7b-<L>L/),
never mixed with the cpu-scale numbers above them. Every number is read from the set's table.csv, ratios.csv and
the window's facts; with no GPU set committed, one line says so and names the command that makes one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from zenflow.harness.deadline import OUT_OF_TIME
from zenflow.harness.tables import compact_markdown, read_csv
from zenflow.reports.intervals import ratio_cell, row_interval

HEADERS = ("GPU set", "ref-zenflow over DeepSpeed ZeRO-Offload", "DeepSpeed's ZenFlow over ZeRO-Offload",
           "ref-zenflow over ref-offload", "stall: ref-zenflow vs ref-offload", "bytes per step ÷ model bytes: "
           "ref-zenflow, ref-offload", "engines run / cut for time", "when, commit")
COMMAND = ("`ZENFLOW_GIT_COMMIT=<sha> python3 reproduce/gpu_window.py --out $OUT` on the GPU host, then "
           "`python reproduce/gpu_window.py --publish gpu-evidence.tar.gz` here "
           "([docs/gpu-window.md](../docs/gpu-window.md))")


def gpu_sets(root: Path) -> list[Path]:
    """The committed GPU sets of the scenario: a hardware id that is not cpu-scale, a table made from records."""
    return sorted(p.parent for p in root.glob("llama7b/*/llama2-7b-*L/table.csv")
                  if not p.parent.parent.name.startswith("cpu-scale"))


def _window(folder: Path, root: Path) -> dict[str, Any]:
    """The window's facts and phases, filed by --publish beside the gpu-check record of the same hardware."""
    window = root / "gpu-check" / folder.parent.name / "window"
    facts = json.loads((window / "facts.json").read_text()) if (window / "facts.json").is_file() else {}
    phases = json.loads((window / "phases.json").read_text()) if (window / "phases.json").is_file() else []
    return {"facts": facts, "phases": phases}


def gpu_row(folder: Path, root: Path) -> list[str]:
    rows = {r["engine"]: r for r in read_csv(folder / "table.csv")}
    ratios = {(r["numerator"], r["denominator"]): r["cell"] for r in read_csv(folder / "ratios.csv")} \
        if (folder / "ratios.csv").is_file() else {}

    def speedup(engine: str) -> str:
        row = rows.get(engine)
        return ratio_cell(row_interval(row, "speedup")) if row and row.get("runs") else "not run"

    zf, off = rows.get("ref-zenflow", {}), rows.get("ref-offload", {})
    stall = f"−{zf['stall_reduction'] * 100:.0f}%" if zf.get("stall_reduction") is not None else "—"
    measured = lambda r: f"{r['bytes_ratio']:.3f}×" if r.get("bytes_ratio") else "—"  # noqa: E731
    ran = sum(1 for r in rows.values() if r.get("runs"))
    cut = sum(OUT_OF_TIME in str(r.get("note") or "") for r in rows.values())  # deadline skips (deadline.py)
    window = _window(folder, root)
    facts = window["facts"]
    when = f"{facts.get('day', '?')}, {(facts.get('commit') or '?')[:10]}, {facts.get('layers', '?')} layers"
    link = f"[{folder.parent.name}: {folder.name}]({folder.relative_to(root).as_posix()}/table.md)"
    return [link, speedup("ref-zenflow"), speedup("ds-zenflow"),
            ratios.get(("ref-offload", "ref-zenflow"), "—"), stall, f"{measured(zf)}, {measured(off)}",
            f"{ran} / {cut}", when]


def gpu_section(root: Path) -> str:
    """The GPU table (or the line saying there is none yet), for the generated block of results/README.md."""
    sets = gpu_sets(root)
    head = "**On a GPU** (Llama-2-7B layer shapes, one command of ≤ 10 min; never mixed with the cpu-scale rows above):"
    if not sets:
        return f"{head} no GPU set committed yet. Make one with {COMMAND}."
    return "\n".join([head, "", compact_markdown([gpu_row(folder, root) for folder in sets], HEADERS), "",
                      f"Rerun: {COMMAND}."])
