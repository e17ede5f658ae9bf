"""Data-parallel ZenFlowAdamW (zenflow/distributed.py) on gloo, W=2, each rank started by torchrun
(tests/support/dp_rank.py).

The oracle: W ranks, each on its 1/W of every global batch, give the parameters one process gets on the global
batch, fed as the same W micro-batches (loss / W each, gradients accumulated): the same arithmetic up to the order
of one addition, so within fp32 rounding. Also: both ranks hold identical parameters, per-rank checkpoints resume
bit-exactly, per-rank state converts to and from one process's, a dead rank is an error, not a hang.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import dp_rank
import pytest
import torch
from helpers import train_on_global_batches
from launch import Shared, child_env

from zenflow import ZenFlowAdamW
from zenflow.checkpoint import consolidate, shard
from zenflow.config import ConfigError

SCRIPT = Path(dp_rank.__file__).resolve()  # tests/support/dp_rank.py, launched by path
WORLD = 2
SYNC, OVERLAP = dp_rank.SYNC, dp_rank.OVERLAP  # the settings both two-rank test files share
CONFIGS = {
    "sync-reselect-clip": SYNC,
    "overlap-warmup-reselect-clip": OVERLAP,
    "zero-offload": {"lr": 0.01, "zenflow": {"topk_ratio": 0.0, "update_interval": 1, "overlap_step": False}},
    "all-selected-overlap": {"lr": 0.01, "zenflow": {"topk_ratio": 1.0, "update_interval": 2, "overlap_step": True}},
}


@pytest.fixture(scope="module")
def two_ranks(torchrun):
    """`two_ranks(config, out, *extra)`: tests/support/dp_rank.py at two ranks, failing the test unless both exit 0."""
    return lambda config, out, *extra: torchrun(SCRIPT, config, out, *extra)


@pytest.fixture(scope="module")
def launched(two_ranks, tmp_path_factory):
    """`launched(name)`: the folder of CONFIGS[name]'s two-rank run, launched once for every test that reads it."""
    return Shared(lambda name, out: two_ranks(CONFIGS[name], out), tmp_path_factory)


def ranks(out: Path, what: str = "params") -> list[dict]:
    return [torch.load(out / f"{what}-rank{r}.pt", weights_only=False) for r in range(WORLD)]


def one_process(config: dict, steps: int = 12, start_state: dict | None = None, start: int = 0,
                host_bytes: list | None = None) -> dict:
    """The same run in one process: each global batch as W micro-batches of loss / W, gradients accumulated."""
    model = dp_rank.build_model()
    opt = ZenFlowAdamW(model.parameters(), process_group=False, **config)
    if start_state is not None:
        model.load_state_dict(start_state["model"])
        opt.load_state_dict(start_state["optimizer"])
    train_on_global_batches(model, opt, dp_rank.global_batches(steps)[start:], WORLD)
    if host_bytes is not None:
        host_bytes += [opt.host_state_bytes, opt.host_staging_bytes]
    opt.close()
    return model.state_dict()


def assert_close(mine: dict, reference: dict, atol: float = 1e-6) -> None:
    for name, value in reference.items():
        assert torch.allclose(mine[name], value, rtol=0, atol=atol), \
            f"{name}: max |diff| {(mine[name] - value).abs().max().item():.3g}"


@pytest.mark.slow
@pytest.mark.parametrize("name", CONFIGS)
def test_two_ranks_equal_one_process_on_the_global_batch(name: str, launched) -> None:
    config, tmp_path = CONFIGS[name], launched(name)
    rank0, rank1 = ranks(tmp_path)
    assert all(torch.equal(rank0[k], rank1[k]) for k in rank0), "the ranks' parameters differ"
    host_bytes: list[int] = []
    reference = one_process(config, host_bytes=host_bytes)
    assert_close(rank0, reference)
    whole, whole_staging = host_bytes
    per_rank = ranks(tmp_path, "bytes")
    fp32_state = [b["host_state_bytes"] - b["host_staging_bytes"] for b in per_rank]
    assert sum(fp32_state) == whole - whole_staging  # the ranks' blocks partition one process's fp32 host state
    # (not the staging arenas: each rank's holds the largest layout its block has had, views rounded up to 64 B)
    assert max(b["host_state_bytes"] for b in per_rank) <= 0.75 * whole or whole == 0
    start = dp_rank.build_model().state_dict()
    assert any(not torch.equal(rank0[k], start[k]) for k in start), "nothing trained"


@pytest.mark.slow
def test_wrapping_the_model_in_ddp_gives_the_same_parameters(tmp_path: Path, two_ranks) -> None:
    """DDP averages the gradients first; ZenFlow's own averaging of equal gradients leaves them as they are, so the
    result is the same (at twice the traffic: do not wrap; docs/distributed.md)."""
    two_ranks(SYNC, tmp_path / "ddp", "--ddp")
    assert_close(ranks(tmp_path / "ddp")[0], one_process(SYNC))


@pytest.mark.slow
def test_selection_exchanges_one_number_per_column(launched) -> None:
    tmp_path = launched("sync-reselect-clip")  # SYNC, as the oracle above ran it
    sent = ranks(tmp_path, "bytes")[0]
    widths = [p.shape[1] for p in dp_rank.build_model().parameters() if p.dim() >= 2]
    selections = len(range(0, 12, SYNC["zenflow"]["select_interval"]))
    assert sent[("net", "column_norms")] == selections * sum(widths) * 4  # fp32, one per column
    gradient_bytes = sum(p.numel() * 4 for p in dp_rank.build_model().parameters() if p.dim() >= 2)
    assert sent[("net", "column_norms")] / selections < gradient_bytes / 10


@pytest.mark.slow
def test_per_rank_checkpoints_resume_bit_exactly_and_convert_to_one_process(tmp_path: Path, two_ranks) -> None:
    config = OVERLAP  # saved mid-interval, with an overlapped host update pending its upload
    two_ranks(config, tmp_path / "whole", "--save-at", "5")
    two_ranks(config, tmp_path / "resumed", "--resume-from", str(tmp_path / "whole"))
    for whole, resumed in zip(ranks(tmp_path / "whole"), ranks(tmp_path / "resumed")):
        assert all(torch.equal(whole[k], resumed[k]) for k in whole), "resume is not bit-exact"

    saved = ranks(tmp_path / "whole", "state")
    single = consolidate([s["optimizer"] for s in saved[::-1]])  # any order
    assert single["zenflow"]["world_size"] == 1
    continued = one_process(config, start_state={"model": saved[0]["model"], "optimizer": single}, start=5)
    assert_close(ranks(tmp_path / "whole")[0], continued)
    for rank, state in enumerate(saved):  # and back: one process's state sharded is each rank's own
        back = shard(single, rank, WORLD)
        for key, entry in state["optimizer"]["state"].items():
            for name, value in entry.items():
                if isinstance(value, torch.Tensor):
                    assert torch.equal(back["state"][key][name], value), (rank, key, name)


def test_a_state_dict_loads_only_into_its_own_rank_and_world() -> None:
    model = dp_rank.build_model()
    opt = ZenFlowAdamW(model.parameters(), process_group=False, **SYNC)
    sd = opt.state_dict()
    sd["zenflow"] = {**sd["zenflow"], "rank": 1, "world_size": 2}
    with pytest.raises(ConfigError, match=r"rank 1 of 2 cannot load into rank 0 of 1.*consolidate"):
        opt.load_state_dict(sd)
    with pytest.raises(ConfigError, match="consolidate the ranks' state dicts first"):
        shard(sd, 0, 2)


@pytest.mark.slow
@pytest.mark.ranks  # started by hand, without torchrun's agent
def test_a_dead_rank_ends_the_others_with_a_clear_error(tmp_path: Path) -> None:
    """Without torchrun's agent (which would stop the survivors itself): rank 1 exits at step 3; rank 0's next
    collective fails and it raises DistributedError naming itself, well before the group's timeout."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(WORLD):
        env = {**child_env(), "RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT), "--config", json.dumps(SYNC),
                                       "--out", str(tmp_path), "--die-at", "3", "--timeout", "30"], env=env,
                                      stderr=subprocess.PIPE, text=True))
    start = time.monotonic()
    try:
        _, err = procs[0].communicate(timeout=90)
    finally:
        for p in procs:
            p.kill()
    assert procs[1].wait() == 17
    assert procs[0].returncode != 0
    assert "DistributedError: zenflow: rank 0 of 2" in err and "a rank died" in err, err[-2000:]
    assert time.monotonic() - start < 60


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_auto_update_interval_fires_as_in_one_process(overlap: bool, tmp_path: Path, two_ranks) -> None:
    """Each rank accumulates its block; the whole's mass is summed across ranks when the rule reads it."""
    config = {"lr": 0.01, "zenflow": {"topk_ratio": 0.25, "update_interval": "auto", "select_interval": 8,
                                      "overlap_step": overlap}}
    two_ranks(config, tmp_path, "--steps", "24")
    assert_close(ranks(tmp_path)[0], one_process(config, steps=24))
    assert ranks(tmp_path, "bytes")[0][("net", "auto_masses")] > 0


def test_a_process_group_without_torch_distributed_initialized_is_refused() -> None:
    with pytest.raises(ValueError, match="torch.distributed is not initialized"):
        ZenFlowAdamW(dp_rank.build_model().parameters(), process_group=object())
