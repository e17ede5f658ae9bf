"""Device accumulation at two ranks (gloo): the same parameters as two ranks of host accumulation, exactly, and as
one process on the global batch within 1e-6 (tests/core/test_distributed.py's tolerance: the ranks' average is one
addition in another order); per-rank checkpoints inside an interval resume bit-exactly and need their partial sums;
one rank's perturbed sums change both ranks' parameters (the negative control).

Also run as a script by torchrun: one rank of that negative control (`perturbing_rank`).
"""

from __future__ import annotations

from pathlib import Path

import dp_rank
import pytest
import torch
import torch.distributed as dist
from helpers import train_on_global_batches
from launch import Shared

import zenflow.device_accumulation as accumulation_module
from zenflow import ZenFlowAdamW

WORLD = 2
DP_CONFIGS = {
    "sync-reselect-clip": {"lr": 0.01, "gradient_clipping": 1.0,
                           "zenflow": {"topk_ratio": 0.25, "update_interval": 2, "select_interval": 4}},
    "overlap-warmup-reselect-clip": {"lr": 0.01, "gradient_clipping": 0.5,
                                     "zenflow": {"topk_ratio": 0.25, "update_interval": 3, "select_interval": 3,
                                                 "overlap_step": True, "full_warm_up_rounds": 1}},
    # "auto": each rank's mass of its block is combined with the others' when read (the element counts it needs)
    "auto-clip": {"lr": 0.01, "gradient_clipping": 1.0,
                  "zenflow": {"topk_ratio": 0.25, "update_interval": "auto", "select_interval": 8}},
}


def rank_files(out: Path, what: str = "params") -> list[dict]:
    return [torch.load(out / f"{what}-rank{r}.pt", weights_only=False) for r in range(WORLD)]


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def one_process(config: dict, steps: int = 12) -> dict:
    """The run in one process on the global batch (tests/core/test_distributed.py's reference), host accumulation."""
    model = dp_rank.build_model()
    opt = ZenFlowAdamW(model.parameters(), process_group=False, **config)
    train_on_global_batches(model, opt, dp_rank.global_batches(steps), WORLD)
    opt.close()
    return model.state_dict()


@pytest.fixture(scope="module")
def launched(torchrun, tmp_path_factory):
    """`launched((name, accumulate_on))`: the folder of DP_CONFIGS[name]'s two-rank run, launched once for every test
    that reads it."""
    def launch(key: tuple[str, str], out: Path) -> None:
        name, accumulate_on = key
        torchrun(dp_rank.__file__, {**DP_CONFIGS[name], "accumulate_on": accumulate_on}, out)

    return Shared(launch, tmp_path_factory)


@pytest.mark.parametrize("name", list(DP_CONFIGS))
def test_two_ranks_of_device_accumulation_equal_two_ranks_of_host_accumulation(name, launched):
    config = DP_CONFIGS[name]
    host_run, device_run = launched((name, "host")), launched((name, "device"))
    host, device = rank_files(host_run), rank_files(device_run)
    assert same(device[0], device[1])  # the ranks agree
    assert same(device[0], host[0])  # exact: each rank sums its block in the same order on either side
    reference = one_process(config)  # the global batch in one process: 1e-6 (the ranks' average's addition order)
    assert all(torch.allclose(device[0][k], v, rtol=0, atol=1e-6) for k, v in reference.items())
    for on_host, on_device in zip(rank_files(host_run, "bytes"), rank_files(device_run, "bytes")):
        assert on_device[("d2h", "grads")] < on_host[("d2h", "grads")]  # each rank ships its block, less
        assert on_device[("h2d", "params")] == on_host[("h2d", "params")]


def test_per_rank_checkpoints_inside_an_interval_resume_bit_exactly_and_need_their_partial_sums(tmp_path, torchrun):
    config = {**DP_CONFIGS["overlap-warmup-reselect-clip"], "accumulate_on": "device"}
    torchrun(dp_rank.__file__, config, tmp_path / "whole", "--save-at", "5")  # mid-interval, an upload pending
    torchrun(dp_rank.__file__, config, tmp_path / "resumed", "--resume-from", str(tmp_path / "whole"))
    whole = rank_files(tmp_path / "whole")
    assert all(same(a, b) for a, b in zip(rank_files(tmp_path / "resumed"), whole))
    (tmp_path / "lost").mkdir()
    for rank, state in enumerate(rank_files(tmp_path / "whole", "state")):
        entries = [e for e in state["optimizer"]["state"].values() if "host_counts" in e]
        assert sum(sum(e["host_counts"]) for e in entries) > 0  # a partial sum was saved
        for entry in entries:  # negative control: the partial sums lost
            entry["host_counts"] = [0] * len(entry["host_counts"])
        torch.save(state, tmp_path / "lost" / f"state-rank{rank}.pt")
    torchrun(dp_rank.__file__, config, tmp_path / "lost-resumed", "--resume-from", str(tmp_path / "lost"))
    assert not same(rank_files(tmp_path / "lost-resumed")[0], whole[0])


def test_negative_control_one_ranks_perturbed_sums_change_both_ranks_parameters(tmp_path, torchrun, launched):
    config = {**DP_CONFIGS["sync-reselect-clip"], "accumulate_on": "device"}
    torchrun(__file__, config, tmp_path / "perturbed")  # perturbing_rank: rank 1's sums off by 1e-3 at each ship
    perturbed, device = rank_files(tmp_path / "perturbed"), rank_files(launched(("sync-reselect-clip", "device")))
    assert same(perturbed[0], perturbed[1])  # rank 1's columns reach rank 0 at each boundary
    assert not same(perturbed[0], device[0])


def perturbing_rank() -> None:
    """dp_rank.main with rank 1's device accumulators perturbed (one element, 1e-3) before every ship."""
    ship = accumulation_module.ship_

    def perturbed(states, link, slot):
        if dist.get_rank() == 1:
            for _, st in states:
                if st.d_acc_count and st.d_acc.numel():
                    st.d_acc.view(-1)[0] += 1e-3
        return ship(states, link, slot)

    accumulation_module.ship_ = perturbed
    dp_rank.main()


if __name__ == "__main__":
    perturbing_rank()
