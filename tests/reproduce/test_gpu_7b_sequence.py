"""The CPU dress rehearsal of the 7B-class sequence (reproduce/gpu_7b.py --rehearsal): the same commands at a tiny
shape, one of them killed mid-way as a device window ending would, give the same table as one uninterrupted run."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from zenflow.harness.records import read_records

ROOT = Path(__file__).resolve().parents[2]
GPU_7B = [sys.executable, str(ROOT / "reproduce" / "gpu_7b.py"), "--rehearsal", "--budget-s", "45"]
ENGINES = ["ref-offload", "ref-zenflow", "no-offload"]
DETERMINISTIC = ("engine", "runs", "bytes_ratio", "final_loss", "world_size")  # timings differ run to run


def step(out: Path, k: int) -> subprocess.CompletedProcess:
    return subprocess.run([*GPU_7B, "--out", str(out), "--step", str(k)], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)


def table(folder: Path) -> list[dict[str, str]]:
    with open(folder / "table.csv") as f:
        return [{k: row[k] for k in DETERMINISTIC} for row in csv.DictReader(f)]


def test_listed_commands_fit_a_window_and_resume():
    listed = subprocess.run([*GPU_7B, "--list"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert "--plan" in lines[0] and "host_ceiling" in lines[1] and "--report-only" in lines[-1]
    runs = lines[2:-1]
    assert len(runs) == 3  # one engine per command at this budget
    assert all("timeout -s TERM 570 " in line and line.rstrip().split("#")[0].rstrip().endswith("--resume")
               for line in runs)


def kill_everything_with(arg: str) -> int:
    """SIGKILL every process whose command line holds `arg` (gpu_7b, timeout, llama7b: each its own group)."""
    killed = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if arg.encode() in cmdline:
            try:
                os.kill(int(entry.name), signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
    return killed


def test_chunked_sequence_with_a_kill_gives_the_uninterrupted_table(tmp_path):
    chunked, whole = tmp_path / "chunked", tmp_path / "whole"
    assert step(chunked, 1).returncode == 0  # the plan
    assert step(chunked, 2).returncode == 0  # the host's rates
    assert step(chunked, 3).returncode == 0  # ref-offload
    # step 4 (ref-zenflow, then its run without telemetry) is killed hard once its first record is staged
    proc = subprocess.Popen([*GPU_7B, "--out", str(chunked), "--step", "4"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    staged = chunked / ".partial" / "ref-zenflow-r0.json"
    deadline = time.monotonic() + 300
    while not staged.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert staged.exists(), "the killed step never staged its first record"
    assert kill_everything_with(str(chunked)) >= 2  # the window ends: no cleanup of any kind
    proc.wait()
    assert (chunked / ".partial").is_dir()
    assert (chunked / "ref-offload-r0.json").exists()  # the finished step's records survive the kill
    again = step(chunked, 4)  # the same step again continues it
    assert again.returncode == 0, again.stderr
    assert "(kept: --resume)" in again.stderr
    for k in (5, 6):
        done = step(chunked, k)
        assert done.returncode == 0, done.stderr
    assert not (chunked / ".partial").exists()
    assert "Host ceiling: ref-zenflow over ref-offload" in (chunked / "table.md").read_text()
    published = tmp_path / "published"
    done = subprocess.run([*GPU_7B, "--out", str(chunked), "--step", "6", "--publish", str(published)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert (published / "host" / "rates.json").exists() and (published / "table.md").exists()
    assert sorted(p.name for p in published.glob("*.json")) == sorted(p.name for p in chunked.glob("*.json"))
    one = subprocess.run([sys.executable, str(ROOT / "reproduce" / "llama7b.py"), "--smoke", "--device", "cpu",
                          "--repeats", "1", "--engines", *ENGINES, "--out", str(whole)], capture_output=True,
                         text=True, timeout=600, cwd=ROOT)
    assert one.returncode == 0, one.stderr
    assert sorted(r.engine for r in read_records(chunked)) == sorted(r.engine for r in read_records(whole))
    assert table(chunked) == table(whole)
    losses = {r.engine + str(r.protocol.get("telemetry")): [s["loss"] for s in r.steps] for r in read_records(whole)}
    assert {r.engine + str(r.protocol.get("telemetry")): [s["loss"] for s in r.steps]
            for r in read_records(chunked)} == losses


def test_bad_arguments_are_refused_in_one_line_before_anything_runs(tmp_path):
    out = tmp_path / "out"
    for args, named in ((["--python", "/no/such/python"], "--python"), (["--step", "99"], "--step"),
                        (["--budget-s", "0"], "--budget-s")):
        done = subprocess.run([*GPU_7B, "--out", str(out), *args], capture_output=True, text=True, timeout=120,
                              cwd=ROOT)
        assert done.returncode == 2, (args, done.stderr)
        (line,) = done.stderr.strip().splitlines()
        assert named in line and "not allowed" in line
        assert not out.exists()
