"""The CUDA-vs-CPU differential: the same seed, model and batches trained with ZenFlowAdamW on the
GPU and on the CPU end within a stated tolerance (zenflow/harness/checks/gpu.py: RTOL, ATOL and why). It is the test
that catches stream races. On a CPU-only machine the comparison itself is proven: two CPU runs are bit-identical,
and a run that trained on one different batch, or whose weight rows were overwritten once the way a race does it,
is flagged. The CUDA add of device accumulation (device_accumulation.add_on_device_), which no CPU-device run
reaches, is held here to the host's arithmetic on CPU tensors, and trained through on the CPU in its case."""

from __future__ import annotations

import copy
from typing import Any
from unittest import mock

import pytest
import torch

from zenflow import ZenFlowAdamW
from zenflow import device_accumulation as da
from zenflow.harness.checks import differential as d
from zenflow.host import accumulate_into_

STEPS = 24
WIDTHS = (96, 192, 192, 96)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: compares a GPU run with a CPU run")
@pytest.mark.parametrize("case", list(d.CASES))
def test_cuda_run_matches_the_cpu_run_within_tolerance(case):
    block, clipping, accumulate_on = d.CASES[case]
    with d.fp32_matmuls():
        on_gpu = d.train_case("cuda", block, clipping, STEPS, d.CUDA_WIDTHS, accumulate_on=accumulate_on)
        on_cpu = d.train_case("cpu", block, clipping, STEPS, d.CUDA_WIDTHS, accumulate_on=accumulate_on)
    result = d.compare(on_cpu, on_gpu)
    assert result["ok"], result


class Recorded(ZenFlowAdamW):
    """ZenFlowAdamW that keeps each step's host-side clipping coefficient (None: not clipped), for train_run."""

    made: list[Recorded] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.coefficients: list[float | None] = []
        Recorded.made.append(self)

    def step(self, closure: Any = None) -> Any:
        loss = super().step(closure)
        self.coefficients.append(None if self.clip.host is None else float(self.clip.host))
        return loss


@pytest.mark.parametrize("case", ["ref-zenflow-sync", "ref-zenflow-overlap", "ref-zenflow-da-overlap"])
def test_the_zenflow_cases_reselect_several_times_and_clip(case, monkeypatch):
    """What the differential exercises must really happen, observed in the case's own run (train_run, GPU widths):
    reselections that move columns, several times, and clipping computed at every step. Where the case is there for
    device accumulation, the coefficient is below 1 at every step: at 1 an add that dropped it would not show."""
    block, clipping, accumulate_on = d.CASES[case]
    monkeypatch.setattr(d, "ZenFlowAdamW", Recorded)
    monkeypatch.setattr(Recorded, "made", [])
    run = d.train_run("cpu", block, clipping, STEPS, d.CUDA_WIDTHS, accumulate_on=accumulate_on)
    (opt,) = Recorded.made
    assert opt.accumulate_on == accumulate_on and opt.config.overlap_step == (case != "ref-zenflow-sync")
    assert opt.selections >= 4 and run.columns_moved > 0  # the first selection and at least 3 reselections
    assert len(opt.coefficients) == STEPS and None not in opt.coefficients
    if accumulate_on == "device":
        assert max(opt.coefficients) < 0.5, opt.coefficients


@pytest.mark.parametrize("case", list(d.CASES))
def test_two_cpu_runs_are_bit_identical(case):
    block, clipping, accumulate_on = d.CASES[case]
    a = d.train_case("cpu", block, clipping, STEPS, WIDTHS, accumulate_on=accumulate_on)
    b = d.train_case("cpu", block, clipping, STEPS, WIDTHS, accumulate_on=accumulate_on)
    result = d.compare(a, b)
    assert result["ok"] and result["max_abs"] == 0.0 and result["elements_outside"] == 0


def test_a_run_on_one_different_batch_is_flagged():
    block, clipping, _ = d.CASES["ref-zenflow-overlap"]
    batches = d.make_batches(WIDTHS, STEPS, seed=0)
    ref = d.train_case("cpu", block, clipping, STEPS, WIDTHS, batches=batches)
    batches[10] = d.make_batches(WIDTHS, 1, seed=99)[0]
    other = d.train_case("cpu", block, clipping, STEPS, WIDTHS, batches=batches)
    result = d.compare(ref, other)
    assert not result["ok"] and result["elements_outside"] > 0 and result["max_ratio"] > 1


def test_rows_overwritten_once_like_a_stream_race_are_flagged():
    """What a cross-stream race in the uploads does: ~100 rows of a weight get another weight's values at one step."""
    block, clipping, _ = d.CASES["ref-offload"]
    ref = d.train_case("cpu", block, clipping, STEPS, WIDTHS)
    model = d.SmallNet(WIDTHS, seed=0)
    opt = ZenFlowAdamW(model.parameters(), zenflow=copy.deepcopy(block), gradient_clipping=clipping, **d.DIFF_HYPER)
    losses = []
    for i, (x, y) in enumerate(d.make_batches(WIDTHS, STEPS, seed=0)):
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
        if i == 12:
            with torch.no_grad():  # the landing buffer of the next weight of the same shape, read too late
                model.net[3].weight[:8].copy_(model.net[3].weight[8:16])
    opt.close()
    raced = {n: p.detach().clone() for n, p in model.named_parameters()} | {"<losses>": torch.stack(losses)}
    result = d.compare(ref, raced)
    # ref-offload uploads every column from the host master at the next step, which repairs the weight; what stays
    # is the one step trained on wrong weights, still an order of magnitude above the tolerance
    assert not result["ok"] and result["max_ratio"] > 10


@pytest.mark.parametrize("case", ["ref-zenflow-overlap", "ref-zenflow-da-overlap"])
def test_rounding_level_noise_stays_well_inside_the_tolerance(case):
    """The CPU twin of what separates a GPU run from a CPU run: every input and target perturbed by ~16 ulp (more
    than a different summation order gives) on the GPU-sized model. It must stay far inside the tolerance, or the
    differential would flag hardware instead of bugs (the device-accumulation case clips every step)."""
    block, clipping, accumulate_on = d.CASES[case]
    gen = torch.Generator().manual_seed(5)

    def ulps(t: torch.Tensor) -> torch.Tensor:
        return t * (1 + 16 * 2**-23 * torch.randn(t.shape, generator=gen))

    batches = d.make_batches(d.CUDA_WIDTHS, STEPS, seed=0)
    ref = d.train_case("cpu", block, clipping, STEPS, d.CUDA_WIDTHS, batches=batches, accumulate_on=accumulate_on)
    noisy = d.train_case("cpu", block, clipping, STEPS, d.CUDA_WIDTHS, batches=[(ulps(x), ulps(y))
                                                                                   for x, y in batches],
                          accumulate_on=accumulate_on)
    result = d.compare(ref, noisy)
    assert 0 < result["max_abs"] and result["max_ratio"] < 0.25, result


def test_compare_uses_the_stated_tolerance_and_rejects_nan():
    ref = {"w": torch.tensor([1.0, -2.0, 0.0])}
    inside = {"w": ref["w"] + torch.tensor([0.5e-4, 1.9e-4, 0.9e-5])}  # atol 1e-5 + rtol 1e-4 * |ref|
    outside = {"w": ref["w"] + torch.tensor([0.0, 0.0, 1.1e-5])}
    assert d.compare(ref, inside)["ok"]
    bad = d.compare(ref, outside)
    assert not bad["ok"] and bad["elements_outside"] == 1 and bad["worst"] == "w"
    assert not d.compare(ref, {"w": torch.tensor([1.0, float("nan"), 0.0])})["ok"]
    with pytest.raises(ValueError, match="different tensors"):
        d.compare(ref, {"v": ref["w"]})


# ---- device accumulation's CUDA add, on the CPU (no CPU-device run reaches it) -------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cuda_add_of_device_accumulation_is_the_hosts_accumulation(dtype):
    """add_on_device_ on CPU tensors against host.accumulate_into_: the interval's first gradient scaled, later ones
    added with their own clipping coefficient, each within a rounding (torch's add_ may not fuse on the CPU)."""
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(64, 48, generator=gen).to(dtype) for _ in range(3)]
    on_device, on_host = torch.empty(64, 48), torch.empty(64, 48)
    for i, (grad, scale) in enumerate(zip(grads, (0.37, 0.52, 0.81))):
        da.add_on_device_(on_device, grad, scale, first=i == 0)
        accumulate_into_(on_host, grad, scale, first=i == 0)
        torch.testing.assert_close(on_device, on_host, rtol=2**-21, atol=2**-20)  # a few ulp of values ~1-4


def test_the_device_accumulation_case_through_the_cuda_add_trains_what_the_cpu_device_trains():
    """The GPU check's device-accumulation case on the CPU, with every add made by add_on_device_ (the CUDA path's
    arithmetic) instead of the CPU device's accumulate_into_: within the differential's tolerance of the CPU run.
    Its clipping coefficient is below 1 at every step, so a coefficient dropped in the CUDA add is far outside."""
    block, clipping, accumulate_on = d.CASES["ref-zenflow-da-overlap"]
    assert accumulate_on == "device"
    with d.fp32_matmuls():
        on_cpu = d.train_case("cpu", block, clipping, STEPS, d.CUDA_WIDTHS, accumulate_on=accumulate_on)
        with mock.patch.object(da, "accumulate_into_", da.add_on_device_):  # _add_'s CPU branch, rerouted
            through_cuda_add = d.train_case("cpu", block, clipping, STEPS, d.CUDA_WIDTHS, accumulate_on=accumulate_on)
    result = d.compare(on_cpu, through_cuda_add)
    assert result["ok"], result
