"""Tests that depend on committed results must not skip silently in CI.

tests/harness/test_golden_loss.py rewrites its golden file and skips when ZENFLOW_UPDATE_GOLDEN is set, and fails only
when the file lacks an engine; tests/costmodel/test_costmodel.py skips its validation-table tests when no
results/costmodel/*/validation.csv is committed. Outside CI such a skip is shown with its reason (`-ra`); with
`CI=true` (set by GitHub Actions, GitLab CI and most runners) it fails the run instead.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path("tests") / "harness" / "golden" / "cpu_scale_losses.json"
GOLDEN_ENGINES = ("ref-zenflow", "ref-offload")  # the engines tests/harness/test_golden_loss.py parametrizes
COSTMODEL = Path("results") / "costmodel"


def in_ci(env: Mapping[str, str]) -> bool:
    return env.get("CI", "").strip().lower() in ("true", "1", "yes")


def hidden_skips(env: Mapping[str, str], root: Path) -> list[str]:
    """Why a result-dependent test would skip (or rewrite its own oracle) instead of checking anything."""
    reasons = []
    if env.get("ZENFLOW_UPDATE_GOLDEN"):
        reasons.append("ZENFLOW_UPDATE_GOLDEN is set: tests/harness/test_golden_loss.py rewrites the golden curve "
                       "and skips")
    golden = root / GOLDEN
    if not golden.is_file():
        reasons.append(f"{GOLDEN} is missing: the golden loss curve checks nothing")
    else:
        missing = [e for e in GOLDEN_ENGINES if e not in json.loads(golden.read_text())]
        if missing:
            reasons.append(f"{GOLDEN} has no curve for {missing}")
    if not sorted((root / COSTMODEL).glob("*/validation.csv")):
        reasons.append(f"no {COSTMODEL}/*/validation.csv: tests/costmodel/test_costmodel.py skips its validation tests")
    return reasons


def verdict(env: Mapping[str, str], root: Path) -> tuple[str, list[str]]:
    """"ok", "skip" (outside CI: said, not hidden) or "fail" (in CI), with the reasons."""
    reasons = hidden_skips(env, root)
    if not reasons:
        return "ok", []
    return ("fail" if in_ci(env) else "skip"), reasons


def test_result_dependent_tests_do_not_skip_silently_in_ci():
    outcome, reasons = verdict(os.environ, ROOT)
    if outcome == "fail":
        pytest.fail("CI=true but result-dependent tests would skip: " + "; ".join(reasons))
    if outcome == "skip":
        pytest.skip("result-dependent tests will skip here: " + "; ".join(reasons))


def _complete_tree(root: Path) -> Path:
    (root / GOLDEN).parent.mkdir(parents=True)
    (root / GOLDEN).write_text(json.dumps({e: [1.0, 0.5] for e in GOLDEN_ENGINES}))
    (root / COSTMODEL / "some-hardware").mkdir(parents=True)
    (root / COSTMODEL / "some-hardware" / "validation.csv").write_text("seq,engine\n")
    return root


def test_guard_passes_a_complete_tree_in_and_out_of_ci(tmp_path):
    root = _complete_tree(tmp_path)
    assert verdict({"CI": "true"}, root) == ("ok", [])
    assert verdict({}, root) == ("ok", [])


@pytest.mark.parametrize("breakage", ["no golden file", "golden file lacks an engine", "no costmodel results",
                                      "golden update requested"])
def test_guard_fails_in_ci_and_says_so_outside(tmp_path, breakage):
    root = _complete_tree(tmp_path)
    env: dict[str, str] = {}
    if breakage == "no golden file":
        (root / GOLDEN).unlink()
    elif breakage == "golden file lacks an engine":
        (root / GOLDEN).write_text(json.dumps({"ref-zenflow": [1.0]}))
    elif breakage == "no costmodel results":
        (root / COSTMODEL / "some-hardware" / "validation.csv").unlink()
    else:
        env["ZENFLOW_UPDATE_GOLDEN"] = "1"
    outcome, reasons = verdict({**env, "CI": "true"}, root)
    assert outcome == "fail" and len(reasons) == 1
    assert verdict(env, root) == ("skip", reasons)
    assert verdict({**env, "CI": "false"}, root)[0] == "skip"
