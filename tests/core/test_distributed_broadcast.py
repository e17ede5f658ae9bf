"""Every rank starts from rank 0's weights (zenflow/distributed.py, ZenFlowAdamW's data parallelism).

The promise: docs/distributed.md, Rules: "Initial weights: the optimizer broadcasts rank 0's parameters at
construction, as DDP does"; `ZenFlowAdamW.add_param_group`: "With data parallelism every rank adds the same group"
(its new parameters are broadcast from rank 0 too). tests/support/dp_rank.py seeds every rank alike, so there the ranks
agree whether or not anything is broadcast; here rank 1 starts from other weights (tests/support/dp_asymmetric_rank.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import dp_asymmetric_rank as rank_script
import pytest
import torch

pytestmark = pytest.mark.ranks  # two ranks (tests/README.md)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(rank_script.__file__).resolve()  # tests/support/dp_asymmetric_rank.py, launched by path
WORLD = 2
CONFIG = {"lr": 0.01, "zenflow": {"topk_ratio": 0.25, "update_interval": 2, "overlap_step": False}}


def test_construction_and_a_late_group_give_every_rank_rank_0s_weights(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
           str(SCRIPT), "broadcast", "--config", json.dumps(CONFIG), "--out", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    seeded, late = rank_script.snapshot(rank_script.base_model()), rank_script.snapshot(rank_script.late_layer())
    for r in range(WORLD):
        constructed = torch.load(tmp_path / f"constructed-rank{r}.pt")
        assert constructed.keys() == seeded.keys()
        for name, value in seeded.items():
            assert torch.equal(constructed[name], value), f"rank {r}: {name} is not rank 0's after construction"
        added = torch.load(tmp_path / f"added-rank{r}.pt")
        for name, value in late.items():
            assert torch.equal(added[name], value), f"rank {r}: {name} is not rank 0's after add_param_group"
