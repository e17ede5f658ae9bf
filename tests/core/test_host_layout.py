"""Whole-rows host parts (zenflow/layout.py) against compact ones: the same step, bit for bit.

Whole rows change where the host keeps its columns, never what it computes: every elementwise kernel sees the same
values in the same order, so weights, state dicts, byte counters and "auto" decisions must equal the compact layout's
exactly. The shadows (the selected columns in whole-rows buffers) must never be read: poisoned with NaN, nothing
changes.
"""

from __future__ import annotations

import copy

import pytest
import torch

from zenflow.config import ConfigError
from zenflow.host import host_bytes
from zenflow.layout import host_columns, offloaded_positions, put_columns, shadow_positions, span, take_columns
from zenflow.optimizer import ZenFlowAdamW
from zenflow.state import ColumnState

CASES = {
    "sync": {},
    "overlap": {"overlap_step": True},
    "auto": {"update_interval": "auto"},
    "overlap-auto": {"overlap_step": True, "update_interval": "auto"},
    "topk-0": {"topk_ratio": 0.0},
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Linear(48, 32, bias=False)).to(torch.bfloat16)


def _optimizer(model: torch.nn.Module, layout: str, block: dict, **kw) -> ZenFlowAdamW:
    zenflow = {"topk_ratio": 0.25, "update_interval": 3, "select_interval": 4, **block}
    return ZenFlowAdamW(model.parameters(), lr=1e-2, weight_decay=0.01, zenflow=zenflow, host_layout=layout,
                        gradient_clipping=1.0, **kw)


def _batches(n: int, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(8, 64, generator=gen).to(torch.bfloat16) for _ in range(n)]


def _train(model: torch.nn.Module, opt: ZenFlowAdamW, batches: list[torch.Tensor], poison: bool = False) -> list:
    """Steps on the batches; the byte counters after each step."""
    counted = []
    for x in batches:
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if poison:
            _poison_shadows(opt)
        counted.append(dict(opt.transfer_bytes))
    return counted


def _poison_shadows(opt: ZenFlowAdamW) -> None:
    opt.worker.quiesce()
    for st in opt.state.values():
        part = getattr(st, "host", None)
        if part is None or not part.built or part.shadow.numel() == 0:
            continue
        for t in (part.master, part.exp_avg, part.exp_avg_sq, *part.accumulators):
            t.index_fill_(1, part.shadow, float("nan"))


def _run(layout: str, block: dict, steps: int = 14, poison: bool = False, **kw) -> tuple[list, dict, ZenFlowAdamW,
                                                                                         list]:
    model = _model()
    opt = _optimizer(model, layout, block, **kw)
    counted = _train(model, opt, _batches(steps), poison=poison)
    state = copy.deepcopy(opt.state_dict())  # its tensors are the live state: close() below updates them
    opt.close()
    return [p.detach().clone() for p in model.parameters()], state, opt, counted


def _assert_same_state(a: dict, b: dict) -> None:
    assert a["zenflow"] == b["zenflow"]
    for key, entry in a["state"].items():
        for name, value in entry.items():
            other = b["state"][key][name]
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, other), name
            elif isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
                assert all(torch.equal(x, y) for x, y in zip(value, other, strict=True)), name
            else:
                assert value == other, name


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
@pytest.mark.parametrize("accumulate_on", ["host", "device"])
def test_whole_rows_equal_compact_bit_for_bit(case: str, accumulate_on: str) -> None:
    compact = _run("compact", CASES[case], accumulate_on=accumulate_on)
    rows = _run("rows", CASES[case], accumulate_on=accumulate_on)
    assert all(torch.equal(x, y) for x, y in zip(compact[0], rows[0], strict=True))
    _assert_same_state(compact[1], rows[1])  # the same checkpoint: rows save without their shadows
    assert compact[2].selections == rows[2].selections and compact[2].host_updates == rows[2].host_updates
    assert compact[3] == rows[3]  # every step's bytes by direction and kind: the shadows cross no link


@pytest.mark.parametrize("case", ["sync", "overlap"])
def test_shadows_are_never_read(case: str) -> None:
    clean = _run("rows", CASES[case])
    poisoned = _run("rows", CASES[case], poison=True)
    assert all(torch.equal(x, y) for x, y in zip(clean[0], poisoned[0], strict=True))
    assert all(torch.isfinite(p).all() for p in poisoned[0])


def test_the_cpu_device_takes_whole_rows_by_default() -> None:
    model = _model()
    with _optimizer(model, "auto", {}) as opt:
        _train(model, opt, _batches(2))
        st = opt.state[model[0].weight]
        assert opt.whole_rows and isinstance(st, ColumnState)
        assert st.host.n_host == 64 and st.host.shadow.numel() == st.sel.numel() == 16
        assert st.host.master.shape == (48, 64)
        assert torch.equal(st.host.cols[st.host.shadow], st.sel)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_whole_rows_hold_every_column_of_the_block_in_host_bytes(overlap: bool) -> None:
    model = _model()
    with _optimizer(model, "rows", {"overlap_step": overlap}) as opt:
        _train(model, opt, _batches(5))
        elements = [p.shape[0] * p.shape[1] for p in model.parameters() if p.dim() == 2]  # shadows included
        assert opt.host_state_bytes == host_bytes(elements, 2, overlap_step=overlap, cuda=False)


@pytest.mark.parametrize("saved, loaded", [("rows", "compact"), ("compact", "rows"), ("rows", "rows")])
@pytest.mark.parametrize("accumulate_on", ["host", "device"])
def test_a_checkpoint_of_either_layout_resumes_in_the_other(saved: str, loaded: str, accumulate_on: str) -> None:
    block, batches = {"update_interval": 4}, _batches(10)
    straight = _model()
    with _optimizer(straight, loaded, block, accumulate_on=accumulate_on) as opt:
        _train(straight, opt, batches)
    first = _model()
    with _optimizer(first, saved, block, accumulate_on=accumulate_on) as opt:
        _train(first, opt, batches[:6])  # mid-interval, after a reselection: a partial sum, shadows in rows
        state = copy.deepcopy(opt.state_dict())
        weights = {k: v.clone() for k, v in first.state_dict().items()}
        opt.close(flush=False)
    resumed = _model()
    resumed.load_state_dict(weights)
    with _optimizer(resumed, loaded, block, accumulate_on=accumulate_on) as opt:
        opt.load_state_dict(state)
        _train(resumed, opt, batches[6:])
    assert all(torch.equal(x, y) for x, y in zip(straight.parameters(), resumed.parameters(), strict=True))


def test_a_bad_host_layout_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match=r"host_layout = 'columns' is not allowed: expected one of "
                                          r"\('auto', 'compact', 'rows'\)"):
        _optimizer(_model(), "columns", {})


def test_column_helpers_move_exactly_what_index_select_moves() -> None:
    gen = torch.Generator().manual_seed(3)
    t = torch.randn(7, 40, generator=gen).to(torch.bfloat16)
    scattered, run = torch.tensor([0, 3, 4, 9, 39]), torch.arange(10, 25)
    assert span(scattered) is None and span(run) == slice(10, 25)
    for columns in (scattered, run):
        assert torch.equal(take_columns(t, columns), t.index_select(1, columns))
        out = torch.empty(7, columns.numel(), dtype=t.dtype)
        assert take_columns(t, columns, out=out) is out and torch.equal(out, t.index_select(1, columns))
    block, selected = torch.arange(8, 16), torch.tensor([2, 9, 12])
    assert host_columns(block, selected, rows=False).tolist() == [8, 10, 11, 13, 14, 15]
    assert torch.equal(host_columns(block, selected, rows=True), block)
    assert shadow_positions(block, selected).tolist() == [1, 4]  # columns 9 and 12 of this block
    assert offloaded_positions(8, torch.tensor([1, 4])).tolist() == [0, 2, 3, 5, 6, 7]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits: NaN payloads and -0.0 compare as what they are."""
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_take_and_put_columns_move_every_bit_as_index_select_and_index_copy(dtype: torch.dtype) -> None:
    """The CPU moves 16-bit floats as int16 and scatters with `scatter_`: the bits must be exactly those of the
    plain kernels, NaN payloads, infinities and -0.0 included, for scattered columns, one run, none, and no rows."""
    gen = torch.Generator().manual_seed(4)
    t = torch.randn(9, 64, generator=gen).to(dtype)
    t[0, :4] = torch.tensor([float("nan"), float("-inf"), -0.0, float("inf")], dtype=dtype)
    src = torch.randn(9, 64, generator=gen).to(dtype)
    src[1, :3] = torch.tensor([float("nan"), -0.0, float("-inf")], dtype=dtype)
    for columns in (torch.tensor([0, 1, 2, 5, 17, 40, 63]), torch.arange(20, 31), torch.empty(0, dtype=torch.long)):
        k = columns.numel()
        assert torch.equal(_bits(take_columns(t, columns)), _bits(t.index_select(1, columns)))
        out = torch.empty(k, 9, dtype=dtype).t()  # a strided destination
        assert take_columns(t, columns, out=out) is out
        assert torch.equal(_bits(out), _bits(t.index_select(1, columns)))
        block = src[:, :k]  # a strided source
        want = t.clone().index_copy_(1, columns, block)
        got = t.clone()
        assert put_columns(got, columns, block) is got
        assert torch.equal(_bits(got), _bits(want))
    with pytest.raises(ValueError, match=r"put_columns: a block of shape \(9, 8\) into 7 columns of \(9, 64\)"):
        put_columns(t.clone(), torch.tensor([0, 1, 2, 5, 17, 40, 63]), src[:, :8])  # one column too many
    no_rows = torch.empty(0, 64, dtype=dtype)
    assert take_columns(no_rows, torch.tensor([3, 7])).shape == (0, 2)
    assert put_columns(no_rows, torch.tensor([3, 7]), torch.empty(0, 2, dtype=dtype)).shape == (0, 64)
