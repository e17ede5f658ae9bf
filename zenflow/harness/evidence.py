"""One archive that carries a GPU window's evidence back (reproduce/gpu_window.py), and its check on the way in.

What comes back from a borrowed GPU host is a folder of at most 8 files, at most 2 folders deep; a window's records
sit deeper than that (`<scenario>/.partial/*.json`, `<scenario>/host/rates.json`), so the window packs its whole
work folder into one `.tar.gz` after every phase. The archive is replaced atomically (written beside it under a
temporary name, then renamed), so a command killed at any moment leaves the previous archive whole. Its last member
is a manifest: every file's size and SHA-256, the hardware id, the scenario folder, the phases that finished. On the
CPU side `unpack` refuses, in one line, an archive that is not one (corrupt, truncated) or that lacks a file its
manifest lists or holds one that differs.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import time
import zlib
from pathlib import Path
from typing import Any, BinaryIO

from zenflow.harness.atomic import write_atomic

SCHEMA = "gpu-evidence/1"
MANIFEST = "MANIFEST.json"


class EvidenceError(RuntimeError):
    """The archive cannot be published: corrupt, incomplete, or not a window's."""


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _files(folder: Path) -> list[Path]:
    """Every plain file under `folder` but temporaries of atomic writes in progress: `*.tmp`, and the hidden
    `.name.XXXX` of atomic.write_atomic (no file the window keeps is hidden; a hidden folder, `.partial/`, is kept)."""
    return sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.endswith(".tmp")
                  and not p.name.startswith("."))


def pack(folder: Path, archive: Path, info: dict[str, Any]) -> dict[str, Any]:
    """Write `folder` (as its own name, at the archive's top) and a manifest (`info` plus every file's size and hash)
    to `archive`, atomically; the manifest."""
    manifest: dict[str, Any] = {}

    def write(f: BinaryIO) -> None:  # atomic.py's temporary file: a pack killed midway leaves the old archive whole
        with tarfile.open(fileobj=f, mode="w:gz", compresslevel=6) as tar:
            manifest.update(_pack_into(tar, folder, info))

    write_atomic(archive, write, mode="wb")
    return manifest


def _pack_into(tar: tarfile.TarFile, folder: Path, info: dict[str, Any]) -> dict[str, Any]:
    """Every file of `folder` into `tar`, then the manifest (its last member); the manifest."""
    files: dict[str, dict[str, Any]] = {}
    for path in _files(folder):
        try:
            data = path.read_bytes()  # read once: what is hashed is what is packed, even if it changes later
        except OSError:  # removed while packing (a staged record moving into place): the next pack has it
            continue
        name = f"{folder.name}/{path.relative_to(folder).as_posix()}"
        files[name] = {"bytes": len(data), "sha256": _sha256(data)}
        _add(tar, name, data)
    manifest = {"schema": SCHEMA, "folder": folder.name, "packed_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                     time.gmtime()),
                **info, "files": files}
    _add(tar, MANIFEST, json.dumps(manifest, indent=1, default=str).encode())
    return manifest


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    member = tarfile.TarInfo(name)
    member.size, member.mtime, member.mode = len(data), int(time.time()), 0o644
    tar.addfile(member, io.BytesIO(data))


def unpack(archive: Path, into: Path) -> dict[str, Any]:
    """Extract `archive` into `into` and check it against its manifest; the manifest. EvidenceError (one line) when
    it is not a readable archive, has no manifest, or a listed file is missing or differs."""
    try:
        with tarfile.open(archive, "r:gz") as tar:
            names = tar.getnames()
            tar.extractall(into, filter="data")  # no absolute paths, links out of `into` or device files
    except (tarfile.TarError, EOFError, zlib.error, OSError) as exc:
        raise EvidenceError(f"{archive} is not a readable gpu-evidence archive ({type(exc).__name__}: {exc})") from exc
    if MANIFEST not in names:
        raise EvidenceError(f"{archive} is incomplete: it has no {MANIFEST} (packing was cut short)")
    try:
        manifest = json.loads((into / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise EvidenceError(f"{archive}: its {MANIFEST} does not parse ({exc})") from exc
    if manifest.get("schema") != SCHEMA:
        raise EvidenceError(f"{archive}: schema {manifest.get('schema')!r} is not allowed: expected {SCHEMA!r}")
    bad = [name for name, want in manifest["files"].items() if _differs(into / name, want)]
    if bad:
        raise EvidenceError(f"{archive} is incomplete: {len(bad)} of {len(manifest['files'])} files its manifest "
                            f"lists are missing or differ (first: {bad[0]})")
    return manifest


def _differs(path: Path, want: dict[str, Any]) -> bool:
    try:
        data = path.read_bytes()
    except OSError:
        return True
    return len(data) != want["bytes"] or _sha256(data) != want["sha256"]
