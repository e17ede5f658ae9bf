"""Compare two pytest-benchmark runs: a verdict per benchmark from the ratio of medians AND a Mann–Whitney U test.

    python -m zenflow.bench_compare BASELINE CANDIDATE [--threshold 0.05] [--threshold-for NAME=0.10 ...]
        [--alpha 0.05] [--thresholds bench/thresholds.toml] [--plain-test] [--force] [--markdown out.md]

BASELINE / CANDIDATE: a pytest-benchmark JSON or a folder (its newest JSON, searched recursively). Regression: the
median ratio candidate/baseline > 1 + threshold AND the one-sided U test on the raw rounds says "slower than the
baseline × (1 + threshold)" with p < alpha; Suspicious: one of the two says slower; Improvement: the mirror image
of Regression; Insufficient data: no raw rounds, or fewer than 5 on a side; No change: the rest. Method and
rationale: docs/benchmarks.md. Exit code 1 on a Regression not accepted in the thresholds file; 2 when the runs come
from different hardware ids (unless --force) or an input is unusable; 0 otherwise. The Markdown table goes to
stdout, --markdown and $GITHUB_STEP_SUMMARY (when set).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scipy.stats import mannwhitneyu

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

MIN_ROUNDS = 5
DEFAULT_THRESHOLD, DEFAULT_ALPHA = 0.05, 0.05
DEFAULT_THRESHOLDS_FILE = Path("bench/thresholds.toml")
ORDER = ("Regression", "Suspicious", "Improvement", "No change", "Insufficient data")


class CompareError(Exception):
    """An input that cannot be compared (exit code 2)."""


@dataclass
class Verdict:
    name: str
    verdict: str
    threshold: float
    ratio: float | None = None
    p_slower: float | None = None  # one-sided U test: candidate slower than baseline
    p_beyond: float | None = None  # ... slower than baseline x (1 + threshold) (= p_slower with beyond=False)
    p_faster: float | None = None  # ... faster than baseline x (1 - threshold) (x 1 with beyond=False)
    n: tuple[int, int] = (0, 0)
    medians: tuple[float | None, float | None] = (None, None)
    noise: float | None = None  # the larger IQR/median of the two sides
    note: str = ""
    accepted: str | None = None  # reason, when a Regression is accepted in the thresholds file


def judge(baseline: list[float] | None, candidate: list[float] | None, threshold: float = DEFAULT_THRESHOLD,
          alpha: float = DEFAULT_ALPHA, name: str = "", medians: tuple[float | None, float | None] = (None, None),
          beyond: bool = True) -> Verdict:
    """The verdict for one benchmark from its raw per-round timings (`medians`: stored ones, when data is absent).

    beyond=False is the plain rule: ratio > 1 + threshold and "slower at all" with p < alpha."""
    v = Verdict(name, "Insufficient data", threshold, n=(len(baseline or ()), len(candidate or ())), medians=medians)
    if baseline:
        v.medians = (statistics.median(baseline), v.medians[1])
    if candidate:
        v.medians = (v.medians[0], statistics.median(candidate))
    if v.medians[0] and v.medians[1] is not None:
        v.ratio = v.medians[1] / v.medians[0]
    if baseline is None or candidate is None:
        side = " and ".join(s for s, d in (("baseline", baseline), ("candidate", candidate)) if d is None)
        v.note = f"no raw timings in the {side} (save with --benchmark-save-data or --benchmark-json)"
        return v
    if min(v.n) < MIN_ROUNDS:
        v.note = f"rounds {v.n[0]}/{v.n[1]}: at least {MIN_ROUNDS} per side are needed"
        return v
    if v.ratio is None or not v.medians[1]:
        v.note = "a median of zero: no ratio"
        return v
    v.noise = max(_iqr(d) / statistics.median(d) for d in (baseline, candidate))
    # Plain test: is the candidate slower at all? Beyond-threshold test (the default): is it slower than the
    # baseline scaled by 1 + threshold, i.e. slower by more than the threshold? (docs/benchmarks.md)
    up, down = (1 + threshold, 1 - threshold) if beyond else (1.0, 1.0)
    v.p_slower = _p(candidate, baseline, "greater")
    v.p_beyond = _p(candidate, [t * up for t in baseline], "greater")  # >= p_slower: U only shrinks
    v.p_faster = _p(candidate, [t * down for t in baseline], "less")
    ratio_slower, test_slower = v.ratio > 1 + threshold, v.p_slower < alpha
    if ratio_slower and v.p_beyond < alpha:
        v.verdict = "Regression"
    elif ratio_slower and test_slower:
        v.verdict, v.note = "Suspicious", (f"significantly slower (p = {v.p_slower:.3g}), but not significantly by "
                                           f"more than {threshold:.0%} (p = {v.p_beyond:.3g})")
    elif ratio_slower:
        v.verdict, v.note = "Suspicious", f"slower median, but not significant (p = {v.p_slower:.3g})"
    elif test_slower:
        v.verdict, v.note = "Suspicious", (f"significantly slower (p = {v.p_slower:.3g}), but within the "
                                           f"{threshold:.0%} threshold")
    elif v.ratio < 1 - threshold and v.p_faster < alpha:
        v.verdict = "Improvement"
    else:
        v.verdict = "No change"
    return v


def _p(candidate: list[float], baseline: list[float], alternative: str) -> float:
    """One-sided Mann–Whitney U p-value (exact for small untied samples, else normal approximation with tie
    correction: scipy's "auto"); 1.0 when undefined (every timing identical)."""
    p = float(mannwhitneyu(candidate, baseline, alternative=alternative).pvalue)
    return 1.0 if p != p else p


def _iqr(data: list[float]) -> float:
    q = statistics.quantiles(data, n=4, method="inclusive")
    return q[2] - q[0]


# ---- thresholds file: per-benchmark thresholds and accepted regressions -------------------------------------------
@dataclass
class Thresholds:
    default: float = DEFAULT_THRESHOLD
    patterns: dict[str, float] = field(default_factory=dict)  # fnmatch pattern on the benchmark name -> threshold
    accepted: list[dict[str, Any]] = field(default_factory=list)  # [[accepted]] entries of the file

    @classmethod
    def load(cls, path: str | Path | None) -> Thresholds:
        """The file at `path`; None: bench/thresholds.toml when present (run from the repository root)."""
        if path is None and not DEFAULT_THRESHOLDS_FILE.exists():
            return cls()
        path = DEFAULT_THRESHOLDS_FILE if path is None else Path(path)
        if not path.exists():
            raise CompareError(f"--thresholds {str(path)!r}: file not found")
        data = tomllib.loads(Path(path).read_text())
        table = dict(data.get("thresholds", {}))
        out = cls(default=float(table.pop("default", DEFAULT_THRESHOLD)),
                  patterns={k: float(v) for k, v in table.items()}, accepted=list(data.get("accepted", [])))
        for entry in out.accepted:
            missing = {"benchmark", "baseline_commit", "max_ratio", "reason"} - set(entry)
            if missing:
                raise CompareError(f"{path}: an [[accepted]] entry lacks {sorted(missing)}: {entry}")
        return out

    def threshold(self, name: str) -> float:
        """The last matching pattern wins (file order, then --threshold-for in command-line order)."""
        found = self.default
        for pattern, value in self.patterns.items():
            if matches(name, pattern):
                found = value
        return found

    def stale(self, baseline_commit: str | None) -> list[str]:
        """Accepted entries measured against another baseline: they no longer apply."""
        return [e["benchmark"] for e in self.accepted
                if not (baseline_commit and baseline_commit.startswith(str(e["baseline_commit"])))]

    def acceptance(self, v: Verdict, baseline_commit: str | None) -> str | None:
        """The reason, when this regression is accepted against this baseline (a commit prefix of >= 7 characters:
        once the baseline moves past it, the entry stops applying and must be removed)."""
        for entry in self.accepted:
            commit = str(entry["baseline_commit"])
            if (matches(v.name, entry["benchmark"]) and len(commit) >= 7 and baseline_commit
                    and baseline_commit.startswith(commit) and v.ratio is not None
                    and v.ratio <= float(entry["max_ratio"])):
                return str(entry["reason"])
        return None


def matches(name: str, pattern: str) -> bool:
    """`*` and `?` are wildcards; brackets are literal (benchmark names have them: `test_x[param]`)."""
    return fnmatch.fnmatchcase(name, "".join(f"[{c}]" if c in "[]" else c for c in pattern))


# ---- inputs -------------------------------------------------------------------------------------------------------
def load_run(path: str | Path) -> tuple[Path, dict[str, Any]]:
    """A pytest-benchmark JSON file, or the newest one in a folder (by its `datetime`, then its name)."""
    path = Path(path)
    if path.is_dir():
        runs = [(_read(p), p) for p in path.rglob("*.json")]
        runs = [(run, p) for run, p in runs if run is not None]
        if not runs:
            raise CompareError(f"{path}: no pytest-benchmark JSON in this folder")
        run, path = max(runs, key=lambda rp: (str(rp[0].get("datetime", "")), rp[1].name))
        return path, run
    run = _read(path)
    if run is None:
        raise CompareError(f"{path}: expected a pytest-benchmark JSON (machine_info, benchmarks), found none")
    return path, run


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("benchmarks"), list) else None


def check_hardware(baseline: dict[str, Any], candidate: dict[str, Any], force: bool) -> str | None:
    """Refuse runs of different (or unknown) hardware ids; with force, a warning line instead."""
    ids = [(run.get("machine_info") or {}).get("hardware_id") for run in (baseline, candidate)]
    if ids[0] and ids[0] == ids[1]:
        return None
    problem = (f"hardware ids differ: baseline {ids[0]!r}, candidate {ids[1]!r}" if all(ids) else
               f"hardware id unknown (baseline {ids[0]!r}, candidate {ids[1]!r}; runs not made with bench/conftest.py)")
    if not force:
        raise CompareError(f"refusing to compare: {problem}. Step times of different hardware are not comparable; "
                           "--force compares them anyway")
    return f"forced comparison: {problem}"


def compare_runs(baseline: dict[str, Any], candidate: dict[str, Any], thresholds: Thresholds,
                 alpha: float = DEFAULT_ALPHA, beyond: bool = True) -> tuple[list[Verdict], list[str]]:
    """Verdicts for benchmarks present in both runs (matched by full name), and notes about the others."""
    base = {b["fullname"]: b for b in baseline["benchmarks"]}
    cand = {b["fullname"]: b for b in candidate["benchmarks"]}
    base_commit = (baseline.get("commit_info") or {}).get("id")
    verdicts = []
    for fullname in [n for n in cand if n in base]:
        b, c = base[fullname], cand[fullname]
        name = c.get("name") or fullname
        v = judge(b["stats"].get("data"), c["stats"].get("data"), thresholds.threshold(name), alpha, name,
                  medians=(b["stats"].get("median"), c["stats"].get("median")), beyond=beyond)
        if v.verdict == "Regression":
            v.accepted = thresholds.acceptance(v, base_commit)
        verdicts.append(v)
    verdicts.sort(key=lambda v: (ORDER.index(v.verdict), v.name))
    notes = [f"only in the baseline (not run, or failed, in the candidate): `{n}`" for n in base if n not in cand]
    notes += [f"new in the candidate (no baseline yet): `{n}`" for n in cand if n not in base]
    notes += [f"stale [[accepted]] entry (measured against another baseline, no longer applies): `{n}`"
              for n in thresholds.stale(base_commit)]
    return verdicts, notes


# ---- output -------------------------------------------------------------------------------------------------------
def _time(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def _num(x: float | None, fmt: str = ".3g") -> str:
    return "—" if x is None else format(x, fmt)


def _describe(path: Path, run: dict[str, Any]) -> str:
    commit = (run.get("commit_info") or {}).get("id") or "?"
    info = run.get("machine_info") or {}
    load = info.get("load_average") or {}
    busy = (f", load average {(load.get('start') or ['?'])[0]} → {(load.get('end') or ['?'])[0]}" if load else "")
    return f"`{path}` (commit `{commit[:10]}`, {run.get('datetime', '?')}, hardware `{info.get('hardware_id')}`{busy})"


def to_markdown(verdicts: list[Verdict], notes: list[str], header: list[str], alpha: float, beyond: bool = True,
                ) -> str:
    counts = {k: sum(v.verdict == k for v in verdicts) for k in ORDER}
    test = "slower by more than the threshold" if beyond else "slower"
    lines = ["## Benchmark comparison", "", *header, "",
             ", ".join(f"**{n} {k}**" if k == "Regression" and n else f"{n} {k}" for k, n in counts.items()), "",
             f"Regression = median ratio > 1 + threshold **and** the one-sided Mann–Whitney U test on the raw rounds "
             f"says \"{test}\" with p < {alpha} (both agree). Method: docs/benchmarks.md.", "",
             "| benchmark | baseline median | candidate median | ratio | p slower | p beyond threshold | rounds b/c "
             "| noise | threshold | verdict | note |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for v in verdicts:
        verdict = f"**{v.verdict}**" if v.verdict == "Regression" and not v.accepted else v.verdict
        note = f"accepted: {v.accepted}" if v.accepted else v.note
        lines.append(f"| `{v.name}` | {_time(v.medians[0])} | {_time(v.medians[1])} | "
                     f"{_num(v.ratio, '.3f')} | {_num(v.p_slower)} | {_num(v.p_beyond)} | {v.n[0]}/{v.n[1]} | "
                     f"{_num(v.noise, '.1%')} | {v.threshold:.0%} | {verdict} | {note} |")
    lines += ["", *[f"- {n}" for n in notes]] if notes else []
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="zenflow-bench-compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("baseline", type=Path)
    ap.add_argument("candidate", type=Path)
    ap.add_argument("--threshold", type=float, default=None,
                    help=f"default threshold (fraction; file default or {DEFAULT_THRESHOLD})")
    ap.add_argument("--threshold-for", action="append", default=[], metavar="NAME=T",
                    help="threshold of a benchmark (fnmatch pattern on its name); repeatable, wins over the file")
    ap.add_argument("--alpha", type=float, default=DEFAULT_ALPHA, help="significance level of the U test")
    ap.add_argument("--thresholds", type=Path, default=None,
                    help=f"TOML file of thresholds and accepted regressions (default: {DEFAULT_THRESHOLDS_FILE}, "
                         "when present)")
    ap.add_argument("--plain-test", action="store_true",
                    help="U test of 'slower at all' instead of 'slower by more than the threshold' (more false alarms)")
    ap.add_argument("--force", action="store_true", help="compare runs of different hardware ids")
    ap.add_argument("--markdown", type=Path, help="also write the Markdown summary here")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        thresholds = Thresholds.load(args.thresholds)
        if args.threshold is not None:
            thresholds.default = args.threshold
        for item in args.threshold_for:
            pattern, sep, value = item.rpartition("=")
            if not sep or not pattern:
                raise CompareError(f"--threshold-for {item!r}: expected NAME=FRACTION, e.g. 'test_x[*]=0.10'")
            thresholds.patterns[pattern] = float(value)
        (base_path, baseline), (cand_path, candidate) = load_run(args.baseline), load_run(args.candidate)
        warning = check_hardware(baseline, candidate, args.force)
    except (CompareError, ValueError, tomllib.TOMLDecodeError) as exc:
        print(f"zenflow-bench-compare: {exc}", file=sys.stderr)
        return 2
    verdicts, notes = compare_runs(baseline, candidate, thresholds, args.alpha, beyond=not args.plain_test)
    header = [f"- baseline: {_describe(base_path, baseline)}", f"- candidate: {_describe(cand_path, candidate)}"]
    header += [f"- **warning**: {warning}"] if warning else []
    text = to_markdown(verdicts, notes, header, args.alpha, beyond=not args.plain_test)
    print(text, end="")
    if args.markdown:
        args.markdown.write_text(text, encoding="utf-8")
    if os.environ.get("GITHUB_STEP_SUMMARY"):  # the CI job page
        with open(os.environ["GITHUB_STEP_SUMMARY"], "a", encoding="utf-8") as f:
            f.write(text)
    return 1 if any(v.verdict == "Regression" and not v.accepted for v in verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
