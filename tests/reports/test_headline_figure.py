"""The Llama scenario's figure.png (reports/headline_figure.py): at most 1200 px wide, the paper's
engines alone in panel 1, every other engine that ran in panel 2, engines not run named in the caption and not
drawn, and speedup labels that carry their 95% interval. Checked on what the figure function says it drew
(`Drawn`), and on the PNG headers of the drawn and the committed figures."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from zenflow.harness.records import RunRecord
from zenflow.reports.headline_figure import PAPER_ENGINES, Bar, cut_long, describe, headline_figure, make_bar
from zenflow.reports.intervals import NO_DIFFERENCE
from zenflow.reports.scenario import engine_rows

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
MAX_WIDTH_PX = 1200
CUDA_SKIP = "torchao's CPUOffloadOptimizer runs on CUDA (or XPU) parameters only; this run's device is the CPU (in /x)"


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk (bytes 16-24)."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path}: not a PNG"
    return struct.unpack(">II", head[16:24])


def _run(engine: str, repeat: int, ms: float, split: tuple[float, float] = (0.6, 0.1)) -> RunRecord:
    compute, io = ms * split[0], ms * split[1]
    summary = {"cycle_mean_ms": ms, "step_ms": {"median": ms}, "compute_ms": compute, "io_ms": io,
               "stall_ms": ms - compute - io}
    return RunRecord(engine=engine, protocol={"repeat": repeat, "taken_at": "2026-11-27T08:00:00+00:00"},
                     summary=summary, workload={"seed": 1234 + repeat})


def _engine(engine: str, times: tuple[float, ...]) -> list[RunRecord]:
    return [_run(engine, r, ms) for r, ms in enumerate(times)]


def _records() -> list[RunRecord]:
    """Four of the paper's engines, three others (one far slower), and three engines that did not run."""
    ran = (_engine("ds-zero-offload", (400, 420, 410, 405, 415)) + _engine("ds-zenflow", (395, 430, 400, 420, 405))
           + _engine("ref-zenflow", (200, 212, 204, 199, 210)) + _engine("no-offload", (150, 152, 149, 151, 150))
           + _engine("ref-offload-gas", (120, 125, 118, 122, 121)) + _engine("fsdp2-offload", (300, 310, 305, 299, 301))
           + _engine("ds-zero-infinity", (500, 510, 505, 499, 501))
           + _engine("torchao-adamw8bit", (1600, 1610, 1605, 1599, 1601)))
    return ran + [RunRecord(engine="torchao-offload", status="skipped", error=CUDA_SKIP, protocol={"repeat": 0}),
                  RunRecord(engine="bnb-adamw8bit", status="skipped", protocol={"repeat": 0},
                            error="bitsandbytes not installed: bnb-adamw8bit needs it (in /x)"),
                  RunRecord(engine="megatron-hybrid-0.1", status="failed", error="Traceback ...",
                            protocol={"repeat": 0})]


@pytest.fixture(scope="module")
def drawn(tmp_path_factory):
    records = _records()
    path = tmp_path_factory.mktemp("headline") / "figure.png"
    return headline_figure(engine_rows(records), records, path, "ZenFlow vs ZeRO-Offload", "2-core test CPU"), path


def test_the_committed_scenario_figures_are_at_most_1200_px_wide() -> None:
    figures = sorted((ROOT / "results" / "llama7b").rglob("figure.png"))
    assert figures, "no committed scenario figure under results/llama7b/"
    wide = {str(f.relative_to(ROOT)): png_size(f)[0] for f in figures if png_size(f)[0] > MAX_WIDTH_PX}
    assert not wide, f"wider than {MAX_WIDTH_PX} px (regenerate: reproduce/llama7b.py --report-only --out ...): {wide}"


def test_the_drawn_figure_is_at_most_1200_px_wide_and_says_its_size(drawn) -> None:
    result, path = drawn
    assert png_size(path) == result.size_px
    assert result.size_px[0] <= MAX_WIDTH_PX


def test_an_engine_not_run_is_not_drawn_but_named_in_the_caption_with_why(drawn) -> None:
    result, _ = drawn
    shown = result.engines(1) + result.engines(2)
    gone = {"torchao-offload": "needs CUDA", "bnb-adamw8bit": "not installed", "megatron-hybrid-0.1": "failed"}
    assert result.not_run == gone
    assert not set(gone) & set(shown)
    caption = " ".join(result.caption)
    assert all(f"{engine} ({why})" in caption for engine, why in gone.items()), caption
    assert caption.count("not run here:") == 1


def test_panel_one_holds_exactly_the_paper_engines_that_ran_in_the_papers_order(drawn) -> None:
    result, _ = drawn
    assert result.engines(1) == ["ds-zero-offload", "ds-zenflow", "ref-zenflow", "no-offload"]
    assert result.engines(2) == ["ds-zero-infinity", "ref-offload-gas", "fsdp2-offload", "torchao-adamw8bit"]
    records = _records() + _engine("ds-zenflow-intended", (300, 310, 305, 299, 301))  # another person's new engine
    again = describe(engine_rows(records), records, "t", "s")
    assert again.engines(1) == [e for e in PAPER_ENGINES if e in again.engines(1)]
    assert again.engines(1)[:3] == ["ds-zero-offload", "ds-zenflow", "ds-zenflow-intended"]
    assert "ds-zenflow-intended" not in again.engines(2)


def test_the_speedup_label_carries_its_95_percent_interval(drawn) -> None:
    result, _ = drawn
    rows = {r["engine"]: r for r in engine_rows(_records())}
    labels = {bar.engine: bar.label for panel in result.panels for bar in panel}
    fast = rows["ref-zenflow"]
    assert f"{fast['speedup']:.2f}× [{fast['speedup_low']:.2f}–{fast['speedup_high']:.2f}]" in labels["ref-zenflow"]
    assert rows["ds-zenflow"]["speedup_low"] < 1 < rows["ds-zenflow"]["speedup_high"]
    assert NO_DIFFERENCE in labels["ds-zenflow"] and NO_DIFFERENCE not in labels["ref-zenflow"]
    assert "baseline" in labels["ds-zero-offload"]


def test_a_bar_far_longer_than_its_panel_is_cut_and_says_so(drawn) -> None:
    result, _ = drawn
    cut = {bar.engine for panel in result.panels for bar in panel if bar.cut}
    assert cut == {"torchao-adamw8bit"}
    assert next(b for b in result.panels[1] if b.cut).label.startswith("bar cut, 1601 ms")


def test_a_stall_that_grew_is_written_as_growth_not_as_a_reduction() -> None:
    row = {"engine": "ds-zenflow", "cycle_mean_ms": 500.0, "compute_ms": 300.0, "io_ms": None, "stall_ms": 200.0,
           "stall_includes_io": True, "speedup": 0.8, "speedup_low": 0.7, "speedup_high": 0.9, "runs": 5}
    assert "stall +20%" in make_bar(row | {"stall_reduction": -0.2}, set(), True).label
    assert "stall −40%" in make_bar(row | {"stall_reduction": 0.4}, set(), True).label
    bar = make_bar(row | {"stall_reduction": None}, {"ds-zenflow"}, True)
    assert "stall" not in bar.label and "busy machine" in bar.label
    assert bar.segments == [("compute", 300.0), ("stall_io", 200.0)]


def test_the_title_holds_the_hardware_and_the_day_of_the_runs(drawn) -> None:
    result, _ = drawn
    assert "2-core test CPU" in result.title and "runs of 2026-11-27" in result.title


def test_rows_without_a_measured_engine_are_refused_in_one_line_naming_them() -> None:
    skipped = [RunRecord(engine="torchao-offload", status="skipped", error=CUDA_SKIP, protocol={"repeat": 0})]
    with pytest.raises(ValueError, match=r"no engine with a measured step time among \['torchao-offload'\]") as info:
        describe(engine_rows(skipped), skipped, "t", "s")
    assert "\n" not in str(info.value)


def test_a_bar_is_cut_only_when_far_longer_than_the_rest_of_its_panel():
    """`cut_long`: the reach is the longest bar within CUT (2.5) × the median; a bar over CUT_AT (1.3) × the reach is
    cut. 300 ms beside 240 is 3× the median of 100 but not far from the rest (≤ 1.3 × 240): nothing is cut; 400 ms
    beside bars of at most 120 is (over 1.3 × 120), and only it."""
    def bars(*totals):
        return [Bar(f"e{i}", f"e{i}", [("compute", t)], t, "") for i, t in enumerate(totals)]

    near = bars(100, 100, 100, 240, 300)
    cut_long(near)
    assert not any(b.cut for b in near)
    far = bars(100, 100, 100, 120, 400)
    cut_long(far)
    assert [b.cut for b in far] == [False, False, False, False, True] and far[-1].label.startswith("bar cut")
