"""Block ownership when the world size does not divide a weight's width (zenflow/distributed.py).

The promise: docs/distributed.md ("column `j` of a weight with `n` columns belongs to rank `j·W // n`, contiguous
blocks") and the `block_of` docstring ("the columns `owner_of` gives to `rank`, as a slice"). Every column is averaged,
accumulated and broadcast by its owner only, so the block a rank works on must be exactly the columns it owns, also
at the edge of a block when W does not divide the width. tests/support/dp_rank.py trains only widths W divides (12, 32,
24), where any rounding of the block edges agrees; here the widths are odd.
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
from helpers import train_on_global_batches

from zenflow import ZenFlowAdamW
from zenflow.distributed import block_of, owner_of

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(rank_script.__file__).resolve()  # tests/support/dp_asymmetric_rank.py, launched by path
WORLD = 2
CONFIG = {"lr": 0.01, "zenflow": {"topk_ratio": 0.25, "update_interval": 2, "select_interval": 4,
                                  "overlap_step": False}}
STEPS = 8


def test_block_of_is_exactly_the_columns_owner_of_gives_each_rank():
    for world in range(1, 6):
        for width in range(1, 41):
            cols = torch.arange(width)
            owners = owner_of(cols, width, world)
            covered = []
            for rank in range(world):
                block = cols[block_of(rank, width, world)].tolist()
                assert block == cols[owners == rank].tolist(), f"rank {rank} of {world}, width {width}"
                covered += block
            assert covered == cols.tolist()  # the blocks tile the width, in order, once each


def one_process(steps: int) -> dict[str, torch.Tensor]:
    """The same run in one process: each global batch as W micro-batches of loss / W
    (tests/core/test_distributed.py)."""
    model = rank_script.odd_model()
    opt = ZenFlowAdamW(model.parameters(), process_group=False, **CONFIG)
    train_on_global_batches(model, opt, rank_script.odd_batches(steps), WORLD)
    opt.close()
    return rank_script.snapshot(model)


@pytest.mark.ranks
def test_two_ranks_equal_one_process_when_the_world_size_does_not_divide_the_widths(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
           str(SCRIPT), "odd-widths", "--config", json.dumps(CONFIG), "--steps", str(STEPS),
           "--out", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"params-rank{r}.pt") for r in range(WORLD)]
    expected = one_process(STEPS)
    for r, params in enumerate(ranks):
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, r=r, name=name: f"rank {r}, {name}: {m}")
