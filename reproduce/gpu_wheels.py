"""Wheels for a GPU host without a package index: writes .whl/ (git-ignored: carry it with the tree) holding what a
CUDA image with its own torch and transformers lacks for our engines: DeepSpeed (built here from its sdist, since
PyPI has no wheel of it), pydantic with its binary pydantic-core for the host's Python and for this one, their small
pure requirements, and mistral-common for the Llama tokenizer file. Before it replaces the set it checks that every
requirement is in the set or on the image, and that the set fits the device tool's 16 MiB (docs/install.md).

    python reproduce/gpu_wheels.py                        # what `make gpu-wheels` runs: .whl/ for Python 3.12
    python reproduce/gpu_wheels.py --python-version 3.13  # make gpu-wheels PYVER=3.13

On the GPU host (the line it prints), then PYTHONPATH=<SITE>:
  python3 -m pip install -q --no-index --no-deps --no-compile --find-links .whl --target <SITE> -r .whl/requirements.txt

Exit status: 0 the set is written; 1 a download or build failed, the set misses a requirement or is too large (the
folder keeps its previous set); 2 bad arguments (nothing created).
"""

from __future__ import annotations

import argparse
import ast
import email.parser
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name, parse_wheel_filename

from zenflow.harness import cli

ROOT = Path(__file__).resolve().parents[1]
# The one table of versions: the ones `make install` puts in .venv, so the GPU host runs what the tests here ran.
PINS: dict[str, str] = {
    "deepspeed": "0.19.8",           # built from its sdist with this interpreter's torch (no wheel on PyPI)
    "pydantic": "2.14.4",
    "pydantic-core": "2.50.5",       # must equal pydantic's own `pydantic-core==` pin (checked)
    "annotated-types": "0.8.0",
    "typing-inspection": "0.4.5",
    "typing-extensions": "4.16.0",   # pydantic 2.14 needs >= 4.16; on PYTHONPATH it precedes the image's own
    "hjson": "3.1.0",
    "mistral-common": "1.13.1",
}
BINARY = "pydantic-core"  # the one compiled package: a wheel per Python version
# Carried only for its data file data/tokenizer.model.v1 (Llama's SentencePiece model, which
# zenflow/harness/workloads.py finds via mistral_common.__file__); installed with --no-deps, so its own requirements
# (jsonschema, pydantic-extra-types, ...) are never imported and are exempt from the coverage check.
NO_DEPS = ("mistral-common",)
# What the GPU image already has: its package list, read 2026-11-17.
ON_CUDA_IMAGE = ("einops", "msgpack", "ninja", "numpy", "packaging", "psutil", "py-cpuinfo", "tqdm", "torch",
                 "nvidia-ml-py", "sentencepiece", "tiktoken", "pillow", "requests", "scipy", "matplotlib", "tabulate",
                 "transformers", "accelerate", "pytest", "hypothesis", "pyyaml")
# pydantic-core's manylinux wheels carry both tags; glibc 2.17 is older than any CUDA 13 image's.
PLATFORMS = ("manylinux_2_17_x86_64", "manylinux2014_x86_64")
LIMIT_BYTES = 16 * 2**20  # the device tool's limit per file; the set takes at most this of its 64 MiB per tree
REQUIREMENTS = "requirements.txt"
# The first line of our requirements.txt: a folder holding it is ours to clear, any other non-empty one is refused.
HEADER = "# written by reproduce/gpu_wheels.py (make gpu-wheels); install with --no-deps, see its docstring"
STAGE_PREFIX = ".staging-"
INSTALL = ("python3 -m pip install -q --no-index --no-deps --no-compile --find-links {out} --target <SITE> "
           "-r {out}/requirements.txt")


class SetError(Exception):
    """A failed download or build, or a set that misses a requirement or is too large: one line, exit 1."""


@dataclass(frozen=True)
class Dist:
    """One wheel's METADATA: canonical name, version, Requires-Python and Requires-Dist lines."""
    name: str
    version: str
    requires_python: str
    requires: tuple[str, ...]


def python_version(value: str) -> str:
    """A `type=` for a CPython version 3.N, N >= 10 (the project's floor)."""
    match = re.fullmatch(r"3\.(\d{1,2})", value)
    if not match or int(match.group(1)) < 10:
        raise argparse.ArgumentTypeError(f"{value!r} is not allowed: expected 3.N with N >= 10, e.g. 3.12")
    return value


def ownership_problem(out: Path) -> str | None:
    """Why `out` is not ours to clear (None when it is): new, empty, or holding our requirements.txt."""
    if not out.is_dir():
        return None
    if any(not p.name.startswith(STAGE_PREFIX) for p in out.iterdir()):
        req = out / REQUIREMENTS
        if not req.is_file() or not req.read_text().startswith(HEADER):
            return f"{str(out)!r} holds files but not our {REQUIREMENTS}: expected a new or empty folder, or one " \
                   "this script wrote"
    return None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = cli.ArgumentParser(description=__doc__.split("\n\n")[0])  # one-line errors, exit 2
    ap.add_argument("--out", type=cli.out_folder, default=str(ROOT / ".whl"), help="default: <repo>/.whl")
    ap.add_argument("--python-version", type=python_version, default="3.12",
                    help="the GPU host's Python, 3.N (default 3.12)")
    args = ap.parse_args(argv)
    problem = ownership_problem(args.out)
    if problem:
        ap.error(f"argument --out: {problem}")
    return args


def say(text: str) -> None:
    print(f"gpu-wheels: {text}", flush=True)


def pip(*args: str) -> None:
    """`python -m pip ARGS` with this interpreter; on failure pip's last lines, then SetError."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DS_BUILD_")}
    env["DS_BUILD_OPS"] = "0"  # a pure-Python DeepSpeed: the GPU host JIT-builds its ops against its own torch
    run = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, env=env)
    if run.returncode:
        sys.stderr.write("".join((run.stdout + run.stderr).splitlines(keepends=True)[-15:]))
        raise SetError(f"pip {args[0]} {' '.join(a for a in args if '==' in a)} failed (exit {run.returncode})")


def read_dist(wheel: Path) -> Dist:
    """The METADATA of a wheel file."""
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        meta = email.parser.BytesParser().parsebytes(zf.read(name), headersonly=True)
    return Dist(canonicalize_name(meta["Name"]), meta["Version"], meta.get("Requires-Python") or "",
                tuple(meta.get_all("Requires-Dist") or ()))


def _environment(python: str) -> dict[str, str]:
    """Marker variables of CPython `python` on Linux x86_64; extra "" so an `extra == ...` requirement never holds."""
    return {"python_version": python, "python_full_version": f"{python}.0", "sys_platform": "linux",
            "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix", "implementation_name":
            "cpython", "platform_python_implementation": "CPython", "extra": ""}


def uncovered(dists: Iterable[Dist], python: str, on_image: Iterable[str] = ON_CUDA_IMAGE) -> list[str]:
    """One line per problem: a requirement (not under an extra, its marker true for `python` on Linux x86_64) of a
    wheel in the set (mistral-common exempt) that is neither in the set in an allowed version nor on the image, and a
    wheel whose Requires-Python excludes `python`."""
    dists = list(dists)
    have = {d.name: d.version for d in dists}
    image = {canonicalize_name(n) for n in on_image}
    env, lines = _environment(python), []
    for dist in dists:
        if dist.requires_python and not SpecifierSet(dist.requires_python).contains(f"{python}.0"):
            lines.append(f"{dist.name} {dist.version} requires Python {dist.requires_python}, not {python}")
        if dist.name in NO_DEPS:
            continue
        for text in dist.requires:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            name = canonicalize_name(req.name)
            if name in have and not req.specifier.contains(have[name], prereleases=True):
                lines.append(f"{dist.name} requires {text}, the set has {name} {have[name]}")
            elif name not in have and name not in image:
                lines.append(f"{dist.name} requires {text}: neither in the set nor on the CUDA image (ON_CUDA_IMAGE)")
    return lines


def pinned_core(pydantic: Dist) -> str | None:
    """The pydantic-core version pydantic's METADATA pins with `pydantic-core==`."""
    for text in pydantic.requires:
        req = Requirement(text)
        if canonicalize_name(req.name) == BINARY and req.marker is None:
            pins = [s.version for s in req.specifier if s.operator == "=="]
            return pins[0] if pins else None
    return None


def _check_deepspeed(wheel: Path) -> None:
    """Pure Python, no prebuilt op: a cached or found wheel with ops compiled for this machine would not load there."""
    with zipfile.ZipFile(wheel) as zf:
        info = zf.read("deepspeed/git_version_info_installed.py").decode()
    ops = ast.literal_eval(re.search(r"installed_ops=(\{.*\})", info).group(1))
    built = sorted(name for name, on in ops.items() if on)
    if not wheel.name.endswith("-py3-none-any.whl") or built:
        raise SetError(f"{wheel.name} is not pure Python (prebuilt ops: {', '.join(built) or 'none'}); expected "
                       "py3-none-any with no prebuilt op")


def fetch(stage: Path, pythons: Sequence[str]) -> list[Path]:
    """Every wheel of PINS into `stage`, pydantic-core once per Python version; checks the pydantic-core pin."""
    pip("wheel", "-q", "--no-deps", "--no-build-isolation", f"deepspeed=={PINS['deepspeed']}", "-w", str(stage))
    pure = [f"{name}=={version}" for name, version in PINS.items() if name not in ("deepspeed", BINARY)]
    pip("download", "-q", "--no-deps", "--only-binary=:all:", *pure, "-d", str(stage))
    pydantic = read_dist(next(stage.glob("pydantic-*.whl")))
    if pinned_core(pydantic) != PINS[BINARY]:
        raise SetError(f"pydantic {pydantic.version} pins pydantic-core=={pinned_core(pydantic)}, the table "
                       f"{PINS[BINARY]}: set PINS['pydantic-core'] to pydantic's pin")
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    for python in pythons:
        pip("download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", python, "--implementation",
            "cp", *platforms, f"{BINARY}=={PINS[BINARY]}", "-d", str(stage))
    return sorted(stage.glob("*.whl"))


def check_set(wheels: Sequence[Path], python: str) -> list[Dist]:
    """Exactly the table's versions, DeepSpeed pure, every requirement covered, within the size limit."""
    dists = [read_dist(w) for w in wheels]
    for wheel, dist in zip(wheels, dists):
        name, version, _, _ = parse_wheel_filename(wheel.name)
        if PINS.get(name) != str(version) or dist.version != PINS[name]:
            raise SetError(f"{wheel.name} is not in the table (PINS): expected one of "
                           f"{', '.join(f'{n}=={v}' for n, v in PINS.items())}")
    missing = sorted(set(PINS) - {d.name for d in dists})
    if missing:
        raise SetError(f"no wheel of {', '.join(missing)} in the set")
    _check_deepspeed(next(w for w, d in zip(wheels, dists) if d.name == "deepspeed"))
    lines = uncovered({d.name: d for d in dists}.values(), python)
    if lines:
        raise SetError(lines[0] + (f" (and {len(lines) - 1} more)" if len(lines) > 1 else ""))
    total = sum(w.stat().st_size for w in wheels)
    if total > LIMIT_BYTES:
        raise SetError(f"the set is {total / 2**20:.1f} MiB, over its {LIMIT_BYTES / 2**20:.0f} MiB limit (the device "
                       "tool carries 16 MiB a file, 64 MiB a tree)")
    return dists


def publish(out: Path, wheels: Sequence[Path]) -> Path:
    """Replace our wheels and requirements.txt in `out` with the staged ones (stale versions go)."""
    for old in out.glob("*.whl"):
        old.unlink()
    for wheel in wheels:
        wheel.replace(out / wheel.name)
    req = out / REQUIREMENTS
    req.write_text("\n".join([HEADER, *(f"{name}=={version}" for name, version in PINS.items())]) + "\n")
    return req


def shown(path: Path) -> str:
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out: Path = args.out
    start = time.monotonic()
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    pythons = list(dict.fromkeys([args.python_version, here]))  # here too: the test installs the set here
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(f"{STAGE_PREFIX}*"):  # left by a killed run
        shutil.rmtree(stale, ignore_errors=True)
    stage = Path(tempfile.mkdtemp(prefix=STAGE_PREFIX, dir=out))
    try:
        say(f"building DeepSpeed {PINS['deepspeed']}, fetching {len(PINS) - 1} wheels "
            f"(pydantic-core for Python {' and '.join(pythons)}) ...")
        wheels = fetch(stage, pythons)
        check_set(wheels, args.python_version)
        publish(out, wheels)
    except SetError as exc:
        print(f"gpu_wheels.py: error: {exc}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    total = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    say(f"{len(wheels)} wheels + {REQUIREMENTS}, {total / 2**20:.1f} MiB (limit {LIMIT_BYTES / 2**20:.0f} MiB) in "
        f"{shown(out)}/ in {time.monotonic() - start:.0f} s; every requirement is in the set or on the CUDA image")
    say(f"on the GPU host (Python {args.python_version}), then PYTHONPATH=<SITE>:")
    print(INSTALL.format(out=shown(out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
