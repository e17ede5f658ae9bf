"""A committed or published result set's tables remade from its records, compared byte for byte
(tests/reports/test_committed_tables.py for every committed set; tests/reproduce/test_gpu_window.py for a set the
GPU window publishes)."""

from __future__ import annotations

import shutil
from pathlib import Path

from zenflow.costmodel import host_ceiling
from zenflow.harness.records import read_records
from zenflow.reports.scenario import scenario_report

NO_ENV: dict = {}  # the hardware label comes from the records themselves


def same_files(committed: Path, remade: Path, names: tuple[str, ...]) -> None:
    """Each of `names` that the remake writes is committed, byte for byte, and each committed one is remade: a
    committed table that disappears (or one the report stops writing) fails instead of leaving its check out."""
    checked = 0
    for name in names:
        made, kept = (remade / name).exists(), (committed / name).exists()
        assert made == kept, f"{committed / name}: {'remade but not committed' if made else 'committed but not remade'}"
        if kept:
            assert (remade / name).read_bytes() == (committed / name).read_bytes(), f"{committed / name} differs"
            checked += 1
    assert checked, f"{committed}: none of {names} to compare"


def remake_llama(folder: Path, tmp_path: Path) -> None:
    """`folder`'s scenario tables remade into `tmp_path` from its records, compared byte for byte."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    rates = folder / host_ceiling.FILE  # a set published with the host's rates: its table quotes the ceiling
    if rates.is_file():  # (remade without them, the "Host ceiling" line would disappear)
        (tmp_path / host_ceiling.FILE).parent.mkdir()
        shutil.copyfile(rates, tmp_path / host_ceiling.FILE)
    scenario_report(read_records(folder), tmp_path, NO_ENV)
    same_files(folder, tmp_path, ("table.md", "table.csv", "ratios.csv", "convergence.md", "convergence.csv",
                                   "step-trace.csv"))
