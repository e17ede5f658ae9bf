"""GLUE study: is ZenFlow's deficit ZenFlow's or the budget's? (reproduce/glue_study.py, docs/glue.md)"""

from __future__ import annotations

from pathlib import Path

from zenflow.harness.records import RunRecord

# Each setting: the reproduce/glue.py arguments that make it (seeds 0 1 2 and the default data are glue.py's).
OURS = ["--engines", "ref-offload", "ref-zenflow"]
SETTINGS: dict[str, list[str]] = {
    "budget-3-epochs": [*OURS, "--epochs", "3"],
    "interval-1": ["--engines", "ref-zenflow", "--update-interval", "1"],
    "interval-2": ["--engines", "ref-zenflow", "--update-interval", "2"],
    "topk-0.05": ["--engines", "ref-zenflow", "--topk-ratio", "0.05"],
    "topk-0.2": ["--engines", "ref-zenflow", "--topk-ratio", "0.2"],
    "reproduce-default": [*OURS, "--seeds", "0"],
}


def study_report(default: list[RunRecord], settings: dict[str, list[RunRecord]], out: Path) -> None:
    print("report: not written yet; run reproduce/glue_study.py --report-only")
