"""A GPU host has no network and no `../shared`: the scenarios run from the checkout alone, and what is missing is
refused once, in the parent, in one line (zenflow/harness/local_inputs.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from zenflow.harness.records import read_records

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # every test starts a run child (tests/README.md)

SNIPPET = """
from zenflow.harness.workloads import Tokenizer, Workload, batches, build_model, load_texts
w = Workload(model="llama2-7b-shape", hidden=64, intermediate=128, heads=4, layers=1, freeze_embedding=True,
             seq_len=32)
texts, source = load_texts(w)
model, tok = build_model(w), Tokenizer(w)
batch = next(batches(w, tok, texts))
frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
print(source, tok.name, tuple(batch.shape), frozen)
"""


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """The checkout's files alone (tracked and untracked, not ignored), where `../shared` does not exist."""
    dest = tmp_path_factory.mktemp("host") / "checkout"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    assert not (dest.parent / "shared").exists()
    return dest


def offline_env(checkout: Path, tmp: Path) -> dict[str, str]:
    """No network: the hub libraries offline, every proxy a refused port, an empty Hugging Face cache."""
    import os

    refused = "http://127.0.0.1:9"
    return {**os.environ, "PYTHONPATH": str(checkout), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(tmp / "hf-home"), "http_proxy": refused,
            "https_proxy": refused, "HTTP_PROXY": refused, "HTTPS_PROXY": refused}


def run(checkout: Path, tmp: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=checkout, env=offline_env(checkout, tmp), capture_output=True,
                          text=True, timeout=600)


def test_cpu_scale_scenario_runs_from_the_checkout_alone(checkout, tmp_path):
    done = run(checkout, tmp_path, "reproduce/llama7b.py", "--smoke", "--device", "cpu", "--engines", "ref-zenflow",
               "--repeats", "1", "--no-overhead-check", "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    (record,) = read_records(tmp_path / "out")
    assert record.status == "ok"
    assert record.workload["data_source"] == "data/alpaca/alpaca_data_1k.json"
    assert record.workload["tokenizer"] == "tokenizer.model.v1"  # Llama's SentencePiece model, from the package


def test_n_layer_scenario_builds_from_the_checkout_alone(checkout, tmp_path):
    """The 7B-shape path (random-weight builder, tokenizer, committed data, frozen embedding) at a tiny width, and
    its memory plan at one layer of the real width."""
    built = run(checkout, tmp_path, "-c", SNIPPET)
    assert built.returncode == 0, built.stderr
    assert built.stdout.split()[:2] == ["data/alpaca/alpaca_data_1k.json", "tokenizer.model.v1"]
    assert "(1, 32) ['model.embed_tokens.weight']" in built.stdout
    planned = run(checkout, tmp_path, "reproduce/llama7b.py", "--shape", "llama2-7b", "--layers", "1", "--plan",
                  "--device", "cpu")
    assert planned.returncode == 0, planned.stderr
    assert "1 layers of hidden 4096" in planned.stdout and "ref-zenflow" in planned.stdout
    assert "| Llama-2-70B | 8 × 80 GB" in planned.stdout  # and the multi-GPU rows (zenflow/harness/scale_plan.py)


def test_a_hub_model_not_on_this_host_is_refused_at_once(checkout, tmp_path):
    out = tmp_path / "out"
    refused = run(checkout, tmp_path, "reproduce/llama7b.py", "--model", "some-org/not-on-this-host", "--device",
                  "cpu", "--engines", "ref-zenflow", "--out", str(out))
    assert refused.returncode == 2
    (line,) = refused.stderr.strip().splitlines()
    assert "not in the local Hugging Face cache" in line and "--shape llama2-7b" in line
    assert not out.exists()


def test_missing_committed_data_is_refused(checkout, tmp_path):
    """Negative control: without data/alpaca/ (and no ../shared) --data auto has nothing local: refused."""
    broken = tmp_path / "broken"
    shutil.copytree(checkout, broken)
    shutil.rmtree(broken / "data" / "alpaca")
    refused = run(broken, tmp_path, "reproduce/llama7b.py", "--smoke", "--device", "cpu", "--engines", "ref-zenflow",
                  "--out", str(tmp_path / "out"))
    assert refused.returncode == 2
    assert "Alpaca subset" in refused.stderr
