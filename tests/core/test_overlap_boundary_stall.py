"""The boundary's wait for the overlapped host update is booked as stall (zenflow/optimizer.py, overlap_step).

The promises: docs/step-semantics.md, overlap: "boundary `b+1` waits for `b`" (it applies the host update the
previous boundary started in the background); zenflow/telemetry/timeline.py: "waits for the host optimizer are
stall", and docs/records.md lists `host_wait` among the blocking sections io/stall are made of. So every boundary
that applies an overlapped host update enters a `host_wait` blocking section, and the StepTimeline books it in that
step's stall. tests/core/test_overlap_memory.py pins only the other wait site (backpressure, which U = 1 never reaches:
each boundary has already waited), so here U = 1 and every step after the first is such a boundary.
"""

from __future__ import annotations

import torch

from zenflow import ZenFlowAdamW
from zenflow.telemetry.timeline import StepTimeline

STEPS = 6


class Blocks:
    """An observer: the blocking sections entered during each step."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.entered: dict[int | None, list[str]] = {}

    def on_transfer(self, direction: str, kind: str, nbytes: int) -> None:
        pass

    def on_block_start(self, what: str) -> None:
        self.entered.setdefault(self.step, []).append(what)

    def on_block_end(self, what: str) -> None:
        pass


def test_every_overlapped_boundary_books_its_wait_for_the_previous_host_update_as_stall():
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 32, bias=False)
    grads = [torch.randn(32, 64) for _ in range(STEPS)]
    block = {"topk_ratio": 0.25, "update_interval": 1, "overlap_step": True, "full_warm_up_rounds": 0,
             "select_interval": 10_000}
    blocks, timeline = Blocks(), StepTimeline()
    with ZenFlowAdamW(layer.parameters(), lr=1e-2, zenflow=block) as opt:
        opt.add_observer(blocks)
        opt.add_observer(timeline)
        for s, grad in enumerate(grads):
            blocks.step = s
            timeline.start_step(s)
            layer.weight.grad = grad
            before = opt.host_updates
            opt.step()
            opt.zero_grad()
            assert opt.host_updates == before + 1  # U = 1: every step is a boundary
        timeline.finish()
        blocks.step = None
    for s in range(1, STEPS):  # boundary s applies the host update boundary s - 1 started
        assert "host_wait" in blocks.entered.get(s, []), f"step {s}: the boundary's wait was not a host_wait section"
        booked = timeline.steps[s]
        assert booked.blocks_ms.get("host_wait", 0.0) > 0, f"step {s}: no host_wait time booked ({booked.blocks_ms})"
        assert booked.stall_ms >= booked.blocks_ms["host_wait"], f"step {s}: host_wait not counted as stall"
