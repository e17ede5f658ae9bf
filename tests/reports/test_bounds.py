"""The byte bounds of the step's parts (zenflow/reports/bounds.py): the limits file, the check, and a part made 3x
slower on purpose tripping its committed limit in a real interleaved measurement."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from zenflow.host import accumulate_into_
from zenflow.reports.bounds import (
    PARTS,
    BoundRatio,
    InterleavedReference,
    bound_ratio,
    copy_bytes,
    device_update_line_floor,
    limit_for,
    line_floor_ratio,
    load_limits,
    main,
    reference_copy,
    table,
    touched_lines,
    violation,
)

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = sorted((ROOT / "results" / "bounds").glob("*/bounds.json"))


def test_every_part_has_its_bytes_and_copy() -> None:
    # one weight 8x10, 2 selected, 8 host columns, bf16: the table of the module's docstring
    expected = {"selection": 8 * 10 * 2 // 2, "device-update": 8 * 2 * 28 // 2, "gradient-offload": 8 * 8 * 2,
                "host-accumulate": 8 * 8 * 10 // 2, "host-adamw": 8 * 8 * 30 // 2, "parameter-upload": 8 * 8 * 2,
                "device-accumulate": 8 * 8 * 10 // 2, "ship": 4 * 8 * 8}
    assert {part: copy_bytes(part, 8, 10, 2, 8, 2) for part in PARTS} == expected


def test_limits_file_refuses_an_unknown_part(tmp_path: Path) -> None:
    bad = tmp_path / "t.toml"
    bad.write_text('[bound_ratios]\n"cpu/gather" = 2\n')
    with pytest.raises(ValueError, match=r"\['cpu/gather'\] name no part; expected <cpu\|cuda>/<part>"):
        load_limits(bad)


def test_the_committed_limits_name_every_cpu_part_and_the_last_match_wins() -> None:
    limits = load_limits(ROOT / "bench" / "thresholds.toml")
    assert all(limit_for("cpu", part, limits) is not None for part in PARTS)
    assert limit_for("cpu", "host-adamw", limits) == 1.5  # "cpu/*" only
    assert limit_for("cpu", "selection", limits) > 1.5  # its own line, after "cpu/*"
    assert limit_for("cuda", "ship", {"cpu/*": 1.5}) is None


def test_violation_at_and_over_the_limit() -> None:
    limits = {"cpu/*": 1.5}
    assert violation("cpu", "ship", BoundRatio(1.5, 1.4, 1.6, 10.0), limits) is None
    problem = violation("cpu", "ship", BoundRatio(4.5, 4.4, 4.6, 10.0), limits)
    assert problem is not None and "cpu/ship: bound ratio 4.50 is over its limit 1.5" in problem
    assert violation("cuda", "ship", BoundRatio(99.0, None, None, 1.0), limits) is None  # no limit, no verdict


def test_bound_ratio_pairs_the_last_reference_rounds() -> None:
    measured = bound_ratio([2.0, 2.0, 2.0], [9.0, 1.0, 1.0, 1.0], nbytes=10**9)  # the 9 s one is a warm-up round
    assert measured.ratio == 2.0 and measured.low == pytest.approx(2.0) and measured.reference_gbps == 1.0


def _host_accumulate_ratios() -> tuple[BoundRatio, BoundRatio]:
    """The host-accumulate part (the fp32 sum += the bf16 staging) as built and run 3 times a round (made 3x slower),
    each against the reference copy of its bytes, all three interleaved round by round: the bench's own measurement,
    in miniature, on buffers larger than the caches."""
    out, n = 2048, 4096
    acc, staging = torch.zeros(out, n), torch.randn(out, n).to(torch.bfloat16)
    nbytes = copy_bytes("host-accumulate", out, n, 0, n, 2)
    reference = InterleavedReference(reference_copy("host", nbytes, torch.device("cpu")))
    seconds: dict[int, list[float]] = {1: [], 3: []}
    for _ in range(12):
        for repeats, times in seconds.items():
            reference()
            start = time.perf_counter()
            for _ in range(repeats):
                accumulate_into_(acc, staging)
            times.append(time.perf_counter() - start)
    pairs = {r: (times[2:], reference.seconds[i::2][2:]) for i, (r, times) in enumerate(seconds.items())}
    return tuple(bound_ratio(times, ref, nbytes) for times, ref in pairs.values())


def test_a_part_made_3x_slower_trips_its_committed_limit() -> None:
    limits = load_limits(ROOT / "bench" / "thresholds.toml")
    for _ in range(3):  # a burst of other work on a 2-core machine can upset one measurement: up to three
        as_built, slowed = _host_accumulate_ratios()
        if violation("cpu", "host-accumulate", as_built, limits) is None:
            break
    assert violation("cpu", "host-accumulate", as_built, limits) is None, as_built
    assert slowed.ratio > 2 * as_built.ratio, (as_built, slowed)
    assert violation("cpu", "host-accumulate", slowed, limits) is not None, slowed


@pytest.mark.parametrize("run", COMMITTED, ids=lambda p: p.parent.name)
def test_committed_table_regenerates_byte_identical(run: Path) -> None:
    limits = load_limits(ROOT / "bench" / "thresholds.toml")
    assert (run.parent / "bounds.md").read_text() == table(json.loads(run.read_text()), limits)


def test_committed_bound_runs_exist() -> None:
    assert COMMITTED, "no results/bounds/*/bounds.json committed"


def test_command_refuses_a_missing_run(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path / "none.json")])
    assert exit_.value.code == 2 and "none.json: no such file" in capsys.readouterr().err


def test_the_line_floor_counts_every_line_a_scattered_column_set_touches() -> None:
    """Brute force: a line of 32 bf16 (or 16 fp32) elements is touched when any of its columns is selected."""
    gen = torch.Generator().manual_seed(6)
    for b, per_line in ((2, 32), (4, 16)):
        columns = torch.sort(torch.randperm(1000, generator=gen)[:37]).values
        assert touched_lines(columns, b) == len({int(c) // per_line for c in columns})
    assert touched_lines(torch.arange(64), 2) == 2  # one run: its lines only
    floor = device_update_line_floor(8, torch.tensor([0, 1, 40, 70, 71]), 2)  # bf16 lines 0, 1 and 2: three
    assert floor == 8 * (3 * 3 * 64 + 24 * 5)
    measured = BoundRatio(3.0, 2.9, 3.1, 10.0)
    # the same time against a copy three times as large (the floor's copy is half its traffic, as the bound's)
    assert line_floor_ratio(measured, 1000, 6000) == pytest.approx(1.0)


def test_the_table_shows_the_line_floor_where_a_part_has_one() -> None:
    info = {"device": "cpu", "shape": [4, 4], "reference_gbps": 1.0, "bound_ratio": 3.0, "bound_ratio_low": 2.9,
            "bound_ratio_high": 3.1}
    run = {"machine_info": {"cpu_model": "x", "hardware_id": "h", "git_commit": "abc"}, "datetime": "2026-11-29",
           "benchmarks": [{"stats": {"median": 0.001}, "extra_info": {**info, "part": "device-update",
                                                                      "line_floor_ratio": 1.234}},
                          {"stats": {"median": 0.001}, "extra_info": {**info, "part": "host-adamw"}}]}
    rows = {line.split("|")[1].strip(): line for line in table(run, {}).splitlines()[4:]}
    assert "| 1.23 " in rows["device-update"] and "| —" in rows["host-adamw"]
