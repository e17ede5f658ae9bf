"""The dress rehearsal of the one-command GPU window (reproduce/gpu_window.py --rehearsal): the same phases
on the CPU at a tiny shape, under a deadline that cuts the engine list; the archive after every phase; a SIGTERM
mid-scenario still leaves a valid archive; --publish of either gives the tables."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from remake import remake_llama

from zenflow.harness.evidence import MANIFEST
from zenflow.harness.records import read_records
from zenflow.reports.gpu_claims import gpu_section

ROOT = Path(__file__).resolve().parents[2]
WINDOW = [sys.executable, str(ROOT / "reproduce" / "gpu_window.py")]
sys.path.insert(0, str(ROOT / "reproduce"))
import gpu_window  # noqa: E402

from zenflow.harness.checks.gpu import CHECKS  # noqa: E402

pytestmark = pytest.mark.script  # scripts end to end (tests/README.md)

PHASES = [p.name for p in gpu_window.PHASES] + ["end"]  # as phases.json lists them: the table's, then the close


def manifest(archive: Path) -> dict | None:
    """The manifest of the archive as it is now (None before the first pack)."""
    try:
        with tarfile.open(archive, "r:gz") as tar:
            return json.load(tar.extractfile(MANIFEST))
    except (FileNotFoundError, KeyError):
        return None


@pytest.fixture(scope="module")
def op_built():
    """DeepSpeed's CPU Adam op in the checkout's cache before the timed windows, so that a cold cache (a clean
    clone: ~85 s on 2 cores) does not eat their budgets; the window's own build then only loads it."""
    env = gpu_window.child_env(None)
    done = subprocess.run([sys.executable, "-c", gpu_window.OP_BUILD], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory, op_built):
    """One rehearsal whose deadline cuts the engine list, watched from outside: the manifests seen while it ran."""
    tmp = tmp_path_factory.mktemp("window")
    out, work = tmp / "out", tmp / "work"
    proc = subprocess.Popen([*WINDOW, "--rehearsal", "--out", str(out), "--work", str(work), "--budget-s", "70"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    while proc.poll() is None:
        m = manifest(out / "gpu-evidence.tar.gz")
        if m and (not seen or m["phases_ok"] != seen[-1]):
            seen.append(m["phases_ok"])
        time.sleep(0.2)
    log = proc.stdout.read()
    return proc.returncode, out, work, seen, log


def test_the_rehearsal_runs_every_phase_and_the_deadline_cuts_the_engine_list(rehearsal):
    code, out, work, seen, log = rehearsal
    assert code == 0, log[-4000:]
    assert sorted(p.name for p in out.iterdir()) == ["gpu-evidence.tar.gz", "run.log"]  # 2 of the 8 files
    phases = json.loads((work / "phases.json").read_text())
    assert [p["phase"] for p in phases] == PHASES and all(p["status"] == "ok" for p in phases), phases
    records = read_records(work / "smoke")
    assert {r.engine for r in records} == set(gpu_window.ENGINES)  # every engine has a record: run, or cut
    cut = [r for r in records if r.status == "skipped"]
    ran = [r for r in records if r.status == "ok"]
    assert ran and cut, [(r.engine, r.status) for r in records]
    assert all(r.error.startswith("out of time") for r in cut)
    order = {e: i for i, e in enumerate(gpu_window.ENGINES)}  # the list is cut, not shuffled: ok ones come first
    assert max(order[r.engine] for r in ran if r.protocol.get("telemetry")) < min(order[r.engine] for r in cut
                                                                                  if r.protocol.get("telemetry"))
    for r in ran:  # budgets from measurement: each run's wall time and fixed cost
        assert r.metrics["wall_seconds"] > r.metrics["fixed_seconds"] > 0
    check = json.loads((work / "gpu-check" / "gpu-check.json").read_text())
    for row, c in zip(CHECKS, check["checks"], strict=True):  # the window runs the checks its rows say
        assert "seconds" in c if row.window else "not asked" in c["reason"], c
    assert (work / "facts" / "facts.json").is_file() and (work / "smoke" / "host" / "rates.json").is_file()


def test_the_archive_is_packed_after_every_phase(rehearsal):
    _, out, _, seen, _ = rehearsal
    assert seen[-1] == PHASES
    # the states between phases came back too: after the wheels probe, after the facts (the checks run 8+ s then)
    assert PHASES[:1] in seen and PHASES[:2] in seen, seen
    assert [s for s in seen if s == sorted(s, key=PHASES.index)] == seen  # phases only ever added, in order


def test_publish_gives_the_tables_and_refuses_a_cpu_set_in_results(rehearsal, tmp_path):
    _, out, _, _, _ = rehearsal
    archive = out / "gpu-evidence.tar.gz"
    done = subprocess.run([*WINDOW, "--publish", str(archive), "--into", str(tmp_path)], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    (hw,) = [p.name for p in (tmp_path / "llama7b").iterdir()]
    table = (tmp_path / "llama7b" / hw / "smoke" / "table.md").read_text()
    assert "(skipped: out of time)" in table and "Host ceiling" in table
    assert (tmp_path / "llama7b" / hw / "smoke" / "host" / "rates.json").is_file()
    remake_llama(tmp_path / "llama7b" / hw / "smoke", tmp_path / "remade")  # what the committed-table test does
    png = (tmp_path / "gpu-check" / hw / "figure.png").read_bytes()
    assert int.from_bytes(png[16:20], "big") == 7 * 120  # no engine ran: the differential alone, no empty panel
    assert (tmp_path / "gpu-check" / hw / "window" / "phases.json").is_file()
    # the claims page's GPU rows read such a set, and only a GPU's (a cpu-scale id is never one of them): the set
    # named as a GPU set's first, so that only its cpu-scale hardware id keeps it out
    (tmp_path / "llama7b" / hw / "smoke").rename(tmp_path / "llama7b" / hw / "llama2-7b-4L")
    assert hw.startswith("cpu-scale") and "no GPU set committed yet" in gpu_section(tmp_path)
    for kind in ("llama7b", "gpu-check"):
        (tmp_path / kind / hw).rename(tmp_path / kind / "nvidia-test-gpu")
    section = gpu_section(tmp_path)
    (row,) = [line for line in section.splitlines() if line.startswith("| [nvidia-test-gpu")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    records = read_records(tmp_path / "llama7b" / "nvidia-test-gpu" / "llama2-7b-4L")
    ran = sum(r.status == "ok" and r.protocol.get("telemetry", True) for r in records)
    assert cells[6] == f"{ran} / {len(gpu_window.ENGINES) - ran}"  # every engine of the window: run or cut
    # ref-zenflow's speedup is over ds-zero-offload's step: one run of each when the deadline left both, else none
    both = {r.engine for r in records if r.status == "ok"} >= {"ref-zenflow", "ds-zero-offload"}
    assert cells[1].endswith("(1 run)") if both else cells[1] in ("—", "not run"), (cells[1], both)
    assert cells[7].startswith(time.strftime("%Y-%m-%d"))
    refused = subprocess.run([*WINDOW, "--publish", str(archive)], capture_output=True, text=True, timeout=300,
                             cwd=ROOT)
    assert refused.returncode == 2 and "cpu-scale" in refused.stderr and len(refused.stderr.splitlines()) == 1


def test_publish_refuses_a_corrupt_or_incomplete_archive_in_one_line(rehearsal, tmp_path):
    _, out, _, _, _ = rehearsal
    data = (out / "gpu-evidence.tar.gz").read_bytes()
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(data[: len(data) // 2])  # a copy broken off mid-way
    garbage = tmp_path / "garbage.tar.gz"
    garbage.write_bytes(b"not an archive")
    for bad in (cut, garbage):
        done = subprocess.run([*WINDOW, "--publish", str(bad), "--into", str(tmp_path / "pub")], capture_output=True,
                              text=True, timeout=300, cwd=ROOT)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert "not a readable" in done.stderr or "incomplete" in done.stderr
        assert not (tmp_path / "pub").exists()


def test_a_sigterm_mid_scenario_leaves_a_valid_archive_that_publishes(op_built, tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    proc = subprocess.Popen([*WINDOW, "--rehearsal", "--out", str(out), "--work", str(work), "--budget-s", "300"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    marker = work / "smoke" / ".partial" / "PARTIAL"  # "UNFINISHED: k of n runs have ok or skipped records"
    while not finished_runs(marker) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert finished_runs(marker), "the scenario never finished its first run"
    proc.send_signal(signal.SIGTERM)  # the device window's end, as timeout(1) or a job scheduler sends it
    assert proc.wait(timeout=90) == 143
    m = manifest(out / "gpu-evidence.tar.gz")
    assert m is not None and "scenario" not in m["phases_ok"]
    assert f"{m['folder']}/smoke/.partial/ref-zenflow-r0.json" in m["files"]
    phases = json.loads((work / "phases.json").read_text())
    assert phases[-1]["phase"] == "end" and phases[-1]["status"].startswith("stopped")
    assert not processes_with(str(work)), "a child of the window outlived it"
    done = subprocess.run([*WINDOW, "--publish", str(out / "gpu-evidence.tar.gz"), "--into", str(tmp_path / "pub")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    (hw,) = [p.name for p in (tmp_path / "pub" / "llama7b").iterdir()]
    names = {r.engine for r in read_records(tmp_path / "pub" / "llama7b" / hw / "smoke")}
    assert "ref-zenflow" in names and (tmp_path / "pub" / "llama7b" / hw / "smoke" / "table.md").is_file()


def finished_runs(marker: Path) -> int:
    try:
        return int(re.search(r": (\d+) of", marker.read_text()).group(1))
    except (OSError, AttributeError):
        return 0


def processes_with(arg: str) -> list[int]:
    """Processes whose command line mentions `arg` (the window's children do: their --out is under its work)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if arg.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_the_scenario_phase_watches_its_folder_and_ends_its_runs_before_the_window(tmp_path, monkeypatch):
    """Without a rehearsal: the scenario phase runs with `watch` on its folder, so that every run
    record that appears packs the archive at once (window.py's point 4: a SIGKILL mid-scenario keeps every run that
    ended), and its runs' deadline leaves SCENARIO_RESERVE_S of the window for the scenario's table and figure."""
    calls = []

    def run(w, cmd, timeout_s, env=None, watch=None, preexec=None):
        calls.append({"cmd": cmd, "timeout_s": timeout_s, "watch": watch})
        return 0

    monkeypatch.setattr(gpu_window.Window, "run", run)
    monkeypatch.setattr(gpu_window, "install_wheels", lambda w: (None, False))
    monkeypatch.setattr(gpu_window, "facts", lambda w, env: "cpu-scale-test")
    monkeypatch.setattr(gpu_window, "probe", lambda env, imports=None: "no DeepSpeed here")  # no op build
    monkeypatch.setattr(gpu_window, "git_commit", lambda: None)
    args = gpu_window.parse_args(["--rehearsal", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"),
                                  "--budget-s", "300"])
    assert gpu_window.window(args) == 0
    (scenario,) = [c for c in calls if Path(c["cmd"][1]).name == "llama7b.py"]
    assert scenario["watch"] == tmp_path / "work" / "smoke"
    deadline_s = float(scenario["cmd"][scenario["cmd"].index("--deadline-s") + 1])
    assert deadline_s <= scenario["timeout_s"] - gpu_window.SCENARIO_RESERVE_S + 1  # +1: the flag is rounded


def test_the_docs_list_the_phases_of_the_table_in_order():
    """docs/gpu-window.md's table of phases names PHASES' rows, in their order: adding a phase is its row and its
    line there."""
    docs = (ROOT / "docs" / "gpu-window.md").read_text()
    rows = re.findall(r"^\| ([a-z-]+) \|", docs, re.MULTILINE)
    assert [r for r in rows if r != "phase"] == [p.name for p in gpu_window.PHASES]
    checks = [c.name for c in CHECKS if c.window]
    assert gpu_window.CHECKS == ",".join(checks) and checks and "engines" not in checks


def test_bad_arguments_are_refused_in_one_line_before_anything_runs(tmp_path):
    out = tmp_path / "out"
    for args, named in ((["--budget-s", "5"], "--budget-s"), (["--layers", "0"], "--layers"),
                        (["--publish", str(tmp_path / "none.tar.gz")], "--publish"),
                        (["--into", str(tmp_path)], "--into"), ([], "--out")):
        done = subprocess.run([*WINDOW, *(["--out", str(out)] if named != "--out" else []), *args],
                              capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert done.returncode == 2, (args, done.stderr)
        (line,) = done.stderr.strip().splitlines()
        assert named in line
        assert not out.exists()


def test_the_probe_imports_for_real(tmp_path):
    """A package that find_spec finds but that fails to import (a half-installed DeepSpeed) must
    count as missing, so the window installs the wheels or drops the ds engines instead of failing every ds run."""
    broken = tmp_path / "deepspeed"
    broken.mkdir()
    (broken / "__init__.py").write_text("import hjson_that_is_not_there\n")
    env = {**gpu_window.child_env(None), "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    assert "hjson_that_is_not_there" in gpu_window.probe(env)
    assert gpu_window.probe(gpu_window.child_env(None)) is None  # the control: the real one imports here
