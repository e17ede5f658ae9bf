"""`make gpu-wheels` (reproduce/gpu_wheels.py): the wheel set a GPU host without a package index installs. Built once
into a temporary folder (PyPI or pip's cache), it must fit 16 MiB, install for this interpreter with the one line the
script prints (pip --isolated, so no configured find-links can fill a gap), and give a DeepSpeed that imports with
its CPU Adam builder from the installed set, not from the venv. The coverage check is tested as a unit, with a
negative control; bad input is refused before anything is created."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "reproduce" / "gpu_wheels.py"
_spec = importlib.util.spec_from_file_location("gpu_wheels", SCRIPT)
gw = sys.modules["gpu_wheels"] = importlib.util.module_from_spec(_spec)  # registered first: it has dataclasses
_spec.loader.exec_module(gw)

# Run with PYTHONPATH=SITE: where each module came from, and whether DeepSpeed's CPU Adam op could be JIT-built
# (builder found, compatible, its C++ sources inside the installed package). No .load(): that compiles for minutes.
PROBE = r"""
import json, os
import deepspeed, hjson, pydantic, pydantic_core, mistral_common
from deepspeed.ops.op_builder import CPUAdamBuilder
builder = CPUAdamBuilder()
sources = [builder.deepspeed_src_path(s) for s in builder.sources()]
modules = (deepspeed, hjson, pydantic, pydantic_core, mistral_common)
print(json.dumps({"files": {m.__name__: m.__file__ for m in modules},
                  "compatible": builder.is_compatible(), "sources": sources,
                  "sources_exist": all(os.path.isfile(s) for s in sources), "deepspeed": deepspeed.__version__,
                  "tokenizer": os.path.isfile(os.path.join(os.path.dirname(mistral_common.__file__), "data",
                                                           "tokenizer.model.v1"))}))
"""


def build(out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), *args], capture_output=True, text=True,
                          timeout=900, cwd=ROOT)


@pytest.fixture(scope="module")
def wheel_set(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gpu-wheels") / "whl"
    run = build(out)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "--target <SITE>" in run.stdout and f"--find-links {out}" in run.stdout
    return out


@pytest.mark.deepspeed
def test_set_fits_installs_here_and_deepspeed_imports_from_it(wheel_set, tmp_path):
    size = sum(p.stat().st_size for p in wheel_set.iterdir())
    assert size <= 16 * 2**20, f"{size / 2**20:.1f} MiB"
    site = tmp_path / "site"
    site.mkdir()
    install = [sys.executable, "-m", "pip", "--isolated", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--find-links", str(wheel_set), "--target", str(site), "-r", str(wheel_set / "requirements.txt")]
    run = subprocess.run(install, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    env = {**os.environ, "PYTHONPATH": str(site)}
    probe = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, env=env,
                           cwd=tmp_path)
    assert probe.returncode == 0, probe.stderr
    found = json.loads(probe.stdout.splitlines()[-1])
    for module, file in found["files"].items():
        assert Path(file).resolve().is_relative_to(site.resolve()), f"{module} from {file}, not the set"
    assert found["deepspeed"] == gw.PINS["deepspeed"]
    assert found["compatible"] and found["sources_exist"], found["sources"]
    assert found["tokenizer"]


@pytest.mark.script
def test_rerun_replaces_stale_wheels(wheel_set, tmp_path):
    out = tmp_path / "whl"
    shutil.copytree(wheel_set, out)
    stale = out / "pydantic_core-2.0.0-cp313-cp313-manylinux_2_17_x86_64.whl"
    stale.write_bytes(b"old")
    run = build(out)
    assert run.returncode == 0, run.stderr
    assert not stale.exists()
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in wheel_set.iterdir())


@pytest.mark.script
def test_coverage_check_on_the_real_metadata(wheel_set):
    dists = [gw.read_dist(w) for w in sorted(wheel_set.glob("*.whl"))]
    assert {d.name for d in dists} == set(gw.PINS)
    assert gw.uncovered(dists, "3.12") == []
    assert gw.pinned_core(next(d for d in dists if d.name == "pydantic")) == gw.PINS["pydantic-core"]
    # the negative control: without hjson, DeepSpeed's requirement of it is named
    without = [d for d in dists if d.name != "hjson"]
    lines = gw.uncovered(without, "3.12")
    assert len(lines) == 1 and "deepspeed requires hjson" in lines[0]
    # and a requirement the image does not have either is named, one off the image list too
    assert any("numpy" in line for line in gw.uncovered(dists, "3.12", on_image=set(gw.ON_CUDA_IMAGE) - {"numpy"}))


def test_coverage_check_rules():
    def dist(name: str, *requires: str, version: str = "1.0", python: str = "") -> gw.Dist:
        return gw.Dist(name, version, python, requires)

    extra_only = dist("a", 'nothere; extra == "dev"', "elsewhere; sys_platform == 'win32'",
                      "old; python_version < '3.12'")
    assert gw.uncovered([extra_only], "3.12", on_image=()) == []
    assert gw.uncovered([dist("a", "nothere")], "3.12", on_image=()) == \
        ["a requires nothere: neither in the set nor on the CUDA image (ON_CUDA_IMAGE)"]
    assert "the set has b 1.0" in gw.uncovered([dist("a", "b>=2"), dist("b")], "3.12", on_image=())[0]
    assert gw.uncovered([dist("mistral-common", "jsonschema")], "3.12", on_image=()) == []  # --no-deps: exempt
    assert gw.uncovered([dist("c", python=">=3.13")], "3.12", on_image=()) == ["c 1.0 requires Python >=3.13, not 3.12"]


def fake_set(folder: Path, versions: dict[str, str], pad_bytes: int = 0) -> list[Path]:
    """Wheels that hold only their METADATA (and DeepSpeed's list of prebuilt ops: none); the first padded with
    `pad_bytes` stored bytes, to stand for a set of that size."""
    folder.mkdir(parents=True, exist_ok=True)
    wheels = []
    for i, (name, version) in enumerate(versions.items()):
        stem = f"{name.replace('-', '_')}-{version}"
        wheel = folder / f"{stem}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(f"{stem}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
            if name == "deepspeed":
                zf.writestr("deepspeed/git_version_info_installed.py", "installed_ops={'cpu_adam': False}\n")
            if i == 0 and pad_bytes:
                zf.writestr("padding", b"\0" * pad_bytes, compress_type=zipfile.ZIP_STORED)
        wheels.append(wheel)
    return wheels


def test_the_set_check_takes_exactly_the_tables_versions(tmp_path):
    """`check_set`: "Exactly the table's versions" (the GPU host runs what the tests here ran): a wheel
    of a package in PINS, in another version, is refused."""
    assert [d.name for d in gw.check_set(fake_set(tmp_path / "ok", gw.PINS), "3.12")] == list(gw.PINS)  # control
    other = fake_set(tmp_path / "other", {**gw.PINS, "deepspeed": "0.19.7"})
    with pytest.raises(gw.SetError, match="deepspeed-0.19.7-py3-none-any.whl is not in the table"):
        gw.check_set(other, "3.12")


def test_the_set_check_refuses_a_set_over_16_mib(tmp_path):
    """The module's promise, "the set fits the device tool's 16 MiB" (a file), is the check's limit."""
    gw.check_set(fake_set(tmp_path / "under", gw.PINS, pad_bytes=15 * 2**20), "3.12")  # the control: it fits
    over = fake_set(tmp_path / "over", gw.PINS, pad_bytes=16 * 2**20 + 1)
    with pytest.raises(gw.SetError, match="over its 16 MiB limit"):
        gw.check_set(over, "3.12")


@pytest.mark.script
def test_bad_python_version_is_refused_before_anything(tmp_path):
    out = tmp_path / "whl"
    run = build(out, "--python-version", "3.x")  # the script as a command: one line, exit 2, no folder
    assert run.returncode == 2 and run.stdout == "", run.stdout
    line = "argument --python-version: '3.x' is not allowed: expected 3.N with N >= 10"
    assert run.stderr.count("\n") == 1 and line in run.stderr, run.stderr
    assert not out.exists()


@pytest.mark.parametrize("value", ["3", "3.9", "2.7", "py3.12", "3.12.1", ""])
def test_python_versions_refused(tmp_path, capsys, value):
    with pytest.raises(SystemExit) as exc:
        gw.parse_args(["--out", str(tmp_path / "whl"), "--python-version", value])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and "expected 3.N with N >= 10" in err
    assert gw.parse_args(["--out", str(tmp_path / "whl"), "--python-version", "3.13"]).python_version == "3.13"
    assert not (tmp_path / "whl").exists()


def test_a_folder_it_did_not_write_is_refused(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit) as exc:
        gw.parse_args(["--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and "argument --out" in err and "notes.txt" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
