"""Table helpers every report shares: number format, Markdown, CSV, atomic writes, the figure backend and how a
figure is saved.

One copy of each, so that every committed table and figure is written the same way
(tests/reports/test_committed_tables.py regenerates them byte for byte). Reports (zenflow/reports/) read records and
rows; these helpers only format and write.
"""

from __future__ import annotations

import csv
import json
import numbers
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tabulate import tabulate

MISSING = "—"  # the cell of a value that is not there (not run, not measured)
FIGURE_DPI = 130  # every report figure's resolution


def fmt(value: Any, spec: str = ".1f", missing: str = MISSING, suffix: str = "") -> str:
    """A number in `spec` followed by `suffix` ("×", "%"), `missing` for None, anything else (text, a flag) as
    str()."""
    if value is None:
        return missing
    if isinstance(value, bool) or not isinstance(value, numbers.Number):
        return str(value)
    return format(value, spec) + suffix


def markdown(body: Sequence[Sequence[Any]], headers: Sequence[str], tablefmt: str = "github") -> str:
    """A GitHub Markdown table of already formatted cells (no number parsing: "1.10" stays "1.10")."""
    return tabulate(body, headers=headers, tablefmt=tablefmt, disable_numparse=True)


def compact_markdown(body: Sequence[Sequence[str]], headers: Sequence[str]) -> str:
    """A Markdown table without padding (`| a | b |`), for tables of long cells that sit in prose."""
    for cell in (*headers, *(c for row in body for c in row)):
        if "|" in cell or "\n" in cell:
            raise ValueError(f"a Markdown table cell cannot hold '|' or a line break: {cell!r}")
    lines = [headers, ["---"] * len(headers), *body]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines)


def write_csv(rows: Sequence[Any], path: Path, header: Sequence[str] | None = None) -> Path:
    """Dict rows under their first row's keys (no rows: an empty header line), or list rows under `header`;
    atomically (write_atomic)."""
    def write(f: Any) -> None:
        if header is None:
            writer: Any = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else [])
            writer.writeheader()
        else:
            writer = csv.writer(f)
            writer.writerow(header)
        writer.writerows(rows)

    return write_atomic(path, write, newline="")  # the csv module ends its lines itself ("\r\n")


def read_csv(path: Path) -> list[dict[str, Any]]:
    """A table.csv's rows as write_csv wrote them: numbers as floats, empty cells None, other text as it is."""
    def value(text: str) -> Any:
        try:
            return float(text)
        except ValueError:
            return text or None

    with open(path, newline="") as f:
        return [{k: value(v) for k, v in row.items()} for row in csv.DictReader(f)]


def write_atomic(path: Path, write: Callable[[Any], None], mode: str = "w", newline: str | None = None) -> Path:
    """Atomic: a reader (or a command killed mid-write) sees the old file or the whole new one: `write(f)` fills a
    temporary file in the same folder (opened in `mode`, "wb" for bytes; `newline` as open() takes it), flushed to
    disk, renamed over `path`."""
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
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_text_atomic(path: Path, text: str) -> Path:
    return write_atomic(path, lambda f: f.write(text))


def write_json_atomic(path: Path, data: Any, default: Callable[[Any], Any] = str) -> Path:
    """`data` as JSON (indent 1, the records' layout), atomically."""
    return write_atomic(path, lambda f: json.dump(data, f, indent=1, default=default))


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (files only, no display): every figure's backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path, dpi: int = FIGURE_DPI) -> Path:
    """Every figure's last step: laid out tight, written atomically at `dpi` in the format of `path`'s suffix, and
    closed (pyplot keeps open figures alive)."""
    path = Path(path)
    fig.tight_layout()
    try:
        return write_atomic(path, lambda f: fig.savefig(f, dpi=dpi, format=path.suffix.lstrip(".") or None),
                            mode="wb")
    finally:
        pyplot().close(fig)
