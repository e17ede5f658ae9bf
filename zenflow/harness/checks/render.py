"""gpu-check's table and figure, drawn from its record alone (the command's, or a committed one: publish and the
committed-table test remake them byte for byte), with the helpers every report shares (harness/tables.py).

The page is the environment, the checks' verdicts, then each check's own section in the order of the checks
(`page`, given the renderers of checks/gpu.py's CHECKS rows); a section renderer takes the record and returns its
lines, none when the record has nothing for it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from zenflow.harness.checks.differential import ATOL, RTOL
from zenflow.harness.tables import fmt, markdown, pyplot, save_figure

Section = Callable[[dict[str, Any]], list[str]]
FIGURE_DPI = 120  # the committed figures' resolution (tests/reproduce/test_gpu_window.py reads the width)


def _check(record: dict[str, Any], name: str) -> dict[str, Any]:
    return next((c for c in record["checks"] if c["name"] == name), {})


# ---- the page ---------------------------------------------------------------------------------------------------
def page(record: dict[str, Any], sections: Sequence[tuple[str, Section | None]]) -> str:
    """The record as Markdown: the head, then each (check name, section) in order; the negative controls' table
    follows the section of the last check that has controls (the correctness checks, before the engine runs)."""
    with_controls = [c["name"] for c in record["checks"] if c.get("controls")]
    out = head(record)
    for name, section in sections:
        out += section(record) if section else []
        if with_controls and name == with_controls[-1]:
            out += controls_section(record["checks"])
    return "\n".join(out) + "\n"


def head(record: dict[str, Any]) -> list[str]:
    """The host and its GPUs, whether the record is complete, and one verdict per check."""
    env = record["environment"]
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
    return out + ["", markdown([[x["name"], x["status"], *([fmt(x.get("seconds"))] if timed else []), x["reason"] or ""]
                                for x in record["checks"]], ["check", "status", *(["seconds"] if timed else []),
                                                             "reason"])]


def counters(support: dict[str, str | None] | None) -> str:
    """NVML's PCIe byte counter support as words: None per field means it answered."""
    if not support:
        return "not read"
    if all(v is None for v in support.values()):
        return "answered"
    return ", ".join(f"{k} refused ({v})" if v else f"{k} answers" for k, v in support.items())


# ---- one section per check --------------------------------------------------------------------------------------
def differential_section(record: dict[str, Any]) -> list[str]:
    """Records before gpu-check/2 had one maximum per case; later ones split it by kind and say what ran."""
    rows = record["differential"]
    if not rows:
        return []
    tolerance = lambda r: f"rtol {r['rtol']:g}, atol {r['atol']:g}"  # noqa: E731
    if not any("by_kind" in r for r in rows):
        table = markdown([[r["case"], r["devices"], r["steps"], fmt(r["max_abs"], ".2e"), fmt(r["max_ratio"], ".2e"),
                           r["elements_outside"], tolerance(r)] for r in rows],
                         ["case", "devices", "steps", "max abs diff", "diff / allowed (max)", "outside", "tolerance"])
        return ["", "## Differential", "", table]
    kind = lambda r, k: fmt((r.get("by_kind", {}).get(k) or {}).get("max_ratio"), ".2e")  # noqa: E731
    table = markdown([[r["case"], r["devices"], r["steps"], fmt(r["max_abs"], ".2e"), kind(r, "column"),
                       kind(r, "dense"), kind(r, "losses"), r["elements_outside"], _pair(r.get("host_updates")),
                       _pair(r.get("columns_moved")), tolerance(r)] for r in rows],
                     ["case", "devices", "steps", "max abs diff", "diff / allowed: column params", "dense params",
                      "losses", "outside", "host updates", "columns moved", "tolerance"])
    return ["", "## Differential", "", table]


def _pair(values: list[int] | None) -> str:
    """One number when both devices agree, "a / b" when they do not."""
    return "—" if not values else str(values[0]) if len(set(values)) == 1 else " / ".join(map(str, values))


def memory_section(record: dict[str, Any]) -> list[str]:
    m = _check(record, "memory")
    if "extra_bytes" not in m:
        return []
    mib = lambda key: fmt(m[key] / 2**20)  # noqa: E731
    title = ["", "## Device memory (overlap vs sync)", ""]
    if "control_extra_bytes" not in m:
        return title + [markdown([[mib("sync_peak_bytes"), mib("overlap_peak_bytes"), mib("extra_bytes"),
                                   mib("bound_bytes"), m["status"]]],
                                 ["sync peak MiB", "overlap peak MiB", "extra MiB", "bound MiB", "status"])]
    return title + [
        f"Peak `{m.get('metric')}` above the start of a window of {m.get('steps')} steps between reselections, "
        "copies slowed by a spin on the d2h stream; bound: two sets of the unselected gradient columns "
        "(docs/gpu-check.md).", "",
        markdown([[mib("sync_peak_bytes"), mib("overlap_peak_bytes"), mib("extra_bytes"), mib("bound_bytes"),
                   mib("control_extra_bytes"), m["status"]]],
                 ["sync peak MiB", "overlap peak MiB", "extra MiB", "bound MiB", "without backpressure: extra MiB",
                  "status"])]


def pcie_section(record: dict[str, Any]) -> list[str]:
    p = _check(record, "pcie")
    return pcie_table(p) if "directions" in p or "windows" in p else []


def pcie_table(p: dict[str, Any]) -> list[str]:
    """Per window and direction; an NVML total a 32-bit counter could have wrapped under is marked."""
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
                           f"{fmt(w.get('counter_max_gap_s'), '.3f')} s")
        rows += [[name, d, r["ours"], fmt(r["nvml"], "d") + (mark if r["nvml"] is not None else ""),
                  fmt(r.get("predicted"), ".0f"),
                  fmt(r["nvml"] / r["ours"] if r["nvml"] is not None and r["ours"] else None, ".3f"),
                  fmt(r.get("overhead"), ".3f"), fmt(r["idle_nvml"], "d"), r["status"]]
                 for d, r in w["directions"].items()]
    out = ["", "## PCIe bytes (NVML vs the optimizer)", "",
           "NVML counts packet headers and read requests too; plain copies of known size measure that overhead "
           "first (bytes per payload byte), and our bytes through it predict each counter "
           f"(tolerance ±{p.get('tolerance', 0) * 100:.0f}%).", "",
           markdown(rows, ["window", "direction", "ours", "NVML", "predicted", "NVML / ours", "copy overhead",
                           "NVML idle", "status"])]
    if wrapped:
        out += ["", "† a counter of this width could have wrapped unseen between two reads at this link's speed "
                f"({'; '.join(wrapped)}): the total may be short by a multiple of its range."]
    return out


def controls_section(checks: list[dict[str, Any]]) -> list[str]:
    rows = [[c["name"], x["control"], x["outcome"], x["detail"]] for c in checks for x in c.get("controls") or []]
    if not rows:
        return []
    return ["", "## Negative controls (each must fail)", "", markdown(rows, ["check", "control", "outcome", "detail"])]


def engines_section(record: dict[str, Any]) -> list[str]:
    """Always there, empty when no engine ran (the window's records)."""
    return ["", "## Engines", "",
            markdown([[r["engine"], r["shape"], r["status"], fmt(r.get("cycle_mean_ms")), fmt(r.get("compute_ms")),
                       "(in stall)" if r.get("stall_includes_io") else fmt(r.get("io_ms")), fmt(r.get("stall_ms")),
                       " ".join(r.get("error") or []) if r["status"] != "ok" else ""] for r in record["engines"]],
                     ["engine", "shape", "status", "step ms", "compute ms", "I/O ms", "stall ms", "note"])]


# ---- the figure -------------------------------------------------------------------------------------------------
def figure(record: dict[str, Any], path: Path) -> Path:
    """Left: compute / I/O / stall per engine. Right: the differential's worst difference per case vs the
    tolerance, per kind (column params, dense params, losses) where the record has them. Without engine runs
    (the GPU window runs no engines check) the differential alone, not an empty panel."""
    plt = pyplot()
    ok = [r for r in record["engines"] if r["status"] == "ok" and r.get("cycle_mean_ms")]
    if ok:
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
        engines_panel(left, ok, next((c.get("scale") for c in record["checks"] if c["name"] == "engines"), "?"))
    else:
        fig, right = plt.subplots(figsize=(7, 4.2))
    differential_panel(right, record["differential"])
    fig.suptitle(f"gpu-check — {record['environment']['hardware_id']}{'' if ok else ' (no engine runs)'}",
                 fontsize=11)
    return save_figure(fig, path, dpi=FIGURE_DPI)


def engines_panel(ax: Any, ok: list[dict[str, Any]], scale: str) -> None:
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


def differential_panel(ax: Any, diff: list[dict[str, Any]]) -> None:
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
