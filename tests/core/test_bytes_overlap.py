"""Gradient bytes under overlap_step are counted once per step, however many staging buffers (zenflow/optimizer.py).

The promise: docs/step-semantics.md, "Bytes per step": ZenFlow moves `(1−r)·N·b` of gradients down every step (kind
`grads`, direction `d2h` in `opt.transfer_bytes`); docs/gpu-check.md checks those counters against NVML so that a
transfer "counted twice" shows. With overlap_step on CUDA the host part has two gradient staging views per column
param (docs/host-worker.md: "`n_grad` gradient views", n_grad = 2 on CUDA with overlap_step), used in turn; a step's
gradient still crosses once, into one of them.

Two tests:
- on a CUDA device, the real case (skipped without CUDA: a skip kills nothing);
- a CPU twin: the device is the CPU, but the link says it is CUDA (`Link.cuda` set on a fake whose copies are the CPU
  device's plain synchronous copies), which is the condition the optimizer reads to keep two gradient staging views;
  the arena's size (`host_staging_bytes`, docs/host-worker.md's formula) shows the twin really took that path.
"""

from __future__ import annotations

import copy

import pytest
import torch

from zenflow import ZenFlowAdamW
from zenflow.link import Link, StagingArena, aligned

WIDTHS = (16, 8)
ROWS = 6
SELECTED = (4, 2)  # topk_ratio 0.25
STEPS = 6
BLOCK = {"topk_ratio": 0.25, "update_interval": 2, "overlap_step": True, "full_warm_up_rounds": 0,
         "select_interval": 10_000}


def grads_per_step(device: torch.device) -> tuple[list[int], int]:
    """The d2h `grads` bytes counted at each step, and the staging arena's size after the run."""
    gen = torch.Generator().manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(ROWS, w, generator=gen).to(device)) for w in WIDTHS]
    seen = []
    # compact host parts: the layout of a CUDA device, whose staging this counts (the CPU twin fakes only the link)
    with ZenFlowAdamW(weights, lr=1e-2, zenflow=BLOCK, host_layout="compact") as opt:
        for _ in range(STEPS):
            for w in weights:
                w.grad = torch.randn(w.shape, generator=gen).to(device)
            before = opt.transfer_bytes.get(("d2h", "grads"), 0)
            opt.step()
            seen.append(opt.transfer_bytes.get(("d2h", "grads"), 0) - before)
            opt.zero_grad()
        staging = opt.host_staging_bytes
    return seen, staging


def expected() -> tuple[list[int], int]:
    host_views = [4 * ROWS * (w - k) for w, k in zip(WIDTHS, SELECTED)]  # fp32: one view of a step's host columns
    two_gradient_views_and_one_parameter_view = 3 * sum(aligned(n) for n in host_views)
    return [sum(host_views)] * STEPS, two_gradient_views_and_one_parameter_view


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: two gradient staging views exist only "
                    "on CUDA with overlap_step (the CPU twin below fakes that condition)")
def test_on_cuda_overlap_counts_each_steps_gradient_once():
    seen, staging = grads_per_step(torch.device("cuda"))
    per_step, arena = expected()
    assert staging == arena  # the case under test: two gradient staging views per column param
    assert seen == per_step


@pytest.fixture
def link_says_cuda(monkeypatch):
    """Every Link reports `cuda = True` but moves data as the CPU device does (a plain CPU Link does the copies)."""
    real_init = Link.__init__

    def init(self, device, observers):
        real_init(self, device, observers)
        self.cpu_link = copy.copy(self)  # a genuine CPU link: its copies are synchronous and complete on return
        self.cuda = True

    monkeypatch.setattr(Link, "__init__", init)
    for name in ("host_empty", "compute_event", "to_host", "to_device", "gather_to_host", "scatter_to_device",
                 "wait", "synchronize"):
        real = getattr(Link, name)
        monkeypatch.setattr(Link, name, lambda self, *a, _real=real, **k: _real(self.cpu_link, *a, **k))
    real_carve = StagingArena.carve

    def carve(self, layout):  # the arena pins its buffer when its link is CUDA: carve it as the CPU link would
        link, self.link = self.link, self.link.cpu_link
        try:
            return real_carve(self, layout)
        finally:
            self.link = link

    monkeypatch.setattr(StagingArena, "carve", carve)
    monkeypatch.setattr(StagingArena, "pin", lambda self: None)  # nothing to page-lock without CUDA


def test_cpu_twin_with_a_link_that_says_cuda_counts_each_steps_gradient_once(link_says_cuda):
    seen, staging = grads_per_step(torch.device("cpu"))
    per_step, arena = expected()
    assert staging == arena  # the fake took effect: two gradient staging views, as on CUDA
    assert seen == per_step
