"""Host or device accumulation is decided once: ZenFlowAdamW builds a HostSums or a DeviceSums
(device_accumulation.py) at construction, and that object owns the four places where the two modes differ; the
optimizer never compares `accumulate_on` again. The bit-for-bit equality of the two modes, and of the mode with the
code before this split, is the oracles' (test_device_accumulation.py, test_oracles.py)."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import Interleaved, grad_stream, set_grads

import zenflow.device_accumulation as accumulation_module
import zenflow.optimizer as optimizer_module
from zenflow import ZenFlowAdamW
from zenflow.config import ConfigError
from zenflow.device_accumulation import DeviceSums, HostSums
from zenflow.state import ColumnState

ROOT = Path(__file__).resolve().parents[2]
WIDTHS = [10, 16, 12]
BLOCK = dict(topk_ratio=0.25, update_interval=2, select_interval=4)


def test_the_optimizer_never_compares_the_accumulation_mode():
    """The mode used to be re-decided at four places of every step (`if self.accumulate_on == "device"`): the
    strategy object decides now, so no comparison of the mode or of its values is left in optimizer.py."""
    mode = re.compile(r"accumulate_on\s*(==|!=|\bin\b)"  # the keyword compared, or either value compared
                      r"""|(==|!=)\s*["'](device|host)["']|["'](device|host)["']\s*(==|!=)""")
    lines = (ROOT / "zenflow" / "optimizer.py").read_text().splitlines()
    found = [f"optimizer.py:{i}: {line.strip()}" for i, line in enumerate(lines, 1) if mode.search(line)]
    assert len(lines) > 200 and found == []


def test_the_staging_count_rule_is_written_once():
    """`2 if overlap_step and cuda else 1` was written three times (two in the optimizer, one in host_bytes): now
    host.grad_staging_count is the only place."""
    rule = re.compile(r"2 if \w*overlap\w* and [\w.]*cuda else 1")
    files = ["optimizer.py", "host.py", "device_accumulation.py", "device.py", "ownership.py", "state.py"]
    found = [f"{name}:{i}" for name in files
             for i, line in enumerate((ROOT / "zenflow" / name).read_text().splitlines(), 1) if rule.search(line)]
    assert len(found) == 1 and found[0].startswith("host.py:")


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("accumulate_on, kind, n_staging", [("host", HostSums, 1), ("device", DeviceSums, 0)])
def test_the_strategy_is_built_once_at_construction(accumulate_on, kind, n_staging, overlap, monkeypatch):
    built = []

    def counted(*args):
        built.append(accumulation_module.accumulation(*args))
        return built[-1]

    monkeypatch.setattr(optimizer_module, "accumulation", counted)
    model = Interleaved(WIDTHS, seed=1)
    opt = ZenFlowAdamW(model.parameters(), lr=1e-2, zenflow={**BLOCK, "overlap_step": overlap},
                       accumulate_on=accumulate_on)
    assert type(opt.accumulation) is kind and opt.accumulation.n_staging == n_staging  # CPU: one staging buffer
    for grads in grad_stream(model, 6, seed=2):  # selections and boundaries
        set_grads(model, grads)
        opt.step()
    opt.close()
    assert built == [opt.accumulation] and opt.host_updates >= 2
    parts = [st.host for st in opt.state.values() if isinstance(st, ColumnState)]
    assert parts and all(part.n_staging == n_staging for part in parts)


def test_the_default_is_host_accumulation():
    assert type(ZenFlowAdamW(Interleaved(WIDTHS).parameters()).accumulation) is HostSums


def test_a_bad_mode_is_refused_in_one_line_before_any_work(monkeypatch):
    work = []
    monkeypatch.setattr(optimizer_module, "accumulation", lambda *args: work.append("accumulation"))
    monkeypatch.setattr(optimizer_module, "Link", lambda *args: work.append("link"))
    for bad in ("gpu", "Device", None):
        with pytest.raises(ConfigError) as refused:
            ZenFlowAdamW(Interleaved(WIDTHS).parameters(), accumulate_on=bad)
        assert "\n" not in str(refused.value) and str(refused.value).startswith(f"accumulate_on = {bad!r}")
    assert work == []


class FakeWorker:
    def __init__(self) -> None:
        self.waits = 0

    def backpressure(self) -> None:
        self.waits += 1


@pytest.mark.parametrize("cuda, overlap, turns", [(True, True, [0, 1, 0, 1]), (True, False, [0, 0, 0, 0]),
                                                  (False, True, [0, 0, 0, 0])])
def test_host_sums_alternate_two_staging_buffers_only_on_cuda_with_overlap(cuda, overlap, turns, monkeypatch):
    """Seams 1 and 2 of host accumulation: the staging count, and each step's copies into the next buffer in turn,
    after the worker has read it (backpressure) when the accumulation runs in the background."""
    started = []
    monkeypatch.setattr(accumulation_module, "start_offload",
                        lambda params, state, link, turn: started.append(turn) or [])
    worker = FakeWorker()
    sums = HostSums(SimpleNamespace(cuda=cuda), worker, overlap)
    assert sums.n_staging == (2 if cuda and overlap else 1)
    for _ in turns:
        sums.start_offload([], {}, in_background=overlap)
    assert started == turns and worker.waits == (len(turns) if overlap else 0)
    assert sums.ship([], 0) == []  # host accumulation: nothing is left to cross at a boundary


def test_device_sums_cross_nothing_per_step(monkeypatch):
    monkeypatch.setattr(accumulation_module, "start_offload", lambda *args: pytest.fail("a per-step copy"))
    sums = DeviceSums(SimpleNamespace(cuda=True))
    assert sums.n_staging == 0 and sums.start_offload([torch.zeros(2, 2)], {}, in_background=True) == []
