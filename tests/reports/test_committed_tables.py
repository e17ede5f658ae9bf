"""Every committed table is made from its committed records only: remaking it from them gives the same bytes
(tables and figures read records only; a change of schema or report shows up here)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from remake import remake_llama
from remake import same_files as _same_files

from zenflow.costmodel.presets import load_calibration
from zenflow.costmodel.projection import projection
from zenflow.costmodel.validate import validation, validation_dating
from zenflow.harness.checks import gpu as gpu_check
from zenflow.harness.records import read_records
from zenflow.reports.cores import cores_report
from zenflow.reports.costmodel import committed_runs, write_falsifiable, write_projection, write_validation
from zenflow.reports.glue import parity_report
from zenflow.reports.glue_study import SETTINGS, study_report
from zenflow.reports.regime import by_point, regime_report
from zenflow.reports.scaling import scaling_report

RESULTS = Path(__file__).resolve().parents[2] / "results"
NO_ENV: dict = {}  # the hardware label comes from the records themselves


def _sets(pattern: str) -> list[Path]:
    return sorted(p.parent for p in RESULTS.glob(pattern)) or pytest.fail(f"no committed {pattern} to check")


@pytest.mark.parametrize("folder", _sets("llama7b/**/table.md"), ids=lambda p: str(p.relative_to(RESULTS)))
def test_llama_table_regenerates_byte_identical(folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    remake_llama(folder, tmp_path)


@pytest.mark.parametrize("folder", _sets("llama7b/**/cores.md"), ids=lambda p: str(p.relative_to(RESULTS)))
def test_cores_table_regenerates_byte_identical(folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cores_report(read_records(folder), tmp_path, NO_ENV)
    _same_files(folder, tmp_path, ("cores.md", "cores.csv"))


@pytest.mark.parametrize("folder", [p for p in _sets("glue/**/table.md") if p.name != "study"],
                         ids=lambda p: str(p.relative_to(RESULTS / "glue")))
def test_glue_table_regenerates_byte_identical(folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    parity_report(read_records(folder), tmp_path, NO_ENV)
    _same_files(folder, tmp_path, ("table.md", "table.csv", "parity.csv", "curve.md", "curve.csv"))


@pytest.mark.parametrize("folder", _sets("glue/*/study/table.md"), ids=lambda p: p.parent.name)
def test_glue_study_table_regenerates_byte_identical(folder: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture) -> None:
    settings = {name: read_records(folder / name) for name in SETTINGS if (folder / name).is_dir()}
    study_report(read_records(folder.parent), settings, tmp_path)
    _same_files(folder, tmp_path, ("table.md", "table.csv"))


@pytest.mark.parametrize("folder", _sets("scaling/*/table.md"), ids=lambda p: p.name)
def test_scaling_table_regenerates_byte_identical(folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    runs = sorted((RESULTS / "llama7b" / folder.name).glob("nproc-*"))
    scaling_report([r for run in runs for r in read_records(run)], tmp_path, NO_ENV)
    _same_files(folder, tmp_path, ("table.md",))


@pytest.mark.parametrize("folder", _sets("costmodel/*/calibration.json"), ids=lambda p: p.name)
def test_costmodel_tables_regenerate_byte_identical(folder: Path, tmp_path: Path) -> None:
    cal = load_calibration(folder / "calibration.json", folder.name)
    runs = committed_runs(folder)  # the same-day sample or the full validation, as validation.json says
    rows = validation(cal, folder.name, runs=runs)
    if rows:
        write_validation(rows, tmp_path, cal, validation_dating(cal, folder.name, runs=runs))
    write_projection(projection(cal), tmp_path, cal)
    _same_files(folder, tmp_path, ("validation.md", "validation.csv", "validation.json", "projection.md",
                                   "projection.csv"))
    # the inverse check, the band and the figure's inputs, where committed (one of them gone fails)
    falsifiable = ("inverse.md", "inverse.json", "projection-band.md", "projection-band.csv")
    if any((folder / name).exists() for name in falsifiable):
        write_falsifiable(cal, rows, tmp_path, folder / "host-adam.json")
        _same_files(folder, tmp_path, falsifiable)


@pytest.mark.parametrize("folder", _sets("gpu-check/*/gpu-check.json"), ids=lambda p: p.name)
def test_gpu_check_table_regenerates_byte_identical(folder: Path) -> None:
    record = json.loads((folder / "gpu-check.json").read_text())
    assert gpu_check.markdown(record) == (folder / "table.md").read_text()


@pytest.mark.parametrize("folder", _sets("knobs/*/knobs.md"), ids=lambda p: p.name)
def test_knobs_table_regenerates_byte_identical(folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import sys

    sys.path.insert(0, str(RESULTS.parent / "reproduce"))
    from knobs import WORKLOADS, study_records  # reproduce/knobs.py: the records its report reads

    from zenflow.reports.knobs import knobs_report

    by_workload = {w: study_records(folder / WORKLOADS[w]) for w in WORKLOADS if (folder / WORKLOADS[w]).is_dir()}
    knobs_report({w: r for w, r in by_workload.items() if r}, tmp_path, NO_ENV)
    _same_files(folder, tmp_path, ("knobs.md", "knobs.csv", "verdict.json"))


@pytest.mark.parametrize("folder", _sets("regime/**/regime.md"), ids=lambda p: str(p.relative_to(RESULTS)))
def test_regime_tables_regenerate_byte_identical(folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    records = read_records(folder)
    calibration = folder / "costmodel" / "calibration.json"  # the day's, which the sweep's validation predicts from
    if calibration.is_file():
        (tmp_path / "costmodel").mkdir()
        shutil.copy(calibration, tmp_path / "costmodel")
    regime_report(records, tmp_path, NO_ENV)
    _same_files(folder, tmp_path, ("regime.md", "regime.csv"))
    if calibration.is_file():
        _same_files(folder / "costmodel", tmp_path / "costmodel", ("validation.md", "validation.csv",
                                                                    "validation.json"))
    for tokens in by_point(records):  # each point's own scenario tables
        _same_files(folder / f"tokens-{tokens}", tmp_path / f"tokens-{tokens}", ("table.md", "table.csv", "ratios.csv"))
