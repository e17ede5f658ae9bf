"""Argument checks of the reproduce scripts: every bad input is refused before any run, model load or DeepSpeed
import, in one line on stderr that names the argument, the value and what is allowed, with exit status 2.

The checks are argparse `type=` functions (argparse calls them while parsing, also on a string default such as
$MODEL, and turns their `ArgumentTypeError` into `error()`), plus `ArgumentParser`, whose `error()` prints that one
line and no usage block (a wrapped usage would bury the line that says what is wrong; `--help` has it):

    llama7b.py: error: argument --seq-len: '0' is not allowed: expected an integer >= 1 (see --help)

Nothing here imports transformers or DeepSpeed or loads a model, and nothing is created on disk: an output folder
is checked (a writable folder, or one that can be created), never made.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

from zenflow.config import AUTO, ConfigError, ZenFlowConfig
from zenflow.harness.engines.registry import ASKED, ENGINE_SPECS
from zenflow.harness.glue.data import GlueError, get_task
from zenflow.harness.placement import PLACEMENTS
from zenflow.harness.records import RecordError, RunRecord
from zenflow.harness.result_sets import PARTIAL, unfinished_plan
from zenflow.harness.workloads import WorkloadError, check_data

# A Hugging Face hub id: "name" or "org/name", letters, digits, "-", "_", "." (no leading "." or "-", no "--"/"..").
_HUB_PART = r"[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
HUB_ID = re.compile(rf"^(?:{_HUB_PART}/)?{_HUB_PART}$")


class ArgumentParser(argparse.ArgumentParser):
    """argparse.ArgumentParser whose errors are one line: `<prog>: error: <message> (see --help)`, exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def int_at_least(low: int) -> Callable[[str], int]:
    """A `type=` for an integer >= low."""
    def check(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            number = None
        if number is None or number < low:
            raise argparse.ArgumentTypeError(f"{value!r} is not allowed: expected an integer >= {low}")
        return number
    check.__name__ = f"integer >= {low}"
    return check


def _float_type(rule: str, allowed: Callable[[float], bool]) -> Callable[[str], float]:
    """A `type=` for a number `allowed` accepts (text that is not a number is NaN to it), named by `rule`."""

    def check(value: str) -> float:
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not allowed(number):
            raise argparse.ArgumentTypeError(f"{value!r} is not allowed: expected {rule}")
        return number
    check.__name__ = rule
    return check


def float_at_least(low: float, strict: bool = False) -> Callable[[str], float]:
    """A `type=` for a finite number >= low (> low when strict)."""
    return _float_type(f"a finite number {'>' if strict else '>='} {low:g}",
                       lambda x: math.isfinite(x) and x >= low and not (strict and x == low))


def names_from(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    """A `type=` for a comma-separated list of distinct names out of `allowed` (kept in `allowed`'s order)."""
    def check(value: str) -> list[str]:
        names = [n.strip() for n in value.split(",") if n.strip()]
        if not names or any(n not in allowed for n in names) or len(set(names)) != len(names):
            raise argparse.ArgumentTypeError(f"{value!r} is not allowed: expected distinct comma-separated names "
                                             f"out of {','.join(allowed)}")
        return [n for n in allowed if n in names]
    check.__name__ = "names"
    return check


def float_between(low: float, high: float) -> Callable[[str], float]:
    """A `type=` for a number in [low, high]."""
    return _float_type(f"a number in [{low:g}, {high:g}]", lambda x: low <= x <= high)  # NaN fails both


def interval(value: str) -> int | str:
    """A `type=` for a ZenFlow interval (update_interval, select_interval): "auto" or an integer >= 1, as the
    zenflow block takes them (zenflow/config.py); DeepSpeed's tutorial recommends "auto"."""
    if value == AUTO:
        return AUTO
    try:
        number = int(value)
    except ValueError:
        number = None
    if number is None or number < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not allowed: expected \"auto\" or an integer >= 1")
    return number


# The ZenFlow knobs the reproductions take (reproduce/llama7b.py, reproduce/glue.py): option -> block field.
KNOBS = {"--update-interval": "update_interval", "--select-interval": "select_interval", "--topk-ratio": "topk_ratio"}


def add_knobs(ap: argparse.ArgumentParser, block: dict[str, Any]) -> None:
    """--update-interval, --select-interval and --topk-ratio, defaulting to `block`'s values (knobs_block checks
    them together after parsing)."""
    ap.add_argument("--update-interval", type=interval, default=block["update_interval"],
                    help="ZenFlow engines: steps between host updates, or \"auto\" (docs/design.md §2; default "
                    "%(default)s)")
    ap.add_argument("--select-interval", type=interval, default=block["select_interval"],
                    help="ZenFlow engines: steps between top-k selections, or \"auto\" (default %(default)s)")
    ap.add_argument("--topk-ratio", type=float_between(0, 1), default=block["topk_ratio"],
                    help="ZenFlow engines: share of columns updated on the device every step (default %(default)s)")


def knobs_block(ap: argparse.ArgumentParser, args: argparse.Namespace, block: dict[str, Any]) -> dict[str, Any]:
    """`block` with the parsed knobs, refused in one line when the zenflow block does not allow them together
    (select_interval below an integer update_interval); DeepSpeed's ZenFlow runs whatever ours accepts."""
    chosen = {**block, **{field: getattr(args, field) for field in KNOBS.values()}}
    try:
        ZenFlowConfig.from_dict(chosen)
    except ConfigError as exc:
        field = str(exc).split(" = ", 1)[0].removeprefix("zenflow.")
        option = next((o for o, f in KNOBS.items() if f == field), "--select-interval")
        ap.error(f"argument {option}: {exc}")
    return chosen


def add_placement(ap: argparse.ArgumentParser) -> None:
    """--placement: where the device's and the host's phases run (harness/placement.py; default shared)."""
    ap.add_argument("--placement", choices=PLACEMENTS, default="shared",
                    help="shared: every phase on every core (the committed sets); split: the GPU analog, the device's "
                    "work on the device cores and the host's on the host cores, for every engine (docs/design.md §3)")


def check_placement_args(ap: argparse.ArgumentParser, args: argparse.Namespace, cuda: bool,
                         nproc: int = 1) -> None:
    """A split needs a host without a GPU (on a GPU the device is the GPU) and two cores per rank; one line each."""
    problem = split_problem(cuda, nproc) if args.placement == "split" else None
    if problem:
        ap.error(f"argument --placement: {problem}")


def split_problem(cuda: bool, nproc: int = 1) -> str | None:
    """Why a split cannot run here (on a GPU, or with fewer than two cores per rank), or None."""
    if cuda:
        return "'split' is not allowed on a GPU (the device's work is the GPU's): expected 'shared', or --device cpu"
    cores = len(os.sched_getaffinity(0)) // max(1, nproc)
    if cores < 2:
        return (f"'split' is not allowed with {cores} core(s) per rank: expected at least 2 (one for the device's "
                "work, one for the host's)")
    return None


def placement_name(placement: str) -> str:
    """The output subfolder of a placement: "" for shared (the committed sets' own folders), "placement-split"."""
    return "" if placement == "shared" else f"placement-{placement}"


def placement_problem(out: Path, placement: str) -> str | None:
    """Why `out` cannot take runs at `placement`: its records (or its unfinished plan's) ran at another one."""
    for path, record in _records_in(out):
        theirs = record.protocol.get("placement", "shared")
        if theirs != placement:
            return (f"holds runs at placement {theirs} ({path.name}): expected a folder of its own (leave --out "
                    "unset: the default names the placement)")
    return None


def _records_in(out: Path) -> Iterator[tuple[Path, RunRecord]]:
    """The readable records of `out` and of its unfinished plan (`.partial/`), with their paths."""
    for folder in (out, out / PARTIAL):
        for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            try:
                yield path, RunRecord.read(path)
            except RecordError:
                continue


def setting_name(block: dict[str, Any], default: dict[str, Any]) -> str:
    """The knobs where `block` differs from `default`, as a folder name ("" when none): two settings never share
    an output folder, e.g. "update-interval-auto" or "topk-ratio-0.05_update-interval-2"."""
    return "_".join(f"{o[2:]}-{block[f]:g}" if isinstance(block[f], float) else f"{o[2:]}-{block[f]}"
                    for o, f in sorted(KNOBS.items()) if block[f] != default[f])


def setting_problem(out: Path, block: dict[str, Any]) -> str | None:
    """Why `out` cannot take runs of `block`: its records (or its unfinished plan's) ran a ZenFlow engine with
    other knobs. None when it can."""
    for path, record in _records_in(out):
        theirs = ((record.config.get("zero_optimization") or {}).get("zenflow") or {})
        other = {f: theirs[f] for f in KNOBS.values() if f in theirs and theirs[f] != block[f]}
        if other and getattr(ENGINE_SPECS.get(record.engine), "zenflow_block", None) == ASKED:  # the run's block
            return (f"holds runs of another ZenFlow setting ({path.name}: "
                    + ", ".join(f"{f} {v}" for f, v in other.items())
                    + "): expected a folder of its own (leave --out unset: the default names the setting)")
    return None


def folder_problem(path: Path) -> str | None:
    """Why `path` cannot be an output folder (None when it can): it must be a writable folder, or creatable."""
    if path.exists():
        if not path.is_dir():
            return "exists and is not a folder"
        return None if os.access(path, os.W_OK | os.X_OK) else "is a folder this user cannot write to"
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return f"cannot be created: {str(parent)!r} is not a folder"
    return None if os.access(parent, os.W_OK | os.X_OK) else f"cannot be created: {str(parent)!r} is not writable"


def out_folder(value: str) -> Path:
    """A `type=` for an output folder: checked, not created (a refused run leaves nothing behind)."""
    path = Path(value).expanduser()
    problem = folder_problem(path)
    if problem:
        raise argparse.ArgumentTypeError(f"{value!r} {problem}: expected a writable folder, or one that can be "
                                          "created")
    return path


def existing_folder(what: str) -> Callable[[str], Path]:
    """A `type=` for a folder that must exist (e.g. a data folder); `what` names it in the message."""
    def check(value: str) -> Path:
        path = Path(value).expanduser()
        if not path.is_dir():
            found = "is not a folder" if path.exists() else "not found"
            raise argparse.ArgumentTypeError(f"{what} {value!r} {found}: expected an existing folder")
        return path
    check.__name__ = what
    return check


def existing_file(value: str) -> Path:
    """A `type=` for a file that must exist and be readable (e.g. an archive to publish)."""
    path = Path(value).expanduser()
    if not path.is_file() or not os.access(path, os.R_OK):
        found = "is not a file" if path.exists() else "not found"
        raise argparse.ArgumentTypeError(f"{value!r} {found}: expected an existing, readable file")
    return path


def _is_path_like(value: str) -> bool:
    return value.startswith(("/", "~", ".")) or "\\" in value or value.endswith("/") or value.count("/") > 1


def model_ref(value: str, builtin: Sequence[str] = ()) -> str:
    """A Hugging Face model: an existing local folder with config.json, or a hub id (accepted, not fetched here);
    `builtin` names accepted as they are (llama7b's "cpu-scale")."""
    allowed = "a Hugging Face hub id (org/name) or a local folder with config.json"
    if builtin:
        allowed = f"{', '.join(map(repr, builtin))}, {allowed}"
    if value in builtin:
        return value
    path = Path(value).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            found = "a folder without config.json" if path.is_dir() else "a file, not a folder"
            raise argparse.ArgumentTypeError(f"{value!r} does not load: {found}; expected {allowed}")
        return value
    if _is_path_like(value) or not HUB_ID.match(value):
        raise argparse.ArgumentTypeError(f"{value!r} does not load: no such local path, and not a hub id; "
                                          f"expected {allowed}")
    return value  # a hub id: transformers fetches (or finds in its cache) it in the run


def model_or_builtin(*builtin: str) -> Callable[[str], str]:
    """A `type=` for model_ref with built-in names."""
    def check(value: str) -> str:
        return model_ref(value, builtin)
    check.__name__ = "model"
    return check


def data_source(value: str) -> str:
    """A `type=` for llama7b's --data: "auto", "synthetic", or a readable Alpaca JSON / text file."""
    try:
        check_data(value)
    except WorkloadError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def glue_task(value: str) -> str:
    """A `type=` for a GLUE task name (any spelling get_task knows); returns the official name."""
    try:
        return get_task(value).name
    except GlueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def distinct(ap: argparse.ArgumentParser, option: str, values: Sequence) -> None:
    """Refuse a value given twice (two runs would write the same record)."""
    twice = sorted({str(v) for v in values if list(values).count(v) > 1})
    if twice:
        ap.error(f"argument {option}: {', '.join(twice)} given more than once: expected each value once")


def unfinished_problem(out: Path, resume: bool) -> str | None:
    """A fresh start (no --resume) over an unfinished plan would throw its finished runs away: refused."""
    if resume or unfinished_plan(out) is None:
        return None
    return (f"holds an unfinished plan ({PARTIAL}/, see the PARTIAL file there): expected --resume to continue it, "
            f"or remove {str(out / PARTIAL)!r} to start afresh")


def refuse(message: str) -> int:
    """A bad input found after parsing (it needed the environment or a file): the same one line, exit status 2."""
    print(f"{Path(sys.argv[0]).name}: error: {message}", file=sys.stderr)
    return 2


def command_line(script: str, argv: Sequence[str] | None) -> str:
    """The command that continues a plan, for its PARTIAL file (--resume is added there)."""
    args = sys.argv[1:] if argv is None else argv
    return " ".join(["python", script, *(a for a in args if a != "--resume")])
