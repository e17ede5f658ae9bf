"""When runs were made: one answer for every report that says so (figure titles, the claims page, the cost model's
validation age).

A run record carries the UTC time its run started (`protocol.taken_at`, written by the session). Records written
before that field existed carry only the commit they ran at: such a run is no earlier than that commit's day and no
later than the day git committed its record, so git dates it. A record whose file a later commit only rewrote
(its steps packed: records.py) keeps that day in `protocol.record_committed_at`, read before git's. Days are UTC days.
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from zenflow.harness.records import RunRecord, raw_records
from zenflow.harness.tables import write_json_atomic

Span = tuple[datetime | None, datetime | None]  # taken no earlier than the first, no later than the second
UNKNOWN = "day unknown"
# When git first had the run of a record whose file a later commit only rewrote (packing its steps): that commit's
# time would date the run, so the record says when its run was committed (`python -m zenflow.harness.when`)
RECORD_COMMITTED = "record_committed_at"


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _git(folder: Path, *args: str) -> str:
    try:
        done = subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout if done.returncode == 0 else ""


def committed(folder: Path) -> dict[str, datetime]:
    """File name -> when its content was committed (the last commit that touched it), for the files of `folder`;
    for a run record that says when its run was committed (RECORD_COMMITTED), that."""
    out: dict[str, datetime] = {}
    for chunk in _git(folder, "log", "--format=%x00%cI", "--name-only", "--relative", "--", ".").split("\0")[1:]:
        date, *names = chunk.split("\n")
        for name in filter(None, names):
            out.setdefault(name, datetime.fromisoformat(date))
    for name in [n for n in out if "/" not in n and n.endswith(".json")]:
        said = _record_committed(folder / name)
        if said:
            out[name] = said
    return out


def _record_committed(path: Path) -> datetime | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    said = (data.get("protocol") or {}).get(RECORD_COMMITTED) if isinstance(data, dict) else None
    return datetime.fromisoformat(said) if isinstance(said, str) else None


def stamp_committed(root: Path, before: str) -> list[Path]:
    """Write RECORD_COMMITTED into every run record under `root` that has neither it nor `taken_at`: the time of
    the last commit before `before` that touched its file (the commit that only rewrote it excluded)."""
    done = []
    for path, data in raw_records(root):
        if not isinstance(data.get("protocol"), dict):
            continue
        if data["protocol"].get("taken_at") or data["protocol"].get(RECORD_COMMITTED):
            continue
        date = _git(path.parent, "log", "-1", "--format=%cI", f"{before}^", "--", path.name).strip()
        if date:
            data["protocol"][RECORD_COMMITTED] = date
            write_json_atomic(path, data)
            done.append(path)
    return done


@functools.lru_cache(maxsize=64)  # a few commits for a folder's records: one git call each
def commit_time(folder: Path, commit: str | None) -> datetime | None:
    """When `commit` was made (git in `folder`); None where git cannot say."""
    date = _git(folder, "show", "-s", "--format=%cI", commit).strip() if commit else ""
    return datetime.fromisoformat(date) if date else None


def taken(path: Path, stamp: str | None, environment: dict[str, Any], committed_at: dict[str, datetime]) -> Span:
    """When a record or calibration was taken: its `taken_at`; without one, between the time of the commit it ran at
    (its environment's git commit) and the time its file was committed (`committed_at`, from committed())."""
    if stamp:
        t = datetime.fromisoformat(stamp)
        return t, t
    commit = (environment.get("git") or {}).get("commit")
    return commit_time(path.parent, commit), committed_at.get(path.name)


def span_of(spans: list[Span]) -> Span:
    """The span of several: earliest start to latest end (unknown when any is)."""
    if not spans or any(s[0] is None for s in spans) or any(s[1] is None for s in spans):
        return None, None
    return min(s[0] for s in spans), max(s[1] for s in spans)


def runs_day(records: Sequence[RunRecord], folder: Path) -> str:
    """The day(s) the ok runs among `records` (read from `folder`) were made: "2026-11-24", "2026-11-24 to
    2026-11-25", "on or after 2026-11-24" (records git has not committed yet), or "day unknown"."""
    ok = [r for r in records if r.status == "ok"]
    undated = [r for r in ok if not r.protocol.get("taken_at")]
    records_committed = max((t for name, t in committed(folder).items() if "/" not in name and name.endswith(".json")),
                            default=None) if undated else None  # the folder's own records, not its remade tables
    stamped = [datetime.fromisoformat(r.protocol["taken_at"]) for r in ok if r.protocol.get("taken_at")]
    low = stamped + [commit_time(folder, (r.environment.get("git") or {}).get("commit")) for r in undated]
    high = stamped + [records_committed] * len(undated)
    if not low or None in low:
        return UNKNOWN
    first = _day(min(low))
    if None in high:
        return f"on or after {first}"
    last = _day(max(high))
    return first if last == first else f"{first} to {last}"


def _day(t: datetime) -> str:
    return t.astimezone(timezone.utc).date().isoformat()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Say in each undated run record under FOLDER when git first had its "
                                 "run: the last commit before REV, the commit that only rewrote the records.")
    ap.add_argument("folder", type=Path)
    ap.add_argument("--before", required=True, metavar="REV", help="the commit that rewrote the records")
    args = ap.parse_args(argv)
    done = stamp_committed(args.folder, args.before)
    print(f"{len(done)} run records under {args.folder} say when their run was committed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
