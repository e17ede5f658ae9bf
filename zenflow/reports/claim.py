"""One claim of the claims page: the paper's statement, the committed files it reads, the numbers it takes from them,
a headline, a verdict by a rule stated in advance, and the detail under the table.

Every cell is a template over the numbers (str.format fields), so no number on the page is typed by hand; a missing
file is an error, never a skipped row. The verdict is computed from the same numbers by the claim's own rule, whose
wording (`rule`) is printed beside it, so a reader can check the one against the other.
"""

from __future__ import annotations

import json
import string
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zenflow.harness.records import unpack_steps
from zenflow.harness.tables import read_csv

# The verdicts a claim may reach, and nothing else: a rule returns one of these.
HOLDS, PARTLY, DOES_NOT_HOLD, NO_DIFFERENCE = "holds", "partly", "does not hold", "no difference"
NOT_MEASURED, PROJECTED_ONLY = "not measured here", "projected only"
VERDICTS = (HOLDS, PARTLY, DOES_NOT_HOLD, NO_DIFFERENCE, NOT_MEASURED, PROJECTED_ONLY)
CELL_LIMIT = 120  # characters of a table cell once formatted: a headline, not a paragraph


class ClaimError(RuntimeError):
    """A claim cannot be made from the committed files (one is missing, or not among the claim's files)."""


class Files:
    """The committed files of one claim: only those it declares can be read, and a missing one is an error."""

    def __init__(self, root: Path, names: tuple[str, ...]) -> None:
        self.root, self.names = root, names

    def path(self, name: str) -> Path:
        if name not in self.names:
            raise ClaimError(f"{name} is not among the claim's files {self.names}")
        path = self.root / name
        if not path.is_file():
            raise ClaimError(f"{path}: a committed file this claim reads is missing (rerun its command)")
        return path

    def csv(self, name: str) -> list[dict[str, Any]]:
        """Rows of a CSV table, numbers as floats, empty cells None."""
        return read_csv(self.path(name))

    def by(self, name: str, key: str) -> dict[Any, dict[str, Any]]:
        return {row[key]: row for row in self.csv(name)}

    def json(self, name: str) -> Any:
        """A JSON file; a run record's steps unpacked (records.PACK_STEPS_AT)."""
        data = json.loads(self.path(name).read_text())
        if isinstance(data, dict) and "steps" in data and "schema_version" in data:
            data["steps"] = unpack_steps(data["steps"])
        return data

    def markdown_table(self, name: str, index: int) -> list[dict[str, str]]:
        """The `index`-th GitHub table of a Markdown file, as rows of header → cell text."""
        tables, current = [], []
        for line in self.path(name).read_text().splitlines() + [""]:
            if line.startswith("|"):
                current.append([c.strip() for c in line.strip().strip("|").split("|")])
            elif current:
                tables.append(current)
                current = []
        head, _, *body = tables[index]
        return [dict(zip(head, row)) for row in body]

    def run_minutes(self, name: str) -> float:
        """Minutes of training in the run records of a declared table's folder (their `metrics.wall_seconds`,
        process start-up excluded): what rerunning the command that wrote them costs on that machine, at least."""
        folder = self.path(name).parent
        seconds = [json.loads(p.read_text()).get("metrics", {}).get("wall_seconds") for p in folder.glob("*.json")]
        return sum(s for s in seconds if isinstance(s, (int, float))) / 60


@dataclass(frozen=True)
class Claim:
    """One row of the table and one section under it. `numbers` takes every number from `files`; `verdict` maps
    those numbers to one of VERDICTS by the rule `rule` states; the other fields are templates over the numbers
    (links relative to results/README.md). `rerun`: (command, the claim's file whose folder's records time it, or
    "" when the command writes no run records)."""

    key: str
    claim: str
    paper: str
    files: tuple[str, ...]
    numbers: Callable[[Files], dict[str, Any]]
    headline: str
    projected: str
    verdict: Callable[[dict[str, Any]], str]
    rule: str
    details: tuple[str, ...]
    where: str
    rerun: tuple[tuple[str, str], ...]

    def values(self, root: Path) -> dict[str, Any]:
        return self.numbers(Files(root, self.files))

    def judged(self, numbers: dict[str, Any]) -> str:
        verdict = self.verdict(numbers)
        if verdict not in VERDICTS:
            raise ClaimError(f"{self.key}: verdict {verdict!r} is not one of {VERDICTS}")
        return verdict

    def cells(self, root: Path) -> list[str]:
        """The table row: key (a link to the section), claim, paper, measured here, projected, verdict, where."""
        n = self.values(root)
        return [f"[{self.key}](#{self.anchor()})", self.claim, self.paper.format(**n), self.headline.format(**n),
                self.projected.format(**n), f"**{self.judged(n)}**", self.where.format(**n)]

    def anchor(self) -> str:
        """GitHub's anchor of the section's heading "{key} — {claim}"."""
        text = f"{self.key} — {self.claim}".lower()
        return "".join(c if c.isalnum() or c in "-_ " else "" for c in text).replace(" ", "-")

    def section(self, root: Path) -> str:
        """The detail under the table: the rule and its verdict, a bullet per detail, the commands and their time."""
        n, files = self.values(root), Files(root, self.files)
        reruns = []
        for command, timed_by in self.rerun:
            minutes = f" (≈ {files.run_minutes(timed_by):.0f} min of runs on {n['hw']})" if timed_by else ""
            reruns.append(f"{command}{minutes}")
        return "\n".join([f"#### {self.key} — {self.claim}", "",
                          f"Paper: {self.paper.format(**n)}. Verdict: **{self.judged(n)}** — "
                          f"{self.rule.format(**n)}", "",
                          *(f"- {d.format(**n)}" for d in self.details),
                          f"- Rerun: {'; '.join(reruns)}."])

    def templates(self) -> tuple[str, ...]:
        return (self.claim, self.paper, self.headline, self.projected, self.rule, self.where, *self.details)

    def fields(self) -> set[str]:
        """The numbers the templates use (and `hw`, which the rerun times name)."""
        used = {name for t in self.templates() for _, name, _, _ in string.Formatter().parse(t) if name}
        return used | ({"hw"} if any(timed for _, timed in self.rerun) else set())
