"""Writing a file atomically: a reader, or a command killed at any moment, sees the old file or the whole new one.

The new content fills a hidden temporary file in the same folder (`.NAME.XXXXXXXX`: same file system, so the rename
is atomic; hidden, so evidence.pack and folder listings skip a write in progress), is flushed to disk (fsync: after
a power loss the rename cannot point at an empty file), then renamed over the target. A write that raises removes
its temporary file.

Standard library only: the GPU window (window.py, evidence.py) runs on a host that has the interpreter and torch but
not the harness's packages, and tables.py re-exports these for the rest of the harness.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def write_atomic(path: Path, write: Callable[[Any], None], mode: str = "w", newline: str | None = None) -> Path:
    """`write(f)` fills a temporary file (opened in `mode`, "wb" for bytes; `newline` as open() takes it) that then
    replaces `path` whole; the folder is made if missing. Returns `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, mode, newline=newline) as f:
            os.fchmod(f.fileno(), 0o644)  # mkstemp's 0600 would keep the file from its readers
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # Ctrl-C and SIGTERM's SystemExit too: no half-written temporary left behind
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_text_atomic(path: Path, text: str) -> Path:
    return write_atomic(path, lambda f: f.write(text))


def write_json_atomic(path: Path, data: Any, default: Callable[[Any], Any] = str) -> Path:
    """`data` as JSON (indent 1, the records' layout, no final newline), atomically."""
    return write_atomic(path, lambda f: json.dump(data, f, indent=1, default=default))


def copy_atomic(src: Path, dst: Path) -> Path:
    """A copy of `src` at `dst`, atomically (a file still being appended to: what it holds now)."""
    with open(src, "rb") as source:
        return write_atomic(dst, lambda f: shutil.copyfileobj(source, f), mode="wb")
