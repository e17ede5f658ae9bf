"""Run records: one JSON file per run, the only input of tables, figures and benchmarks (docs/records.md).

A record is written atomically (temporary file + rename), so an interrupted run leaves either a complete record or
none; a failed run leaves a complete record with `status: "failed"` and the error.
"""

from __future__ import annotations

import argparse
import base64
import gzip
import json
import statistics
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from zenflow.harness.tables import write_json_atomic

SCHEMA_VERSION = 1
# A record of PACK_STEPS_AT steps or more stores them as one packed string (gzip, then base64): the steps are 94% of
# a record's bytes and a fifth of that packed, and the tree that travels to a GPU host must stay under its limit.
# Everything else stays readable JSON; RunRecord.read unpacks, floats exactly (JSON's repr).
PACKED = "gzip+base64"
PACK_STEPS_AT = 64


class RecordError(ValueError):
    """A file that is not a run record of a schema version this code reads."""


@dataclass
class RunRecord:
    engine: str
    status: str = "ok"  # "ok" | "failed" | "skipped"
    error: str | None = None
    schema_version: int = SCHEMA_VERSION
    label: str = ""  # what the run is for, e.g. "llama7b", "glue/MRPC"
    config: dict[str, Any] = field(default_factory=dict)      # engine config (the zenflow block, DeepSpeed JSON)
    workload: dict[str, Any] = field(default_factory=dict)
    protocol: dict[str, Any] = field(default_factory=dict)    # steps, warm-up, update interval, threads
    environment: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)       # parameter counts, model bytes
    steps: list[dict[str, Any]] = field(default_factory=list)  # per timed step (StepTiming fields)
    summary: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)     # task metrics (GLUE), final loss
    nvml: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def write(self, path: str | Path) -> Path:
        """Atomic: readers see the old file, or the whole new one. Many steps are stored packed (PACK_STEPS_AT)."""
        return write_json_atomic(Path(path), packed(self.to_dict()), default=_jsonable)

    @classmethod
    def read(cls, path: str | Path) -> RunRecord:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise RecordError(f"{path}: not a readable JSON run record ({exc})") from None
        if data.get("schema_version") != SCHEMA_VERSION:
            raise RecordError(f"{path}: schema_version = {data.get('schema_version')!r}, expected {SCHEMA_VERSION}")
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known} | {"steps": unpack_steps(data.get("steps", []))})


def packed(data: dict[str, Any]) -> dict[str, Any]:
    """A record's dict with its steps packed when there are PACK_STEPS_AT or more (the same dict otherwise)."""
    steps = data.get("steps")
    if not isinstance(steps, list) or len(steps) < PACK_STEPS_AT:
        return data
    text = json.dumps(steps, separators=(",", ":"), default=_jsonable).encode()
    blob = base64.b64encode(gzip.compress(text, compresslevel=9, mtime=0)).decode()  # mtime 0: the same bytes
    return {**data, "steps": {"packed": PACKED, "count": len(steps), "data": blob}}


def unpack_steps(steps: Any) -> list[dict[str, Any]]:
    """A record's steps as a list, unpacked when stored packed."""
    if isinstance(steps, dict) and steps.get("packed") == PACKED:
        return json.loads(gzip.decompress(base64.b64decode(steps["data"])))
    if isinstance(steps, dict):
        raise RecordError(f"steps packed as {steps.get('packed')!r}: expected {PACKED!r}")
    return steps


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)


def skip_error(reason: str, interpreter: str) -> str:
    """A skipped record's error: why the engine was not run, and in which interpreter (what was missing where)."""
    return f"{reason} (in {interpreter})"


def skip_reason(error: str | None) -> str:
    """The reason in a skipped record's error, without the interpreter skip_error names (for tables)."""
    return (error or "").rsplit(" (in ", 1)[0]


def steps_seconds(record: RunRecord) -> float:
    """Seconds of the record's steps, warm-up included (its wall time less this is the run's fixed cost)."""
    return sum(s.get("period_ms") or 0.0 for s in record.steps) / 1e3


def read_records(folder: str | Path) -> list[RunRecord]:
    return [RunRecord.read(p) for p in sorted(Path(folder).glob("*.json")) if not p.name.startswith(".")]


# ---- summary statistics (computed once, stored in the record) -------------------------------------------------
def describe(values: list[float]) -> dict[str, float | None]:
    """median, p90, IQR, CV, mean of a sample (None when empty)."""
    if not values:
        return {"n": 0, "median": None, "p90": None, "iqr": None, "cv": None, "mean": None}
    ordered = sorted(values)
    q = statistics.quantiles(ordered, n=20, method="inclusive") if len(ordered) > 1 else [ordered[0]] * 19
    mean = statistics.fmean(ordered)
    cv = statistics.pstdev(ordered) / mean if mean else None
    return {"n": len(ordered), "median": statistics.median(ordered), "p90": q[17], "iqr": q[14] - q[4],
            "cv": cv, "mean": mean}


def summarize_steps(steps: list[dict[str, Any]], cycle: int, model_bytes: int | None) -> dict[str, Any]:
    """Step-time statistics over whole update cycles, split by step kind, plus phase means and bytes."""
    timed = [s for s in steps if s["kind"] != "warmup" and s.get("period_ms") is not None]
    whole = timed[: len(timed) - len(timed) % cycle] if cycle > 1 else timed
    periods = [s["period_ms"] for s in timed]

    def mean_of(key: str, rows: list[dict[str, Any]]) -> float | None:
        vals = [r[key] for r in rows if r.get(key) is not None]
        return statistics.fmean(vals) if vals else None

    byte_totals: dict[str, int] = {}
    for s in whole:
        for key, n in (s.get("bytes") or {}).items():
            byte_totals[key] = byte_totals.get(key, 0) + n
    per_step = {k: v / len(whole) for k, v in byte_totals.items()} if whole and byte_totals else None
    moved = sum(v for k, v in (per_step or {}).items() if k.endswith(("_grads", "_params"))) if per_step else None
    return {
        "step_ms": describe(periods),
        "cycle_mean_ms": mean_of("period_ms", whole),
        "cycle": cycle,
        "cycles": len(whole) // max(1, cycle),
        "accumulate_step_ms": mean_of("period_ms", [s for s in whole if s["kind"] == "accumulate"]),
        "update_step_ms": mean_of("period_ms", [s for s in whole if s["kind"] == "update"]),
        "compute_ms": mean_of("compute_ms", whole),
        "io_ms": mean_of("io_ms", whole),
        "stall_ms": mean_of("stall_ms", whole),
        "forward_backward_ms": mean_of("forward_backward_ms", whole),
        "optimizer_ms": mean_of("optimizer_ms", whole),
        "telemetry_ms": mean_of("telemetry_ms", whole),
        "bytes_per_step": per_step,
        "grad_param_bytes_per_step_over_model_bytes": (moved / model_bytes) if moved is not None and model_bytes
        else None,
        "final_loss": next((s["loss"] for s in reversed(steps) if s.get("loss") is not None), None),
        "peak_memory": peak_memory(timed),
    }


NO_PEAKS = ("not measured: no step carries CUDA allocator peaks (the run trained on the CPU, or its record was "
            "written before peaks were recorded)")


def peak_memory(timed: list[dict[str, Any]]) -> dict[str, Any]:
    """The largest per-step allocator peaks over the timed steps (CUDA), or None and why not."""
    allocated = [s["peak_memory_allocated_bytes"] for s in timed if s.get("peak_memory_allocated_bytes") is not None]
    reserved = [s["peak_memory_reserved_bytes"] for s in timed if s.get("peak_memory_reserved_bytes") is not None]
    if not allocated:
        return {"allocated_bytes": None, "reserved_bytes": None, "reason": NO_PEAKS}
    return {"allocated_bytes": max(allocated), "reserved_bytes": max(reserved) if reserved else None, "reason": None}


def raw_records(root: Path) -> Iterator[tuple[Path, dict[str, Any]]]:
    """(path, JSON as stored) of every run record under `root`, every field kept (unknown ones too): for tools that
    rewrite records in place. Other JSON files are passed over."""
    for path in sorted(root.rglob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and data.get("schema_version") == SCHEMA_VERSION and "engine" in data:
            yield path, data


def pack_folder(root: Path) -> list[Path]:
    """Rewrite every run record under `root` whose steps are not packed yet and are PACK_STEPS_AT or more, every
    other field as it was (unknown ones too); the files rewritten."""
    done = []
    for path, data in raw_records(root):
        again = packed(data)
        if again is not data:
            write_json_atomic(path, again, default=_jsonable)
            done.append(path)
    return done


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Pack the steps of the run records under a folder (docs/records.md).")
    ap.add_argument("folder", type=Path)
    args = ap.parse_args(argv)
    done = pack_folder(args.folder)
    print(f"packed the steps of {len(done)} run records under {args.folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
