"""A plan's records become a result set only when the whole plan succeeds (reproduce/llama7b.py, reproduce/glue.py).

While a plan runs, its records are written to `<out>/.partial/`, beside a `PARTIAL` file that lists which runs are
missing or failed (rewritten after every run, so a kill leaves it right). When every run is ok or skipped, the
records move into `<out>/` and `.partial/` is removed; until then `<out>/` keeps its last complete set as it was,
and a failed or interrupted plan's table goes to `.partial/` too. `--resume` keeps the ok records of the same runs
(from `.partial/`, then `<out>/`) and reruns the rest; a start without `--resume` over an unfinished plan is refused
before any run, so finished runs are never thrown away by accident. Staged records that are not part of the plan
that completes (an earlier plan's, resumed with other arguments: `--engines A` killed after A's first run, then
`--engines B --resume`) are complete records of runs into the same folder: the ok and skipped ones move into
`<out>/` too (replacing an older record of the same name), only failed or unreadable ones are dropped with
`.partial/`. docs/records.md.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from zenflow.harness.atomic import write_text_atomic
from zenflow.harness.records import RunRecord

PARTIAL = ".partial"
MARKER = "PARTIAL"
COMPLETE = ("ok", "skipped")  # skipped: the engine cannot run in this environment (DeepSpeed not installed)


def unfinished_plan(out: Path) -> Path | None:
    """The `.partial/` folder of an unfinished plan in `out`, if there is one."""
    stage = Path(out) / PARTIAL
    return stage if stage.is_dir() else None


def same_run(old: RunRecord, spec: Any, protocol: dict[str, Any] | None = None) -> bool:
    """Is `old` an ok record of the run `spec` (a RunSpec) describes: same engine, config, workload settings and the
    given `protocol` entries, at the same placement (a record without one ran shared)? (--resume keeps such a
    record instead of running it again.) The config compared is
    the spec's as given (`protocol.spec_config`), not the engine's resolution of it (Twin-Flow's sub_group_size
    "auto" becomes a number); records written before spec_config existed only have `config`."""
    asked = old.protocol.get("spec_config", old.config)
    return (old.status == "ok" and old.engine == spec.engine and asked == spec.ds_config
            and all(old.workload.get(k) == v for k, v in spec.workload.items())
            and old.protocol.get("placement", "shared") == getattr(spec, "placement", "shared")
            and all(old.protocol.get(k) == v for k, v in (protocol or {}).items()))


class StagedPlan:
    """The records of one plan (file names, in order): staged in `<out>/.partial/`, moved into `<out>/` by finish()."""

    def __init__(self, out: Path, names: list[str], command: str = "the same command") -> None:
        self.out, self.names, self.command = Path(out), list(names), command
        self.stage = self.out / PARTIAL
        self.created = [p for p in (self.out, self.stage) if not p.exists()]  # what abandon() may remove again
        self.stage.mkdir(parents=True, exist_ok=True)
        self.status: dict[str, str] = {}
        self.interrupted = False
        self.carried: list[str] = []  # other plans' complete records finish() moved into `<out>/` as well
        self._write_marker()

    def path(self, name: str) -> Path:
        """Where the run named `name` writes its record."""
        return self.stage / name

    def reuse(self, name: str, spec: Any, protocol: dict[str, Any] | None = None) -> RunRecord | None:
        """--resume: the ok record of this run (same_run) from `.partial/`, else from `<out>/`, or None."""
        for folder in (self.stage, self.out):
            try:
                old = RunRecord.read(folder / name)
            except Exception:  # absent or unreadable: run it again
                continue
            if same_run(old, spec, protocol):
                if folder == self.out:
                    self.path(name).unlink(missing_ok=True)  # a stale staged copy must not replace it at finish()
                self.done(name, old)
                return old
        return None

    def done(self, name: str, record: RunRecord) -> None:
        self.status[name] = record.status
        self._write_marker()

    def abandon(self, name: str) -> None:
        """Drop the record of `name` (bad input found in a child: not a run); an empty stage and a folder this plan
        created are removed, so the output folder is as it was."""
        self.path(name).unlink(missing_ok=True)
        self.status.pop(name, None)
        if any(self.stage.glob("*.json")):
            self._write_marker()
            return
        shutil.rmtree(self.stage, ignore_errors=True)
        if self.out in self.created and not any(self.out.iterdir()):
            self.out.rmdir()

    def stop(self) -> None:
        """Interrupted (Ctrl-C, SIGTERM): the marker says so; the records so far stay staged for --resume."""
        self.interrupted = True
        self._write_marker()

    def finish(self) -> bool:
        """Every run ok or skipped: move the records into `<out>/`, with the ok or skipped records other plans left
        staged (`carried`), remove `.partial/`, True. Otherwise False and the records stay staged (the caller writes
        its table there)."""
        if self.missing():
            self._write_marker()
            return False
        for name in self.names:
            if self.path(name).exists():
                os.replace(self.path(name), self.out / name)
        self.carried = self._complete_leftovers()
        for name in self.carried:
            os.replace(self.path(name), self.out / name)
        shutil.rmtree(self.stage)
        return True

    def _complete_leftovers(self) -> list[str]:
        """Staged records of other plans that are ok or skipped: runs that completed, never to be thrown away."""
        found = []
        for path in sorted(self.stage.glob("*.json")):
            if path.name.startswith(".") or path.name in self.names:
                continue
            try:
                status = RunRecord.read(path).status
            except Exception:  # not a record (a report's file) or unreadable: nothing to keep
                continue
            if status in COMPLETE:
                found.append(path.name)
        return found

    def missing(self) -> list[str]:
        """Runs of the plan without an ok or skipped record."""
        return [n for n in self.names if self.status.get(n) not in COMPLETE]

    def _write_marker(self) -> None:
        missing = self.missing()
        failed = [n for n in missing if n in self.status]
        lines = [f"UNFINISHED{' (interrupted)' if self.interrupted else ''}: {len(self.names) - len(missing)} of "
                 f"{len(self.names)} runs have ok or skipped records here. They move into {self.out}/ only when every "
                 f"run of the plan is ok or skipped; {self.out}/ keeps its last complete set until then.",
                 f"Continue: {self.command} --resume (ok records of the same runs are kept, the rest rerun).",
                 f"Failed ({len(failed)}): {', '.join(failed) or '-'}",
                 f"Not run ({len(missing) - len(failed)}): {', '.join(n for n in missing if n not in failed) or '-'}"]
        write_text_atomic(self.stage / MARKER, "\n".join(lines) + "\n")  # readers see the old marker or the new one
