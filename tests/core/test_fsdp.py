"""ZenFlowAdamW over FSDP2's sharded parameters (zenflow/fsdp.py) on gloo, W=2, each rank started by torchrun
(tests/support/fsdp_rank.py), and its DCP checkpoint (zenflow/sharded_checkpoint.py).

The oracle: FSDP2 at W ranks, each on its 1/W of every global batch, gives the parameters one process gets with
plain ZenFlowAdamW on the global batch (fed as the same W micro-batches, loss / W each), within fp32 rounding, with
the same selected columns on every rank and in the one process. The model's rows are uneven over 2 ranks (33, 25, 1:
rank 1 holds no row of the last layer). The negative control: ranks that rank columns by their own rows only (no
all-reduce of the partial norms) select differently and end elsewhere.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import dp_rank
import fsdp_rank
import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import train_on_global_batches
from launch import Shared

from zenflow import ZenFlowAdamW
from zenflow.config import ConfigError
from zenflow.distributed import DataParallel
from zenflow.sharded_checkpoint import ShardedState

SCRIPT = Path(fsdp_rank.__file__).resolve()
WORLD = 2
STEPS = 12
SYNC, OVERLAP = dp_rank.SYNC, dp_rank.OVERLAP  # the settings both two-rank test files share
CONFIGS = {
    "sync-reselect-clip": SYNC,
    "overlap-warmup-reselect-clip": OVERLAP,
    "l1-device-accumulation": {"lr": 0.01, "accumulate_on": "device",
                               "zenflow": {"topk_ratio": 0.3, "update_interval": 2, "select_interval": 2,
                                           "column_norm": "l1", "overlap_step": True}},
    "zero-offload": {"lr": 0.01, "zenflow": {"topk_ratio": 0.0, "update_interval": 1, "overlap_step": False}},
}


@pytest.fixture(scope="module")
def two_ranks(torchrun):
    """`two_ranks(config, out, *extra)`: tests/support/fsdp_rank.py at two ranks for STEPS steps."""
    return lambda config, out, *extra: torchrun(SCRIPT, config, out, "--steps", str(STEPS), *extra)


@pytest.fixture(scope="module")
def launched(two_ranks, tmp_path_factory):
    """`launched(name)`: the folder of CONFIGS[name]'s two-rank run, launched once for every test that reads it."""
    return Shared(lambda name, out: two_ranks(CONFIGS[name], out), tmp_path_factory)


def ranks(out: Path, what: str = "params") -> list:
    return [torch.load(out / f"{what}-rank{r}.pt", weights_only=False) for r in range(WORLD)]


def one_process(config: dict, start: int = 0, resume: Path | None = None) -> tuple[dict, list[list[int]]]:
    """The same run in one process, plain parameters; optionally resumed from a DCP checkpoint after `start` steps."""
    model = fsdp_rank.build_model()
    opt = ZenFlowAdamW(model.parameters(), process_group=False, **config)
    if resume is not None:
        state = {"model": model.state_dict(), "optimizer": ShardedState(opt)}
        dcp.load(state, checkpoint_id=resume)  # saved by 2 ranks, loaded by one: resharded
        model.load_state_dict(state["model"])
    train_on_global_batches(model, opt, fsdp_rank.global_batches(STEPS)[start:], WORLD)
    opt.close()
    return model.state_dict(), fsdp_rank.selected(opt, model)


def max_diff(mine: dict, reference: dict) -> float:
    return max((mine[k] - reference[k]).abs().max().item() for k in reference)


@pytest.mark.parametrize("name", CONFIGS)
def test_fsdp2_at_two_ranks_equals_one_process_on_the_global_batch(name: str, launched) -> None:
    config, tmp_path = CONFIGS[name], launched(name)
    rank0, rank1 = ranks(tmp_path)
    assert all(torch.equal(rank0[k], rank1[k]) for k in rank0)  # the full parameters, gathered on each rank
    reference, reference_selected = one_process(config)
    assert max_diff(rank0, reference) < 1e-6
    selected0, selected1 = ranks(tmp_path, "selected")
    assert selected0 == selected1 == reference_selected
    start = fsdp_rank.build_model().state_dict()
    assert any(not torch.equal(rank0[k], start[k]) for k in start), "nothing trained"


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_the_auto_interval_fires_as_in_one_process(overlap: bool, tmp_path: Path, two_ranks) -> None:
    """Each rank holds its rows of both the selected and the accumulated columns: both masses are summed over the
    ranks when the rule reads them, so the boundaries fall where one process's do."""
    config = {"lr": 0.01, "zenflow": {"topk_ratio": 0.25, "update_interval": "auto", "select_interval": 8,
                                      "overlap_step": overlap}}
    two_ranks(config, tmp_path)
    reference, reference_selected = one_process(config)
    assert max_diff(ranks(tmp_path)[0], reference) < 1e-6
    assert ranks(tmp_path, "selected")[0] == reference_selected
    sent = ranks(tmp_path, "bytes")[0]
    assert sent[("net", "auto_masses")] > 0


def test_each_rank_holds_its_rows_host_state_and_sends_one_number_per_column(launched) -> None:
    tmp_path = launched("sync-reselect-clip")  # SYNC, as the oracle above ran it
    per_rank = ranks(tmp_path, "bytes")
    model = fsdp_rank.build_model()
    whole = ZenFlowAdamW(model.parameters(), process_group=False, **SYNC)
    train_on_global_batches(model, whole, fsdp_rank.global_batches(STEPS), WORLD)
    fp32 = [b["host_state_bytes"] - b["host_staging_bytes"] for b in per_rank]
    assert sum(fp32) == whole.host_state_bytes - whole.host_staging_bytes  # the ranks' rows partition the state
    widths = [p.shape[1] for p in model.parameters() if p.dim() >= 2]
    selections = len(range(0, STEPS, SYNC["zenflow"]["select_interval"]))
    for sent in per_rank:
        assert sent[("net", "column_norms")] == selections * sum(widths) * 4  # fp32, one per column per selection
        assert ("net", "grad_average") not in sent  # FSDP2 averaged the gradients: ZenFlow sends none
    whole.close()


def test_without_the_norm_all_reduce_the_ranks_select_differently_and_diverge(tmp_path: Path, two_ranks) -> None:
    """The negative control of the oracle above: each rank ranks columns by its own rows."""
    two_ranks(SYNC, tmp_path, "--skip-norm-all-reduce")
    selected0, selected1 = ranks(tmp_path, "selected")
    reference, reference_selected = one_process(SYNC)
    assert selected0 != selected1 or selected0 != reference_selected
    assert max_diff(ranks(tmp_path)[0], reference) > 1e-4


def test_mixed_precision_as_fsdp2_does_it_matches_torch_adamw_at_topk_one(tmp_path: Path, two_ranks) -> None:
    """MixedPrecisionPolicy(param_dtype=bf16): the forward and backward in bf16, the sharded parameters and the
    optimizer in fp32. ZenFlow with every column selected is AdamW (docs/design.md §2), so it must match torch's
    AdamW on the same sharded model."""
    config = {"lr": 0.01, "zenflow": {"topk_ratio": 1.0, "update_interval": 2, "overlap_step": False}}
    two_ranks(config, tmp_path / "zenflow", "--mixed-precision")
    two_ranks(config, tmp_path / "adamw", "--mixed-precision", "--torch-adamw")
    ours, torchs = ranks(tmp_path / "zenflow")[0], ranks(tmp_path / "adamw")[0]
    assert max_diff(ours, torchs) < 1e-6
    exact, _ = one_process(config)
    assert max_diff(ours, exact) > 1e-6  # bf16 compute did change the result: the policy was in force


@pytest.mark.parametrize("config", [SYNC, OVERLAP], ids=["sync", "overlap"])
def test_dcp_checkpoint_resumes_mid_interval_at_two_ranks_and_at_one(config: dict, tmp_path: Path, two_ranks) -> None:
    """Saved at 2 ranks after 5 steps (mid-interval; with overlap an update is pending its upload), loaded at 2 ranks
    (bit-exact against the uninterrupted run) and at 1 process from the same files (DCP reshards; within fp32
    rounding, as the one-process oracle)."""
    two_ranks(config, tmp_path / "whole", "--dcp-save-at", "5")
    two_ranks(config, tmp_path / "resumed", "--dcp-resume", str(tmp_path / "whole" / "dcp"))
    whole, resumed = ranks(tmp_path / "whole")[0], ranks(tmp_path / "resumed")[0]
    assert all(torch.equal(whole[k], resumed[k]) for k in whole), "the 2-rank resume is not bit-exact"
    single, single_selected = one_process(config, start=5, resume=tmp_path / "whole" / "dcp")
    assert max_diff(whole, single) < 1e-6
    assert ranks(tmp_path / "whole", "selected")[0] == single_selected


def test_a_one_process_dcp_checkpoint_resumes_exactly(tmp_path: Path) -> None:
    model = fsdp_rank.build_model()
    opt = ZenFlowAdamW(model.parameters(), process_group=False, **SYNC)
    batches = fsdp_rank.global_batches(STEPS)
    train_on_global_batches(model, opt, batches[:5], WORLD)
    dcp.save({"model": model.state_dict(), "optimizer": ShardedState(opt)}, checkpoint_id=tmp_path)
    train_on_global_batches(model, opt, batches[5:], WORLD)
    fresh = fsdp_rank.build_model()
    again = ZenFlowAdamW(fresh.parameters(), process_group=False, **SYNC)
    state = {"model": fresh.state_dict(), "optimizer": ShardedState(again)}
    dcp.load(state, checkpoint_id=tmp_path)
    fresh.load_state_dict(state["model"])
    train_on_global_batches(fresh, again, batches[5:], WORLD)
    assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in model.state_dict().items())


def test_a_dcp_checkpoint_refuses_another_zenflow_config(tmp_path: Path) -> None:
    model = fsdp_rank.build_model()
    opt = ZenFlowAdamW(model.parameters(), process_group=False, **SYNC)
    train_on_global_batches(model, opt, fsdp_rank.global_batches(3), WORLD)
    dcp.save({"optimizer": ShardedState(opt)}, checkpoint_id=tmp_path)
    other = ZenFlowAdamW(model.parameters(), process_group=False,
                         **{**SYNC, "zenflow": {**SYNC["zenflow"], "select_interval": 5}})
    with pytest.raises(ConfigError, match="differs from the optimizer's"):
        dcp.load({"optimizer": ShardedState(other)}, checkpoint_id=tmp_path)


def test_a_checkpoint_whose_accumulators_do_not_match_its_slots_is_refused_in_one_line(tmp_path: Path) -> None:
    """ShardedState's load checks the accumulator count (one per slot) before it slices anything: an
    entry that lost one of overlap's two accumulators is a ConfigError, not a KeyError mid-load."""
    model = fsdp_rank.build_model()
    opt = ZenFlowAdamW(model.parameters(), process_group=False, **OVERLAP)
    train_on_global_batches(model, opt, fsdp_rank.global_batches(3), WORLD)
    saved = ShardedState(opt).state_dict()
    opt.close()
    entry = saved["state"]["0"]
    assert len(entry["host_counts"]) == 2 and "accumulator1" in entry  # overlap: two slots
    del entry["accumulator1"]
    again = ZenFlowAdamW(fsdp_rank.build_model().parameters(), process_group=False, **OVERLAP)
    with pytest.raises(ConfigError, match="checkpoint accumulators = 2 do not match the saved tensors"):
        ShardedState(again).load_state_dict(saved)
    again.close()


def test_sharded_state_refuses_zenflows_own_data_parallelism() -> None:
    """Data parallelism keeps its per-rank state dicts; ShardedState would save this rank's column block
    as whole-width tensors."""
    with pytest.raises(ConfigError, match="not allowed with ZenFlowAdamW's own data parallelism"):
        ShardedState(SimpleNamespace(ranks=DataParallel.__new__(DataParallel)))
