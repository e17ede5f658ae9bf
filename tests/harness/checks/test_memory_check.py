"""The memory check's CPU-provable parts (zenflow/harness/checks/memory.py): the bound, the verdict
on synthetic peaks (pass, over the bound, and a negative control that stays within it), and the two hooks the
GPU run uses: the slow-copy hook restores the Link, and disabling backpressure really unbounds what overlap mode
holds (its CPU twin, tests/core/test_overlap_memory.py). The peaks themselves are measured on CUDA only, in
`make gpu-check`."""

from __future__ import annotations

import math
import time
import weakref

import torch

from zenflow import ZenFlowAdamW
from zenflow.harness.checks import memory as mc
from zenflow.harness.checks.differential import SmallNet

MiB = 2**20


def test_one_set_of_unselected_columns():
    model = torch.nn.Sequential(torch.nn.Linear(10, 4), torch.nn.LayerNorm(4),
                                torch.nn.Linear(4, 3, dtype=torch.bfloat16))
    # k = ceil(0.25 * 10) = 3 -> 4 * 7 * 4 B; k = ceil(0.25 * 4) = 1 -> 3 * 3 * 2 B; 1-D params never leave
    assert mc.unselected_bound_bytes(model, 0.25) == 4 * 7 * 4 + 3 * 3 * 2
    assert mc.unselected_bound_bytes(model, 0.0) == 4 * 10 * 4 + 3 * 4 * 2
    conv = torch.nn.Conv2d(3, 8, 3)  # [8, 3, 3, 3] is viewed as [8, 27]
    assert mc.unselected_bound_bytes(conv, 0.1) == 8 * (27 - math.ceil(2.7)) * 4
    # the GPU check's model: 4 x 4096x4096 fp32 at topk 0.25 -> 192 MiB a set, two sets in the bound
    assert mc.unselected_bound_bytes(SmallNet((4096,) * 5, seed=0), 0.25) == 4 * 4096 * 3072 * 4 == 192 * MiB
    assert mc.SETS_IN_BOUND == 2


def test_verdict_passes_within_the_bound_when_the_control_exceeds_it():
    # what the analysis predicts at 4096 wide: overlap ~1.7 sets above sync, the unbounded run several sets
    res = mc.memory_verdict(600 * MiB, 920 * MiB, 384 * MiB, 1800 * MiB)
    assert res["status"] == "pass" and res["reason"] is None
    assert res["extra_bytes"] == 320 * MiB and res["control_extra_bytes"] == 1200 * MiB
    assert [c["outcome"] for c in res["controls"]] == ["failed as expected"]


def test_verdict_fails_over_the_bound():
    res = mc.memory_verdict(100, 151, 50, 400)
    assert res["status"] == "fail" and res["extra_bytes"] == 51 and "bound" in res["reason"]


def test_verdict_fails_when_the_control_stays_within_the_bound():
    """The committed H100 record's numbers (576.2 MiB both, allocated_bytes): a metric blind to blocks in flight
    sees no difference even without backpressure, and must not vouch for the bounded run."""
    res = mc.memory_verdict(604169216, 604169216, 402653184, 604169216)
    assert res["status"] == "fail" and "negative control passed" in res["reason"]
    assert [c["outcome"] for c in res["controls"]] == ["passed"]


def test_a_control_barely_above_sync_cannot_vouch_for_the_bounded_run():
    """The control must exceed the bound, not merely sync: a metric that sees 50 MiB of several sets in flight is
    nearly blind. Exactly at the bound is not above it either; one byte over is."""
    for unbounded in (650 * MiB, 984 * MiB):  # 50 MiB above sync; exactly the bound above sync
        res = mc.memory_verdict(600 * MiB, 700 * MiB, 384 * MiB, unbounded)
        assert res["status"] == "fail" and "negative control passed" in res["reason"]
        assert [c["outcome"] for c in res["controls"]] == ["passed"]
    res = mc.memory_verdict(600 * MiB, 700 * MiB, 384 * MiB, 984 * MiB + 1)
    assert res["status"] == "pass" and [c["outcome"] for c in res["controls"]] == ["failed as expected"]


def test_the_slow_copy_hook_wraps_one_link_and_restores_it():
    model = SmallNet((8, 8, 8), seed=0)
    opt = ZenFlowAdamW(model.parameters(), zenflow={"topk_ratio": 0.25, "update_interval": 1})
    link, method = opt.link, type(opt.link).gather_to_host
    with mc.slow_d2h(link, cycles=0):  # on the CPU device the spin is skipped; the copies still happen
        assert "gather_to_host" in vars(link)
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
    assert "gather_to_host" not in vars(link) and type(link).gather_to_host is method
    opt.close()


def _slow(kind: str) -> None:
    """A HostWorker.before_job hook: the host part is slower than a training step."""
    if kind == "accumulate":
        time.sleep(0.1)


def _sets_alive(steps: int) -> int:
    """Most gradient sets alive after a step in overlap mode with a host part 0.1 s slower than the step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256, bias=False)
    opt = ZenFlowAdamW(model.parameters(), zenflow={"topk_ratio": 0.0, "update_interval": 8, "select_interval": 8,
                                                    "overlap_step": True})
    opt.worker.before_job = _slow
    alive, most = [], 0
    for i in range(steps):
        model(torch.randn(1, 256, generator=torch.Generator().manual_seed(i))).pow(2).mean().backward()
        alive.append(weakref.ref(model.weight.grad))
        opt.step()
        opt.zero_grad(set_to_none=True)
        most = max(most, sum(r() is not None for r in alive))
    opt.close()
    return most


def test_without_backpressure_overlap_holds_more_sets_than_the_bound():
    """The control's mechanism, on the CPU device (where a queued job holds its gradient): with backpressure at most
    2 gradient sets stay alive; with `without_backpressure()` the queue grows with the steps."""
    assert _sets_alive(6) <= 2
    with mc.without_backpressure():
        assert _sets_alive(6) >= 4
    assert _sets_alive(3) <= 2  # restored


def test_the_gpu_path_measures_sync_overlap_and_the_control(monkeypatch):
    """memory_check(cuda=True) with the CUDA measurement replaced: three windows, the right blocks, the bound."""
    calls = []

    def peak(block, widths, steps, backpressure=True, slow_cycles=mc.SLOW_D2H_CYCLES):
        calls.append((block["overlap_step"], backpressure, slow_cycles))
        return {(False, True): 10 * MiB, (True, True): 11 * MiB, (True, False): 40 * MiB}[calls[-1][:2]]

    monkeypatch.setattr(mc, "window_peak", peak)
    res = mc.memory_check(cuda=True, widths=(1024,) * 3, steps=6)
    assert calls == [(False, True, mc.SLOW_D2H_CYCLES), (True, True, mc.SLOW_D2H_CYCLES),
                     (True, False, mc.SLOW_D2H_CYCLES)]
    set_bytes = 2 * 1024 * 768 * 4  # 2 weights, k = 256 of 1024 columns selected
    assert res["set_bytes"] == set_bytes and res["bound_bytes"] == 2 * set_bytes
    assert res["status"] == "pass" and res["controls"][0]["outcome"] == "failed as expected"
    assert res["metric"] == "active_bytes.all.peak" and res["steps"] == 6
