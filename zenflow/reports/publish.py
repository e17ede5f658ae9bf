"""A GPU window's archive into the result folders (reproduce/gpu_window.py --publish), on the CPU side.

The archive is checked first (harness/evidence.py: readable, every file its manifest lists present and unchanged);
then its sets go where every other set of their kind lives, and their tables and figures are made here from the
records alone, as `--report-only` would:

    gpu-check/<hardware-id>/           gpu-check.json, table.md, figure.png; window/: facts, phases, the logs
    llama7b/<hardware-id>/<scenario>/  the run records, host/rates.json, table.md/.csv, ratios.csv, figure.png

A `cpu-scale-*` hardware id is a CPU's: refused for the repository's results/ (cpu-scale numbers never stand as a
GPU's), allowed with `--into` (the CPU dress rehearsal publishes there). Records of runs that were interrupted
mid-way are left out (no steps to show); ok, skipped ("out of time", "does not fit") and failed ones are kept.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from zenflow.costmodel import host_ceiling
from zenflow.harness.checks import gpu as gpu_check
from zenflow.harness.checks import render
from zenflow.harness.evidence import EvidenceError, unpack
from zenflow.harness.records import RunRecord
from zenflow.harness.result_sets import PARTIAL
from zenflow.harness.runner import INTERRUPTED  # a run stopped by the window's SIGTERM: not a finding
from zenflow.harness.tables import write_text_atomic
from zenflow.reports.scenario import scenario_report

RESULTS = Path(__file__).resolve().parents[2] / "results"
WINDOW_FILES = ("phases.json", "run.log", "op-build.log", "facts/facts.json", "facts/nvidia-smi.txt",
                "facts/pip-list.txt")


class PublishError(RuntimeError):
    """The archive cannot be published here (one line: why)."""


def publish_window(archive: Path, into: Path | None = None, replace: bool = False) -> list[str]:
    """Publish `archive` into `into` (default: the repository's results/); what was written, a line each. A set
    already there is refused unless `replace`, which clears it first: two windows are never merged (a second
    window's cut runs would replace the first's finished ones, and the table would show one of them)."""
    root = RESULTS if into is None else Path(into)
    with tempfile.TemporaryDirectory(prefix="gpu-evidence-") as tmp:
        try:
            manifest = unpack(Path(archive), Path(tmp))
        except EvidenceError as exc:
            raise PublishError(str(exc)) from exc
        work = Path(tmp) / manifest["folder"]
        hardware = manifest.get("hardware_id") or hardware_fallback(work, manifest.get("scenario"))
        if not hardware:
            raise PublishError(f"{archive}: no hardware id (the window's facts phase did not finish, and neither "
                               "the checks' record nor any run record names one): nothing to file it under")
        if hardware.startswith("cpu-scale") and root.resolve() == RESULTS.resolve():
            raise PublishError(f"{archive}: hardware id {hardware!r} is not allowed in results/: a cpu-scale set "
                               "(the CPU rehearsal?) never stands as a GPU's; expected a GPU host's, or --into DIR")
        checks, scenario = work / "gpu-check" / "gpu-check.json", work / manifest["scenario"]
        dests = {root / "gpu-check" / hardware: checks.is_file(),
                 root / "llama7b" / hardware / manifest["scenario"]: scenario.is_dir()}
        for dest in (d for d, used in dests.items() if used and d.exists()):
            if not replace:
                raise PublishError(f"{dest} already holds a set (an earlier window?): two windows are never "
                                   "merged; --replace clears it first")
            shutil.rmtree(dest)
        written = []
        if checks.is_file():
            written.append(_gpu_check(work, root / "gpu-check" / hardware))
        if scenario.is_dir():
            written.append(_scenario(scenario, root / "llama7b" / hardware / manifest["scenario"],
                                     _facts_environment(work)))
    return written


def _facts_environment(work: Path) -> dict:
    """The window's environment record (facts/), the hardware label of a set whose records have none (every run
    skipped, or failed before it started)."""
    try:
        return json.loads((work / "facts" / "environment.json").read_text())
    except (OSError, ValueError):
        return {}


def hardware_fallback(work: Path, scenario: str | None) -> str | None:
    """The hardware id where the facts phase left none: the checks' record's environment, then
    the first run record that has one."""
    try:
        found = json.loads((work / "gpu-check" / "gpu-check.json").read_text())["environment"]["hardware_id"]
    except (OSError, ValueError, KeyError, TypeError):
        found = None
    if found or not scenario:
        return found
    for folder in (work / scenario, work / scenario / PARTIAL):
        for path in sorted(folder.glob("*.json")):
            try:
                found = RunRecord.read(path).environment.get("hardware_id")
            except (OSError, ValueError, TypeError, KeyError):
                continue
            if found:
                return found
    return None


def _gpu_check(work: Path, dest: Path) -> str:
    """The checks' record as it came, its table and figure made here (this side's tabulate, as the committed-table
    test remakes them), and the window's facts beside them."""
    dest.mkdir(parents=True, exist_ok=True)
    record = json.loads((work / "gpu-check" / "gpu-check.json").read_text())
    shutil.copyfile(work / "gpu-check" / "gpu-check.json", dest / "gpu-check.json")
    write_text_atomic(dest / "table.md", gpu_check.markdown(record))
    render.figure(record, dest / "figure.png")
    for name in WINDOW_FILES:
        if (work / name).is_file():
            (dest / "window").mkdir(exist_ok=True)
            shutil.copyfile(work / name, dest / "window" / Path(name).name)
    return f"gpu-check: {dest} ({sum(c['status'] == 'pass' for c in record['checks'])} of "\
           f"{len(record['checks'])} checks passed)"


def _scenario(scenario: Path, dest: Path, environment: dict) -> str:
    """The scenario's records (a plan cut short has them in .partial/), the host's rates, the table made here."""
    found: dict[str, tuple[Path, RunRecord]] = {}
    for folder in (scenario, scenario / PARTIAL):  # a staged record is the newer one of its name
        for path in sorted(folder.glob("*.json")):
            if not path.name.startswith("."):
                found[path.name] = (path, RunRecord.read(path))
    kept = {name: pr for name, pr in found.items() if not (pr[1].error or "").startswith(INTERRUPTED)}
    if not kept:
        return f"llama7b: nothing to publish from {scenario.name} (no run ended)"
    dest.mkdir(parents=True, exist_ok=True)
    for name, (path, _) in kept.items():
        shutil.copyfile(path, dest / name)
    rates = scenario / host_ceiling.FILE
    if rates.is_file():
        (dest / host_ceiling.FILE).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(rates, dest / host_ceiling.FILE)
    records = [record for _, record in kept.values()]
    scenario_report(records, dest, environment)  # the label from the records, else from the window's facts
    ok = sum(r.status == "ok" for r in records)
    return f"llama7b: {dest} ({ok} ok, {len(records) - ok} skipped or failed of {len(records)} records)"
