"""The Llama scenario's figure.png: the paper's Figure 1 comparison, readable at 1200 px.

Panel 1 holds the engines of the paper's comparison (PAPER_ENGINES, those that ran): one horizontal bar per engine,
its step time split into compute / exposed I/O / stall, labelled with its speedup over ds-zero-offload and the 95%
interval of that speedup. Panel 2 holds every other engine that ran (controls, peers, variants) on its own scale, so
that one slow peer cannot squash the comparison; a bar far longer than the rest of its panel is cut at the axis and
says so. An engine with no ok run (skipped, not installed, failed) is not drawn: the caption names it and why.

`headline_figure` returns what it drew (`Drawn`), so that tests read the figure without reading its pixels.
"""

from __future__ import annotations

import statistics
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zenflow.harness.configs import PAPER_ENGINES
from zenflow.harness.deadline import OUT_OF_TIME
from zenflow.harness.engines.registry import ENGINE_SPECS, engine_names
from zenflow.harness.memory_plan import NEEDS
from zenflow.harness.records import RunRecord, skip_reason
from zenflow.harness.tables import FIGURE_DPI, pyplot, save_figure
from zenflow.harness.when import runs_day
from zenflow.reports.intervals import ratio_cell, row_interval
from zenflow.telemetry.machine_load import busy as machine_busy

BASELINE = "ds-zero-offload"  # every engine's speedup is this engine's step time over its own
WIDTH_IN = 9.2  # 1196 px at FIGURE_DPI 130: the whole figure fits a 1200 px page unscaled
FONT = 9  # pt, the smallest text drawn
BAR_IN, PANEL_IN = 0.34, 0.85  # inches per bar, and per panel for its title, ticks and axis label
CUT = 2.5  # the panel's reach: its longest bar within CUT × its median bar; a bar longer than CUT_AT × that reach
CUT_AT = 1.3  # is cut at the axis (drawn to CUT_AT × the longest bar not cut)
CAPTION_CHARS, TITLE_CHARS = 135, 100  # characters per line across WIDTH_IN: the caption's at FONT pt, the title's
# How a CUDA-only engine's skip reason ends (engines/peers.py, engines/optimizer_peers.py: `unavailable`).
CPU_DEVICE = "this run's device is the CPU"
SEGMENTS = {  # kind -> (colour, hatch, legend)
    "compute": ("#4C72B0", None, "compute (fwd + bwd + device update)"),
    "io": ("#DD8452", None, "exposed I/O"),
    "stall": ("#C44E52", None, "stall (waiting for the host optimizer)"),
    "stall_io": ("#C44E52", "///", "stall incl. I/O (not separable: DeepSpeed, PyTorch)"),
    "unsplit": ("0.65", None, "step (not split)"),
}
TAGS = {"control": "control", "peer": "peer", "beyond": "beyond the paper"}  # registry group -> tick suffix


@dataclass
class Bar:
    """One drawn bar: its tick, its segments in drawing order (kind, ms), its step time and label."""

    engine: str
    tick: str
    segments: list[tuple[str, float]]
    step_ms: float
    label: str
    cut: bool = False

    @property
    def total(self) -> float:
        return sum(ms for _, ms in self.segments)


@dataclass
class Drawn:
    """What headline_figure drew: its panels' bars (panel 2 empty when no other engine ran), the engines it names as
    not run (engine -> why), its title and caption lines, and its size in pixels."""

    panels: list[list[Bar]]
    not_run: dict[str, str]
    title: str
    caption: list[str]
    size_px: tuple[int, int] = (0, 0)
    legend: list[str] = field(default_factory=list)

    def engines(self, panel: int) -> list[str]:
        """The engines of panel `panel` (1 or 2), top to bottom."""
        return [bar.engine for bar in self.panels[panel - 1]]


def why_not_run(record: RunRecord) -> str:
    """A few words for the caption: why this record has no step time."""
    if record.status != "skipped":
        return record.status  # "failed" (its record holds the error)
    error = skip_reason(record.error)
    if "not installed" in error:
        return "not installed"
    if error.startswith(NEEDS):
        return "does not fit this host"
    if error.startswith(OUT_OF_TIME):
        return "out of time"
    return "needs CUDA" if CPU_DEVICE in error else "skipped"


def not_run(records: Sequence[RunRecord]) -> dict[str, str]:
    """Engines without one ok run, in table order, each with why (its first record that says)."""
    ran = {r.engine for r in records if r.status == "ok"}
    names = engine_names()
    out: dict[str, str] = {}
    for r in sorted(records, key=lambda r: (names.index(r.engine) if r.engine in names else len(names), r.engine)):
        if r.engine not in ran and r.engine not in out:
            out[r.engine] = why_not_run(r)
    return out


def busy_engines(records: Sequence[RunRecord]) -> set[str]:
    """Engines with a run on a busy machine (machine_load.py): their bars say they are not comparable."""
    return {r.engine for r in records if r.status == "ok" and (load := r.protocol.get("machine_load"))
            and load.get("measured") and machine_busy(load)}


def speedup_label(row: dict[str, Any]) -> str:
    """The speedup over BASELINE with its 95% interval, as the table writes it (intervals.ratio_cell)."""
    return "baseline" if row["engine"] == BASELINE else ratio_cell(row_interval(row, "speedup"))


def make_bar(row: dict[str, Any], busy: set[str], paper: bool) -> Bar:
    """A measured row as a bar: compute / I/O / stall (stall incl. I/O where the engine cannot be split)."""
    if row["compute_ms"] is None:
        segments = [("unsplit", row["cycle_mean_ms"])]
    elif row["stall_includes_io"]:
        segments = [("compute", row["compute_ms"]), ("stall_io", row["stall_ms"] or 0.0)]
    else:
        segments = [("compute", row["compute_ms"]), ("io", row["io_ms"] or 0.0), ("stall", row["stall_ms"] or 0.0)]
    notes = [f"{row['cycle_mean_ms']:.0f} ms", speedup_label(row)]
    if (reduction := row.get("stall_reduction")) is not None:  # negative where the stall grew
        notes.append(f"stall {'−' if reduction >= 0 else '+'}{abs(100 * reduction):.0f}%")
    if row["engine"] in busy:
        notes.append("busy machine: not comparable")
    return Bar(row["engine"], tick(row["engine"], paper), segments, row["cycle_mean_ms"], " · ".join(notes))


def tick(engine: str, paper: bool) -> str:
    """The engine's name, with its role where the name does not say it."""
    spec = ENGINE_SPECS.get(engine)
    if spec is None:  # an engine of a newer registry than this one (ds-zenflow-intended while it is being added)
        return engine
    tag = "bound" if spec.family == "bound" else "" if paper else TAGS.get(spec.group, "")
    return f"{engine} ({tag})" if tag else engine


def cut_long(bars: list[Bar]) -> None:
    """Mark as cut the bars longer than CUT_AT × the panel's reach, the longest bar within CUT × the median: a bar far
    longer than the rest of its panel, not merely longer than CUT × its median."""
    if len(bars) < 3:  # no median to be far from
        return
    median = statistics.median(b.total for b in bars)
    reach = max(b.total for b in bars if b.total <= CUT * median)
    for b in bars:
        if b.total > CUT_AT * reach:
            b.cut, b.label = True, f"bar cut, {b.label}"


def draw_panel(ax: Any, bars: list[Bar], title: str, cut_at: float | None) -> list[Any]:
    """Horizontal stacked bars, top to bottom, each cumulatively clipped at `cut_at`; their label texts."""
    texts = []
    for y, bar in enumerate(bars):
        left = 0.0
        for kind, ms in bar.segments:
            width = max(0.0, min(ms, (cut_at or float("inf")) - left))
            color, hatch, _ = SEGMENTS[kind]
            ax.barh(y, width, left=left, height=0.7, color=color, hatch=hatch, edgecolor="white", linewidth=0)
            left += width
        end = left
        if bar.cut:  # a break mark where the bar stops
            ax.plot([end, end], [y - 0.42, y + 0.42], color="black", linewidth=1.2)
        text = ax.text(end, y, "  " + bar.label, va="center", ha="left", fontsize=FONT)
        text.set_in_layout(False)  # fit_labels widens the axis to hold it; the layout must not shrink the axis for it
        texts.append(text)
    ax.set_yticks(range(len(bars)), [b.tick for b in bars], fontsize=FONT)
    ax.set_ylim(len(bars) - 0.5, -0.5)  # the first bar on top
    ax.tick_params(axis="x", labelsize=FONT)
    ax.set_title(title, fontsize=FONT + 1, loc="left")
    ax.spines[["top", "right"]].set_visible(False)
    return texts


def fit_labels(fig: Any, ax: Any, texts: list[Any]) -> None:
    """Widen the x axis until every label ends inside it: a label starts at its bar's end (data) and is a fixed
    number of pixels wide, so the axis must reach end / (1 - label width / axis width)."""
    renderer = fig.canvas.get_renderer()
    axis_px = ax.get_window_extent(renderer).width
    need = 0.0
    for text in texts:
        share = min(text.get_window_extent(renderer).width / axis_px, 0.9)
        need = max(need, text.get_position()[0] / (1 - share))
    ax.set_xlim(0, 1.02 * need)


def caption_lines(gone: dict[str, str], runs: set[int]) -> list[str]:
    """How to read the labels, and the engines not drawn with why, wrapped to the figure's width."""
    n = f"median of {runs.pop()} runs" if len(runs) == 1 else "median of each engine's runs"
    lines = [f"Step time: mean over whole update cycles, {n}. Label: step time · speedup over {BASELINE} "
             "(paired by repeat) [95% interval]; \"no difference\" where the interval includes 1."]
    if gone:
        lines.append("not run here: " + ", ".join(f"{engine} ({why})" for engine, why in gone.items()))
    return wrapped(lines, CAPTION_CHARS)


def wrapped(lines: list[str], width: int) -> list[str]:
    """`lines` wrapped at `width` characters, engine names kept whole."""
    return [part for line in lines for part in textwrap.wrap(line, width, break_on_hyphens=False)]


def describe(rows: list[dict[str, Any]], records: Sequence[RunRecord], title: str, subtitle: str,
             folder: Path = Path(".")) -> Drawn:
    """What the figure of `rows` (scenario.engine_rows of `records`) shows, before drawing it. Refuses rows with no
    measured engine, naming the engines it was given."""
    measured = [r for r in rows if r.get("cycle_mean_ms")]
    if not measured:
        raise ValueError(f"headline figure: no engine with a measured step time among {[r['engine'] for r in rows]}: "
                         "expected at least one row with cycle_mean_ms")
    busy = busy_engines(records)
    panel1 = [make_bar(r, busy, True) for e in PAPER_ENGINES for r in measured if r["engine"] == e]
    panel2 = [make_bar(r, busy, False) for r in measured if r["engine"] not in PAPER_ENGINES]
    for bars in (panel1, panel2):
        cut_long(bars)
    kinds = {kind for bar in panel1 + panel2 for kind, _ in bar.segments}
    gone = not_run(records)
    heading = wrapped([title, subtitle, f"runs of {runs_day(records, folder)}"], TITLE_CHARS)  # hardware: subtitle
    return Drawn([panel1, panel2], gone, "\n".join(heading),
                 caption_lines(gone, {r["runs"] for r in measured}), legend=[k for k in SEGMENTS if k in kinds])


def draw_legend(ax: Any, kinds: list[str]) -> None:
    """The segments' legend in an axis of its own above the panels: it covers no bar."""
    ax.axis("off")
    handles = [pyplot().Rectangle((0, 0), 1, 1, facecolor=SEGMENTS[k][0], hatch=SEGMENTS[k][1], edgecolor="white")
               for k in kinds]
    ax.legend(handles, [SEGMENTS[k][2] for k in kinds], loc="center", ncol=min(2, len(kinds)), fontsize=FONT,
              frameon=False)


def headline_figure(rows: list[dict[str, Any]], records: Sequence[RunRecord], path: Path, title: str,
                    subtitle: str) -> Drawn:
    """Draw `rows` (scenario.engine_rows of `records`) into `path` at WIDTH_IN; what was drawn (`describe`)."""
    drawn = describe(rows, records, title, subtitle, path.parent)
    titles = [f"The paper's comparison: step time split, speedup over {BASELINE} [95% interval]",
              "Controls, peers and variants (their own scale)"]
    panels = [(bars, name) for bars, name in zip(drawn.panels, titles) if bars]
    heights = [0.22 * ((len(drawn.legend) + 1) // 2) + 0.1] + [BAR_IN * len(bars) + PANEL_IN for bars, _ in panels]
    fig = pyplot().figure(figsize=(WIDTH_IN, sum(heights) + 0.55 + 0.17 * len(drawn.caption)))
    grid = fig.add_gridspec(len(heights), 1, height_ratios=heights)
    draw_legend(fig.add_subplot(grid[0]), drawn.legend)
    fitted = []
    for i, (bars, name) in enumerate(panels):
        ax = fig.add_subplot(grid[i + 1])
        cut_at = max(b.total for b in bars if not b.cut) * CUT_AT if any(b.cut for b in bars) else None
        fitted.append((ax, draw_panel(ax, bars, name, cut_at)))
        if i == len(panels) - 1:
            ax.set_xlabel("time per step, ms", fontsize=FONT)
    fig.suptitle(drawn.title, fontsize=FONT + 2)
    fig.supxlabel("\n".join(drawn.caption), fontsize=FONT, x=0.01, ha="left", color="0.25")
    fig.tight_layout()  # the axes' final widths, which the labels are fitted to (save_figure lays out again)
    for ax, texts in fitted:
        fit_labels(fig, ax, texts)
    save_figure(fig, path)
    drawn.size_px = (int(WIDTH_IN * FIGURE_DPI), int(fig.get_figheight() * FIGURE_DPI))  # Agg truncates
    return drawn
