"""The one atomic write (zenflow/harness/atomic.py): whole or not at all, on disk before the rename, and importable
with nothing but the standard library, as the GPU window needs it."""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

import pytest

from zenflow.harness import atomic
from zenflow.harness.evidence import pack, unpack

ROOT = Path(__file__).resolve().parents[2]
# Modules a bare GPU host runs (reproduce/gpu_window.py): each may import the standard library and these only.
BARE = {"zenflow.harness.atomic", "zenflow.harness.evidence", "zenflow.harness.window", "zenflow.harness.deadline"}


def project_imports(module: str) -> set[str]:
    """The top modules `module` imports anywhere in its file (the standard library named as such)."""
    tree = ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found |= {f"{node.module}.{a.name}" if node.module == "zenflow.harness" else node.module
                      for a in node.names}
    return found


@pytest.mark.parametrize("module", sorted(BARE))
def test_the_gpu_window_modules_import_only_the_standard_library(module):
    outside = {m for m in project_imports(module) if m.split(".")[0] not in sys.stdlib_module_names and m not in BARE}
    assert not outside, f"{module} imports {sorted(outside)}: a bare GPU host has only the standard library"


def test_a_write_replaces_the_file_whole_readable_by_all(tmp_path):
    path = tmp_path / "sub" / "r.json"  # the folder is made
    atomic.write_json_atomic(path, {"a": 1})
    atomic.write_text_atomic(path, "two\n")
    assert path.read_text() == "two\n" and path.stat().st_mode & 0o777 == 0o644
    assert [p.name for p in path.parent.iterdir()] == ["r.json"]


@pytest.mark.parametrize("fail", ["write", "fsync"])
def test_a_write_that_fails_midway_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch, fail):
    path = tmp_path / "r.txt"
    atomic.write_text_atomic(path, "old\n")

    def half(f):
        f.write("ne")
        if fail == "write":
            raise KeyboardInterrupt  # Ctrl-C midway

    if fail == "fsync":
        monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises((KeyboardInterrupt, OSError)):
        atomic.write_atomic(path, half)
    assert path.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["r.txt"]


def test_the_data_is_on_disk_before_the_rename(tmp_path, monkeypatch):
    order = []
    monkeypatch.setattr(os, "fsync", lambda fd: order.append("fsync"))
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (order.append("replace"), real_replace(a, b)))
    atomic.write_text_atomic(tmp_path / "r.txt", "x")
    assert order == ["fsync", "replace"]


def test_copy_atomic_copies_bytes(tmp_path):
    src = tmp_path / "log"
    src.write_bytes(b"line 1\nline \xff\n")
    atomic.copy_atomic(src, tmp_path / "out" / "log")
    assert (tmp_path / "out" / "log").read_bytes() == src.read_bytes()


def test_a_pack_killed_midway_leaves_the_previous_archive_whole(tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    (work / "a.txt").write_text("first")
    archive = tmp_path / "e.tar.gz"
    pack(work, archive, {"hardware_id": "gpu-x"})
    before = archive.read_bytes()
    (work / "b.txt").write_text("second")
    real = Path.read_bytes

    def killed(self):
        if self.name == "b.txt":
            raise SystemExit(143)  # SIGTERM's handler, halfway through the members
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", killed)
    with pytest.raises(SystemExit):
        pack(work, archive, {"hardware_id": "gpu-x"})
    monkeypatch.undo()
    assert archive.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["e.tar.gz", "work"]
    assert set(unpack(archive, tmp_path / "in")["files"]) == {"work/a.txt"}
