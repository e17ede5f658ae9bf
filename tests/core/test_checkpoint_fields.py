"""Checkpoints carry every field of a resume, counters and the pending selection included (zenflow/checkpoint.py).

The promises: checkpoint.py's docstring, "state_dict / load_state_dict for ZenFlowAdamW: everything needed for a
bit-identical resume. Saved: ... the step counters"; `ZenFlowAdamW.state_dict`: "Everything for a bit-exact resume";
docs/step-semantics.md, `add_param_group` after construction: "past warm-up, the next step is a selection step ...
that ranks them on their first gradient ... checkpoints include them". The resume tests elsewhere compare parameters
only, so a field that does not change this run's parameters (a counter such as `host_updates`, which the harness
reads to label each step; the pending selection, set only in the window between a join and the next step) goes
unchecked there. Here:

- a field-by-field round trip: a loaded optimizer has the saved counters, and saving it again gives back the same
  state_dict, value for value (whatever its format);
- a checkpoint taken right after `add_param_group`, before the next step: the resumed run's next step is the selection
  the straight run makes, and both end bit for bit alike.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import grad_stream

from zenflow import ZenFlowAdamW

BLOCKS = {
    "sync": {"topk_ratio": 0.25, "update_interval": 3, "select_interval": 6, "full_warm_up_rounds": 1,
             "overlap_step": False},
    "overlap": {"topk_ratio": 0.25, "update_interval": 3, "select_interval": 6, "full_warm_up_rounds": 1,
                "overlap_step": True},
    "auto": {"topk_ratio": 0.25, "update_interval": "auto", "select_interval": 6, "full_warm_up_rounds": 1,
             "overlap_step": False},
}


def assert_same(saved, loaded, where: str = "state_dict") -> None:
    """Value for value: tensors by torch.equal (and dtype), containers by keys and items."""
    if isinstance(saved, torch.Tensor):
        assert isinstance(loaded, torch.Tensor) and saved.dtype == loaded.dtype, where
        assert torch.equal(saved, loaded), where
    elif isinstance(saved, dict):
        assert isinstance(loaded, dict) and saved.keys() == loaded.keys(), f"{where}: {saved.keys()} {loaded.keys()}"
        for key in saved:
            assert_same(saved[key], loaded[key], f"{where}[{key!r}]")
    elif isinstance(saved, (list, tuple)):
        assert type(saved) is type(loaded) and len(saved) == len(loaded), where
        for i, (a, b) in enumerate(zip(saved, loaded)):
            assert_same(a, b, f"{where}[{i}]")
    else:
        assert saved == loaded, f"{where}: saved {saved!r}, loaded back {loaded!r}"


def model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 12), torch.nn.GELU(), torch.nn.Linear(12, 6))


@pytest.mark.parametrize("name", list(BLOCKS))
def test_a_loaded_optimizer_has_the_saved_counters_and_saves_the_same_state_dict(feed, name):
    net = model()
    grads = grad_stream(net, 8, seed=1)
    grads[5] = [torch.full_like(g, float("inf")) for g in grads[5]]  # one overflow step: skipped
    with ZenFlowAdamW(net.parameters(), lr=1e-2, zenflow=BLOCKS[name], skip_nonfinite=True) as opt:
        feed(net, opt, grads)
        saved = copy.deepcopy(opt.state_dict())
        counters = (opt.t, opt.skipped_steps, opt.host_updates)
    assert counters[1] == 1 and counters[2] >= 2  # the run has counters worth checking
    other = model()
    other.load_state_dict(net.state_dict())
    with ZenFlowAdamW(other.parameters(), lr=1e-2, zenflow=BLOCKS[name], skip_nonfinite=True) as loaded:
        loaded.load_state_dict(copy.deepcopy(saved))
        assert (loaded.t, loaded.skipped_steps, loaded.host_updates) == counters
        assert_same(saved, loaded.state_dict())


def test_a_checkpoint_taken_between_a_join_and_the_next_step_keeps_the_pending_selection(feed):
    block = {"topk_ratio": 0.25, "update_interval": 2, "select_interval": 10_000, "full_warm_up_rounds": 1,
             "overlap_step": False}
    net = model()
    first, rest = list(net[0].parameters()), list(net[2].parameters())
    head = [step[:2] for step in grad_stream(net, 3, seed=2)]  # only the first layer trains at first
    tail = grad_stream(net, 3, seed=3)
    straight = ZenFlowAdamW(first, lr=1e-2, zenflow=block)
    feed(net, straight, head)  # the first layer's parameters are the model's first two
    straight.add_param_group({"params": rest})  # past warm-up: the next step ranks the new weight
    saved = copy.deepcopy(straight.state_dict())  # at once: the selection is still pending
    saved_params = copy.deepcopy(net.state_dict())

    resumed_net = model()
    resumed_net.load_state_dict(saved_params)
    resumed = ZenFlowAdamW([{"params": list(resumed_net[0].parameters())},
                            {"params": list(resumed_net[2].parameters())}], lr=1e-2, zenflow=block)
    resumed.load_state_dict(saved)

    reselected = []
    for net_, opt in ((net, straight), (resumed_net, resumed)):
        before = opt.transfer_bytes.get(("d2h", "indices"), 0)
        feed(net_, opt, tail[:1])
        reselected.append(opt.transfer_bytes.get(("d2h", "indices"), 0) - before)
        feed(net_, opt, tail[1:])
        opt.close()
    assert reselected[0] > 0  # the straight run's next step selects (it ranks the new weight)
    assert reselected[1] == reselected[0], "the resumed run's next step is not the pending selection"
    for (name, a), b in zip(net.state_dict().items(), resumed_net.state_dict().values()):
        assert torch.equal(a, b), f"{name} differs after resuming from a checkpoint taken right after the join"
