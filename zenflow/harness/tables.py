"""Table helpers every report shares: number format, Markdown, CSV, atomic writes (from atomic.py), the figure
backend and how a figure is saved.

One copy of each, so that every committed table and figure is written the same way
(tests/reports/test_committed_tables.py regenerates them byte for byte). Reports (zenflow/reports/) read records and
rows; these helpers only format and write.
"""

from __future__ import annotations

import csv
import numbers
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tabulate import tabulate

# The atomic writes live in atomic.py (standard library only, for the GPU window); the reports take them from here.
from zenflow.harness.atomic import write_atomic as write_atomic
from zenflow.harness.atomic import write_json_atomic as write_json_atomic
from zenflow.harness.atomic import write_text_atomic as write_text_atomic

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
