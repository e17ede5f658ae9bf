"""The NVML window covers the timed steps only: the sampler starts when warm-up ends (zenflow/harness/session.py).

The promises: session.py, where `Session.step` starts the sampler: "NVML: the timed steps only"; docs/records.md:
where an engine has no byte counters "on a GPU, NVML PCIe counters cover it", so those counters must not include the
warm-up steps (the first selection, the full-offload warm-up); a run with no timed step has no NVML result ("no timed
steps"). This host has no NVML driver, so the sampler is replaced by a fake (its `__enter__` on the class, wherever
the session imports it from) that records the step the session is at when the window opens.
"""

from __future__ import annotations

import pytest

from zenflow.harness.session import Session
from zenflow.telemetry.nvml import NvmlSampler

WARMUP = 2


class Window:
    """What the fake sampler saw: the session step at each `__enter__`."""

    def __init__(self) -> None:
        self.session: Session | None = None
        self.opened_at: list[int] = []


@pytest.fixture
def window(monkeypatch) -> Window:
    seen = Window()

    def enter(sampler: NvmlSampler) -> None:
        seen.opened_at.append(seen.session.i)
        return None  # "not sampling": nothing to stop or read back

    monkeypatch.setattr(NvmlSampler, "__enter__", enter)
    return seen


def test_the_nvml_sampler_starts_once_at_the_first_timed_step(window, run_spec, tiny_workload):
    workload = {**tiny_workload, "device": "cpu", "data": "synthetic"}
    spec = run_spec("ref-zenflow", label="nvml-window", workload=workload, warmup_steps=WARMUP, timed_steps=2,
                    telemetry=True, threads=1)
    session = Session(spec)
    window.session = session
    try:
        for _ in range(WARMUP):
            session.step(1)
            assert window.opened_at == [], f"the NVML window opened during warm-up (step {window.opened_at})"
        session.step(2)
    finally:
        session.close()
    assert window.opened_at == [WARMUP]  # once, as the first timed step starts
