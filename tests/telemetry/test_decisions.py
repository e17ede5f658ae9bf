"""Each step record carries what the optimizer decided in it (`decisions`: host-update boundaries and selections,
hooks.DECISIONS), through the observer API: the trace of the intervals "auto" chose (zenflow/reports/knobs.py)."""

from __future__ import annotations

import torch

from zenflow import ZenFlowAdamW
from zenflow.harness.session import step_row
from zenflow.telemetry.timeline import StepTimeline


def _train(block: dict, steps: int) -> tuple[list[dict], list[int], list[int], ZenFlowAdamW]:
    """`steps` steps of a small model, timed by a StepTimeline attached as the harness attaches it; the step rows,
    and the steps at which the optimizer's own counters moved (host updates, selections)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16))
    opt = ZenFlowAdamW(model.parameters(), lr=1e-2, zenflow=block)
    timeline = StepTimeline()
    opt.add_observer(timeline)
    updated, selected = [], []
    with opt:
        for i in range(steps):
            timeline.start_step(i)
            x = torch.randn(8, 16)
            (model(x) - x.flip(1)).pow(2).mean().backward()
            before = (opt.host_updates, opt.selections)
            opt.step()
            opt.zero_grad()
            updated += [i] * (opt.host_updates - before[0])
            selected += [i] * (opt.selections - before[1])
        timeline.finish()
    return [step_row(t) for t in timeline.steps], updated, selected, opt


def _steps_with(rows: list[dict], what: str) -> list[int]:
    return [r["step"] for r in rows for _ in range((r["decisions"] or {}).get(what, 0))]


def test_auto_update_interval_boundaries_and_selections_are_in_the_step_rows():
    rows, updated, selected, opt = _train({"topk_ratio": 0.25, "update_interval": "auto", "select_interval": 8,
                                           "max_update_interval": 5}, steps=30)
    assert opt.host_updates >= 4 and opt.selections >= 3  # the trace below has something to show
    assert _steps_with(rows, "host_update") == updated
    assert _steps_with(rows, "selection") == selected
    gaps = [b - a for a, b in zip(updated, updated[1:])]
    assert max(gaps) <= 5  # the cap the optimizer was given, read back from the records' trace


def test_fixed_interval_trace_is_every_update_interval_steps():
    rows, updated, _, _ = _train({"topk_ratio": 0.25, "update_interval": 3, "select_interval": 300}, steps=12)
    assert _steps_with(rows, "host_update") == updated == [2, 5, 8, 11]
    assert [r["decisions"] for r in rows[:2]] == [{"selection": 1}, None]  # nothing decided: no field
