"""95% intervals for step times and their ratios, over repeated runs.

A step time is the mean over one run's whole update cycles; a cell repeats the run (5 times at cpu-scale, 3 on a
GPU), engines interleaved, so run r of every engine shares one seed and one stretch of machine time. Intervals:

- a step time: Student's t interval of the mean of its logs over the runs, back-transformed (`log_interval`): the
  geometric mean, positive at both ends (a plain t interval of two runs can reach below zero);
- a ratio of two engines: the runs are paired by repeat, and the interval is Student's t on the log of the paired
  ratios, back-transformed (`ratio_interval`): a geometric mean, so a ratio and its inverse get the same verdict.

A ratio whose interval includes 1 is reported as "no difference", not as a speedup or a slowdown (`ratio_cell`).
One run gives a value and no interval ("1 run"); the cell says so instead of pretending.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from scipy.stats import t as student_t

LEVEL = 0.95
NO_DIFFERENCE = "no difference"


@dataclass(frozen=True)
class Interval:
    """A center and its LEVEL interval over n runs; low/high None with one run."""

    center: float
    low: float | None
    high: float | None
    n: int

    @property
    def includes_one(self) -> bool:
        return self.low is not None and self.high is not None and self.low <= 1.0 <= self.high


def _half_width(values: Sequence[float], level: float) -> float | None:
    if len(values) < 2:
        return None
    sem = statistics.stdev(values) / math.sqrt(len(values))
    return float(student_t.ppf(0.5 + level / 2, len(values) - 1)) * sem


def mean_interval(values: Sequence[float], level: float = LEVEL) -> Interval:
    """The mean of `values` and Student's t interval around it."""
    values = [float(v) for v in values]
    if not values:
        raise ValueError("mean_interval needs at least one value")
    center = statistics.fmean(values)
    half = _half_width(values, level)
    return Interval(center, None if half is None else center - half, None if half is None else center + half,
                    len(values))


def log_interval(values: Sequence[float], level: float = LEVEL) -> Interval:
    """The geometric mean of positive `values` and Student's t interval on their logs, back-transformed."""
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"log_interval needs positive values, got {list(values)}")
    iv = mean_interval([math.log(v) for v in values], level)
    return Interval(math.exp(iv.center), None if iv.low is None else math.exp(iv.low),
                    None if iv.high is None else math.exp(iv.high), iv.n)


def ratio_interval(numerators: dict[int, float], denominators: dict[int, float],
                   level: float = LEVEL) -> Interval | None:
    """numerator / denominator over the repeats both have (paired by key), as the geometric mean of the paired
    ratios with Student's t interval on their logs; None when no repeat is shared or a value is not positive."""
    shared = sorted(set(numerators) & set(denominators))
    if not shared or any(numerators[k] <= 0 or denominators[k] <= 0 for k in shared):
        return None
    return log_interval([numerators[k] / denominators[k] for k in shared], level)


def target_speedup(base_times: dict[int, float], times: dict[int, float | None],
                   level: float = LEVEL) -> Interval | None:
    """A time-to-target speedup (the baseline's time over the engine's), paired by repeat as `ratio_interval`, over
    the repeats both ran; None where the engine missed the target in any of them: a speedup over only the runs that
    made it would hide the ones that did not."""
    if any(times[k] is None for k in set(base_times) & set(times)):
        return None
    return ratio_interval(base_times, times, level)  # type: ignore[arg-type]


def columns(key: str, iv: Interval | None) -> dict[str, float | None]:
    """An Interval as the flat columns a table.csv stores: key (the center), key_low, key_high."""
    return {key: iv and iv.center, f"{key}_low": iv and iv.low, f"{key}_high": iv and iv.high}


def row_interval(row: dict[str, Any], key: str, center: str | None = None) -> Interval | None:
    """The Interval a row (or its csv line) stores flat (center or key, key_low, key_high; n from its runs)."""
    if row.get(center or key) is None:
        return None
    return Interval(row[center or key], row.get(f"{key}_low"), row.get(f"{key}_high"), int(row.get("runs") or 1))


def interval_cell(iv: Interval | None, spec: str = ".1f") -> str:
    """'[low–high]', or why there is none."""
    if iv is None:
        return "—"
    if iv.low is None:
        return "1 run"
    return f"[{iv.low:{spec}}–{iv.high:{spec}}]"


def ratio_cell(iv: Interval | None, spec: str = ".2f") -> str:
    """A ratio as a table cell: '2.51× [2.40–2.63]'; 'no difference (0.98× [0.91–1.05])' when the interval
    includes 1; '2.51× (1 run)' without an interval."""
    if iv is None:
        return "—"
    value = f"{iv.center:{spec}}×"
    if iv.low is None:
        return f"{value} (1 run)"
    if iv.includes_one:
        return f"{NO_DIFFERENCE} ({value} {interval_cell(iv, spec)})"
    return f"{value} {interval_cell(iv, spec)}"
