"""Packaging and CI: the package installs into a GPU user's own environment, `make ... VENV=` touches no network,
the GPU workflow fails on a failing benchmark and pushes a baseline only from a job that may."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = ROOT / ".github" / "workflows" / "gpu-bench.yml"


def requirements(extra: str | None = None) -> dict[str, Requirement]:
    """`pip install .`'s requirements, or those of an extra (`harness`, `test`, `deepspeed`)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = project["dependencies"] if extra is None else project["optional-dependencies"][extra]
    return {r.name: r for r in map(Requirement, reqs)}


def test_the_package_accepts_the_torch_a_gpu_host_already_has():
    torch_req = requirements()["torch"].specifier
    for version in ("2.11.0", "2.11.0+cu130", "2.13.0", "2.13.0+cpu"):
        assert torch_req.contains(Version(version), prereleases=False), f"torch {version} refused by {torch_req}"
    assert not torch_req.contains("2.5.1")  # torch.nn.utils.get_total_norm (optimizer.py) needs 2.6


def test_transformers_floor_knows_the_dtype_keyword_and_deepspeed_is_optional():
    reqs = requirements("harness")  # the library needs only torch; the harness loads models
    assert reqs["transformers"].specifier.contains("4.56.0") and not reqs["transformers"].specifier.contains("4.55.4")
    assert "deepspeed" not in reqs | requirements()  # an extra: without it the ds-* rows say "not installed"


@pytest.mark.script
def test_make_with_an_empty_venv_uses_the_interpreter_at_hand_and_no_pip():
    if shutil.which("make") is None:
        pytest.fail("make is not installed: the Makefile cannot be checked")
    plain = subprocess.run(["make", "-n", "test", "VENV=", "PYTHON=/opt/site/python"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout
    assert "pip install" not in plain and " -m venv" not in plain
    assert "/opt/site/python zenflow/harness/preflight.py" in plain
    assert "/opt/site/python -m pytest tests" in plain
    venv = subprocess.run(["make", "-n", "-B", "install"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout
    pips = [line for line in venv.splitlines() if "pip install" in line]
    assert pips[0].endswith("pip install -q torch==2.13.0")  # the exact pin: first and alone


@pytest.mark.script
def test_the_import_check_runs_without_torch_and_names_what_is_missing():
    # A bare interpreter (no site-packages of ours): it must still start and say what is missing, not crash.
    result = subprocess.run([sys.executable, "-S", str(ROOT / "zenflow" / "harness" / "preflight.py")],
                            capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ""})
    assert result.returncode == 1
    assert "REQUIRED: torch missing" in result.stderr


def load_workflow() -> dict:
    data = yaml.safe_load(WORKFLOW.read_text())
    data["on"] = data.pop(True, data.get("on"))  # YAML 1.1 reads the key `on` as True
    return data


def test_the_gpu_workflow_fails_a_step_when_pytest_fails_behind_tee():
    wf = load_workflow()
    default_shell = wf.get("defaults", {}).get("run", {}).get("shell")
    for job in wf["jobs"].values():
        for step in job["steps"]:
            run = step.get("run", "")
            if "|" in run.replace("||", ""):
                shell = step.get("shell") or job.get("defaults", {}).get("run", {}).get("shell") or default_shell
                # GitHub runs `shell: bash` as `bash -eo pipefail {0}`; a bare run: is `bash -e {0}` (no pipefail).
                assert shell == "bash" or "pipefail" in (shell or "") or "set -o pipefail" in run, step


def test_the_gpu_workflow_reads_by_default_and_only_the_baseline_job_may_push():
    wf = load_workflow()
    assert wf["permissions"] == {"contents": "read"}
    writers = {name for name, job in wf["jobs"].items() if (job.get("permissions") or {}).get("contents") == "write"}
    assert writers == {"baseline"}
    baseline = wf["jobs"]["baseline"]
    assert "github.event_name != 'pull_request'" in baseline["if"]
    assert any(".ci/bench-baseline update" in s.get("run", "") for s in baseline["steps"])
    for name, job in wf["jobs"].items():  # PR code from forks never runs on the self-hosted GPU runners
        if "self-hosted" in job["runs-on"]:
            assert "github.event.pull_request.head.repo.fork == false" in job.get("if", ""), name
        assert not any(".ci/bench-baseline update" in s.get("run", "") for s in job["steps"]) or name in writers


def _bench_json(path: Path, names: list[str]) -> Path:
    path.write_text(json.dumps({"machine_info": {"hardware_id": "hw-test"}, "commit_info": {"id": "abc"},
                                "benchmarks": [{"name": n, "fullname": f"bench/test_x.py::{n}"} for n in names]}))
    return path


def test_the_baseline_update_refuses_a_run_that_lost_benchmarks(tmp_path):
    if shutil.which("git") is None:
        pytest.fail("git is not installed: the baseline script cannot be checked")
    remote, work = tmp_path / "remote.git", tmp_path / "work"
    subprocess.run(["git", "init", "-q", "--bare", str(remote)], check=True)
    subprocess.run(["git", "init", "-q", str(work)], check=True)
    env = {**os.environ, "BENCH_BASELINE_REMOTE": str(remote), "PY": sys.executable}
    env.pop("BENCH_BASELINE_FORCE", None)

    def update(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(ROOT / ".ci" / "bench-baseline"), "update", *args], cwd=work, env=env,
                              capture_output=True, text=True, timeout=60)

    assert update(str(_bench_json(tmp_path / "full.json", ["a", "b", "c"]))).returncode == 0
    partial = _bench_json(tmp_path / "partial.json", ["a", "c"])
    refused = update(str(partial))
    assert refused.returncode == 4 and "bench/test_x.py::b" in refused.stderr
    assert update(str(_bench_json(tmp_path / "empty.json", []))).returncode == 4
    assert update(str(partial), "--force").returncode == 0
    stored = subprocess.run(["git", "--git-dir", str(remote), "show", "bench-baseline:hw-test/baseline.json"],
                            capture_output=True, text=True, check=True).stdout
    assert len(json.loads(stored)["benchmarks"]) == 2


def test_cpu_scale_trains_on_bytes_and_says_so_without_the_llama_tokenizer(monkeypatch):
    """A GPU host's own environment often has neither sentencepiece nor mistral-common: the cpu-scale workload
    (gpu-check's engines) still runs, on UTF-8 bytes inside Llama's vocabulary, and its name says why."""
    import sys

    from zenflow.harness.workloads import Tokenizer, Workload, batches

    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # import fails as if not installed
    w = Workload(model="cpu-scale", seq_len=8, hidden=64, layers=2, intermediate=128, heads=4)
    tok = Tokenizer(w)
    assert "sentencepiece not installed" in tok.name
    assert tok.encode("hé") == [3 + b for b in "hé".encode()]
    batch = next(batches(w, tok, ["some training text, long enough for one batch"] * 4))
    assert batch.shape == (1, 8) and 0 <= int(batch.min()) and int(batch.max()) < tok.vocab_size
