"""The host memory ZenFlowAdamW holds (docs/history.md, "Llama-2-7B on one GPU host"): no full-width host state at
construction, host buffers only for host-owned columns, every staging buffer a view into one arena, `host_state_bytes`
equal to `host.host_bytes` and to a hand computation, and no selection work at all with topk_ratio 0. Every optimizer
here is `host_layout="compact"`: the host memory of a GPU host, what host.host_bytes and the memory plan describe; whole
rows (the CPU device's default) hold every column of the block, tests/core/test_host_layout.py."""

from __future__ import annotations

import io
import math
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import Interleaved, clone_model, column_params, grad_stream

from zenflow import ZenFlowAdamW
from zenflow.checkpoint import consolidate, shard
from zenflow.host import host_bytes
from zenflow.link import ALIGN
from zenflow.selection import num_selected

WIDTHS = [12, 20, 9, 5]  # column params [20, 12], [9, 20], [5, 9]: view sizes that are not multiples of ALIGN


def host_elements(model: torch.nn.Module, topk: float) -> list[int]:
    """out x (in - k) per column param: what a single process's host owns after a selection."""
    return [p.shape[0] * (p.shape[1] - num_selected(p.shape[1], topk)) for p in column_params(model)]


def full_elements(model: torch.nn.Module) -> list[int]:
    return [p.numel() for p in column_params(model)]


def parts(opt: ZenFlowAdamW, model: torch.nn.Module) -> list:
    return [opt.state[p].host for p in column_params(model)]


# ---- no full-width host state -------------------------------------------------------------------------------------
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_nothing_is_held_before_the_first_step_and_only_host_columns_after_it(feed, zenflow_opt, overlap):
    """Hand computation, fp32, topk 0.25, CPU device (one gradient staging buffer): after the first selection the
    host holds master, moments and 1 or 2 accumulators (4 bytes each) of the host-owned columns only, and an arena
    of 2 views per weight (gradient and parameter staging), each rounded up to 64 bytes."""
    model = Interleaved(WIDTHS, seed=0)
    opt = zenflow_opt(model, host_layout="compact", topk_ratio=0.25, update_interval=2, select_interval=2,
                      overlap_step=overlap)
    assert opt.host_state_bytes == 0 and not any(part.built for part in parts(opt, model))
    # [20, 12]: k = 3, 20 x 9 = 180; [9, 20]: k = 5, 9 x 15 = 135; [5, 9]: k = 3, 5 x 6 = 30
    n_acc = 2 if overlap else 1
    state = (4 * 3 + 4 * n_acc) * (180 + 135 + 30)
    arena = 2 * (ALIGN * math.ceil(180 * 4 / ALIGN) + ALIGN * math.ceil(135 * 4 / ALIGN)
                 + ALIGN * math.ceil(30 * 4 / ALIGN))  # 2 x (768 + 576 + 128)
    assert arena == 2944
    moved = 0
    for t, grads in enumerate(grad_stream(model, 5, seed=1)):  # selections at t = 0, 2, 4
        before = [part.cols.clone() for part in parts(opt, model)]
        feed(model, opt, [grads])
        moved += t > 0 and any(not torch.equal(a, part.cols) for a, part in zip(before, parts(opt, model)))
        assert opt.host_state_bytes == state + arena, t
        assert opt.host_staging_bytes == arena
        assert all(part.n_host == p.shape[1] - num_selected(p.shape[1], 0.25) for part, p in
                   zip(parts(opt, model), column_params(model)))
    assert moved, "no reselection moved a column: the test checks nothing after one"
    opt.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("warm", [0, 2])
def test_host_state_bytes_is_host_bytes_exactly(feed, zenflow_opt, dtype, overlap, warm):
    """Before the first step, during warm-up (full width), after the first selection and after later reselections
    (the arena keeps the largest layout it has had: with warm-up, the full width)."""
    model = Interleaved(WIDTHS, dtype=dtype, seed=0)
    opt = zenflow_opt(model, host_layout="compact", topk_ratio=0.25, update_interval=2, select_interval=3,
                      full_warm_up_rounds=warm, overlap_step=overlap)
    b = torch.finfo(dtype).bits // 8
    expect = lambda host, arena=None: host_bytes(host, b, overlap_step=overlap, cuda=False,  # noqa: E731
                                                  arena_elements=arena)
    assert opt.host_state_bytes == expect([]) == 0
    arena = full_elements(model) if warm else host_elements(model, 0.25)
    for t, grads in enumerate(grad_stream(model, 10, seed=2)):
        feed(model, opt, [grads])
        held = full_elements(model) if t < warm else host_elements(model, 0.25)
        assert opt.host_state_bytes == expect(held, arena), t
    opt.close()


def test_a_reselection_keeps_the_arena_and_its_places(feed, zenflow_opt):
    model = Interleaved(WIDTHS, seed=0)
    opt = zenflow_opt(model, host_layout="compact", topk_ratio=0.25, update_interval=2, select_interval=2)
    grads = grad_stream(model, 6, seed=3)
    feed(model, opt, [grads[0]])
    buffer = opt.arena.buffer
    places = [part.param_staging.data_ptr() for part in parts(opt, model)]
    before = [part.cols.clone() for part in parts(opt, model)]
    for g in grads[1:]:
        feed(model, opt, [g])
    assert any(not torch.equal(a, part.cols) for a, part in zip(before, parts(opt, model))), "nothing moved"
    assert opt.arena.buffer is buffer  # same widths: no new allocation
    assert [part.param_staging.data_ptr() for part in parts(opt, model)] == places
    opt.close()


@pytest.mark.slow
def test_first_selection_peak_is_not_full_width_plus_a_copy():
    """Peak resident memory across the first step, in a fresh process, for one 2048 x 2048 fp32 weight at topk 0.1
    (sync, CPU device): with warm-up 0 it is about the steady host state (plus the device part, here also host memory);
    the negative control, one warm-up step first, builds full width and then the selected layout beside it."""
    steady = host_bytes(host_elements(torch.nn.Linear(2048, 2048, bias=False), 0.1), 4, overlap_step=False,
                        cuda=False)
    peaks = {warm: _peak_rss_delta(warm) for warm in (0, 1)}
    assert peaks[0] < 1.3 * steady, (peaks, steady)
    assert peaks[1] > 1.6 * steady, (peaks, steady)  # full width (1.11x) + the new layout (1x)


def _peak_rss_delta(warm: int) -> int:
    code = textwrap.dedent(f"""
        import torch
        from zenflow import ZenFlowAdamW
        torch.manual_seed(0)
        w = torch.nn.Linear(2048, 2048, bias=False)
        w.weight.grad = torch.randn_like(w.weight)
        warm = torch.nn.Linear(8, 8)  # imports and first-use allocations of a whole step, before measuring
        warm.weight.grad, warm.bias.grad = torch.ones(8, 8), torch.ones(8)
        ZenFlowAdamW(warm.parameters(), zenflow={{"topk_ratio": 0.5, "full_warm_up_rounds": 1}}).step()
        def status(key):
            with open("/proc/self/status") as f:
                return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets the peak (VmHWM) to now: an earlier transient peak cannot hide this one
        before = status("VmRSS")
        opt = ZenFlowAdamW(w.parameters(), zenflow={{"topk_ratio": 0.1, "update_interval": 4,
                                                     "full_warm_up_rounds": {warm}}}, host_layout="compact")
        for _ in range({warm} + 1):
            opt.step()
        print(status("VmHWM") - before)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return int(done.stdout.split()[-1])


# ---- one staging arena ------------------------------------------------------------------------------------------
def assert_one_arena(opt: ZenFlowAdamW, model: torch.nn.Module) -> None:
    views = [v for part in parts(opt, model) if part.built for v in (*part.grad_staging, part.param_staging)]
    base = opt.arena.buffer
    assert all(v.untyped_storage().data_ptr() == base.untyped_storage().data_ptr() for v in views)
    spans = sorted((v.data_ptr() - base.data_ptr(), v.numel() * v.element_size()) for v in views)
    assert all(start % ALIGN == 0 for start, _ in spans)
    assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:])), "staging views overlap"
    used = sum(n for _, n in spans)
    assert 0 <= opt.host_staging_bytes - used < ALIGN * len(views)  # the exact sum, up to the alignment


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_staging_buffers_are_views_of_one_allocation_of_their_exact_sum(feed, zenflow_opt, overlap):
    model = Interleaved(WIDTHS, dtype=torch.bfloat16, seed=0)
    opt = zenflow_opt(model, host_layout="compact", topk_ratio=0.25, update_interval=2, select_interval=4,
                      overlap_step=overlap)
    for g in grad_stream(model, 6, seed=4):
        feed(model, opt, [g])
        assert_one_arena(opt, model)
    assert opt.host_staging_bytes == sum(2 * ALIGN * math.ceil(2 * e / ALIGN) for e in host_elements(model, 0.25))
    opt.close()


def test_late_parameters_grow_the_arena_to_the_exact_new_sum(feed):
    """A group added after the first step: its parts are built at its first offload; the arena is re-allocated
    (it must grow) at exactly the new layout's size, and still holds every view."""
    model = Interleaved(WIDTHS, seed=0)
    params = list(model.parameters())
    opt = ZenFlowAdamW(params[:4], lr=1e-2, zenflow={"topk_ratio": 0.25, "update_interval": 2,
                                                     "overlap_step": True}, host_layout="compact")
    grads = grad_stream(model, 5, seed=5)
    feed(model, opt, [grads[0]])
    first = opt.host_staging_bytes
    opt.add_param_group({"params": params[4:]})
    late = [p for p in params[4:] if p.dim() >= 2]
    assert opt.host_state_bytes == host_bytes(host_elements(model, 0.25)[:1], 4, overlap_step=True, cuda=False)
    assert all(not opt.state[p].host.built for p in late)  # pending until their first offload
    for g in grads[1:]:
        feed(model, opt, [g])
    assert opt.host_staging_bytes > first
    assert opt.host_state_bytes == host_bytes(host_elements(model, 0.25), 4, overlap_step=True, cuda=False)
    assert_one_arena(opt, model)
    opt.close()


def test_host_bytes_on_cuda_counts_two_gradient_staging_buffers_with_overlap():
    """The CUDA terms, by hand: one bf16 weight of 1000 x 900 host-owned elements (1,800,000 bytes, a multiple
    of 64): sync 4x(3+1) + 2 staging views; overlap 4x(3+2) + 3 staging views."""
    assert host_bytes([900_000], 2, overlap_step=False, cuda=True) == 16 * 900_000 + 2 * 1_800_000
    assert host_bytes([900_000], 2, overlap_step=True, cuda=True) == 20 * 900_000 + 3 * 1_800_000
    assert host_bytes([900_000], 2, overlap_step=True, cuda=False) == 20 * 900_000 + 2 * 1_800_000
    assert host_bytes([1], 2, overlap_step=False, cuda=True) == 16 + 2 * ALIGN


# ---- checkpoints of parts not built yet -------------------------------------------------------------------------
def roundtrip(sd: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(sd, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("stop_at", [0, 1, 5])
def test_resume_before_and_after_the_first_step_is_bit_exact_and_stays_small(feed, zenflow_opt, stop_at):
    config = dict(host_layout="compact", topk_ratio=0.25, update_interval=3, select_interval=4, overlap_step=True)
    grads = grad_stream(Interleaved(WIDTHS, seed=0), 9, seed=6)
    model = Interleaved(WIDTHS, seed=0)
    start = clone_model(model)
    with zenflow_opt(model, **config) as opt:
        for g in grads:
            feed(model, opt, [g])

    resumed = clone_model(start)
    opt = zenflow_opt(resumed, **config)
    for g in grads[:stop_at]:
        feed(resumed, opt, [g])
    saved = roundtrip({"model": resumed.state_dict(), "opt": opt.state_dict()})
    opt.close(flush=False)
    if stop_at == 0:
        assert all(e["host_master"] is None for e in saved["opt"]["state"].values() if "host_master" in e)
    resumed = clone_model(start)
    resumed.load_state_dict(saved["model"])
    opt = zenflow_opt(resumed, **config)
    opt.load_state_dict(saved["opt"])
    assert opt.host_state_bytes == (0 if stop_at == 0 else host_bytes(host_elements(resumed, 0.25), 4,
                                                                       overlap_step=True, cuda=False))
    with opt:
        for g in grads[stop_at:]:
            feed(resumed, opt, [g])
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_parts_not_built_yet_shard_and_consolidate(zenflow_opt):
    model = Interleaved(WIDTHS, seed=0)
    sd = zenflow_opt(model, host_layout="compact", topk_ratio=0.25).state_dict()
    blocks = [shard(sd, rank, 2) for rank in range(2)]
    back = consolidate(blocks)
    for key, entry in sd["state"].items():
        if "host_master" in entry:
            assert [b["state"][key]["host_master"] for b in blocks] == [None, None]
            assert torch.equal(back["state"][key]["host_cols"], entry["host_cols"])
            assert back["state"][key]["host_master"] is None


# ---- topk_ratio 0: a selection is a no-op ---------------------------------------------------------------------------
class Blocks:
    def __init__(self) -> None:
        self.seen: list[str] = []

    def on_transfer(self, direction: str, kind: str, nbytes: int) -> None: ...
    def on_block_start(self, what: str) -> None: self.seen.append(what)
    def on_block_end(self, what: str) -> None: ...


@pytest.mark.parametrize(("topk", "reselects"), [(0.0, 0), (0.25, 6)], ids=["topk-0", "control-topk-0.25"])
def test_topk_zero_never_reselects(feed, zenflow_opt, topk, reselects):
    """ZeRO-Offload as a ZenFlow block (select_interval 1): no "reselect" section, no index transfer; and still
    torch's fused AdamW bit for bit. Control: the same block with topk 0.25 reselects every step."""
    model = Interleaved(WIDTHS, seed=0)
    ref = clone_model(model)
    opt = zenflow_opt(model, host_layout="compact", topk_ratio=topk, update_interval=1, select_interval=1)
    blocks = Blocks()
    opt.add_observer(blocks)
    adamw = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    for g in grad_stream(model, 6, seed=7):
        feed(model, opt, [g])
        feed(ref, adamw, [g])
    assert blocks.seen.count("reselect") == reselects
    assert (("d2h", "indices") in opt.transfer_bytes) == (reselects > 0)
    if topk == 0:
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
