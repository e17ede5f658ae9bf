"""Device accumulation (`ZenFlowAdamW(accumulate_on="device")`, zenflow/device_accumulation.py) is host accumulation
moved across the link: the same parameters, fewer bytes.

The oracle is today's host accumulation on the same seed, model and batches. Device accumulation adds the same
gradient columns, clipped in fp32 by the same coefficient, in the same order (a scaled copy, then fused fp32
multiply-adds), so the host update sees the same mean gradient bit for bit: every comparison in one process is exact
(torch.equal), in sync and overlap mode, with reselection, clipping, warm-up, the "auto" interval, bf16, and across a
checkpoint taken inside an interval. Two ranks (gloo) are compared with two ranks of host accumulation, exactly too;
against one process on the global batch within 1e-6, the tolerance tests/core/test_distributed.py states (the ranks'
average is one addition in another order). Bytes: the optimizer's own counters over whole intervals equal
(4 + b)·P/U per step (P the host-owned column elements, b the model dtype's bytes) against host accumulation's
b·P·(1 + 1/U). The CUDA ordering (each ship waited for before its host update and before the accumulator's next
write) is checked on its CPU twin with faked copy events. Every oracle has a negative control that makes it fail:
an accumulator perturbed by 1e-3 in one element, one interval's sums not shipped, a checkpoint without its partial
sum, one rank's sums perturbed, the accumulator shipped every step, host memory against host accumulation's
formula, a wait left out.

The two-rank oracles are in tests/core/test_device_accumulation_ranks.py.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from helpers import Interleaved, column_params, grad_stream, set_grads, train_steps

import zenflow.device_accumulation as accumulation_module
import zenflow.optimizer as optimizer_module
from zenflow import ZenFlowAdamW
from zenflow.config import ConfigError, load_deepspeed_config
from zenflow.host import GradCopy, host_bytes
from zenflow.link import Link
from zenflow.selection import num_selected
from zenflow.state import ColumnState

WIDTHS = [10, 16, 12, 3]
STEPS = 20
CLIP = 0.05  # below every step's gradient norm here: clipping is active on every step (checked)
CONFIGS = {  # zenflow blocks; every one clips, every one with topk_ratio > 0 reselects (select_interval)
    "sync": dict(topk_ratio=0.25, update_interval=3, select_interval=6),
    "overlap-warmup": dict(topk_ratio=0.25, update_interval=3, select_interval=6, full_warm_up_rounds=2,
                           overlap_step=True),
    "sync-bf16": dict(topk_ratio=0.25, update_interval=3, select_interval=6),
    "overlap-warmup-bf16": dict(topk_ratio=0.25, update_interval=3, select_interval=6, full_warm_up_rounds=3,
                                overlap_step=True),  # warm-up: every column, p.grad itself only read
    "auto-overlap": dict(topk_ratio=0.25, update_interval="auto", select_interval=8, overlap_step=True),
    "auto-sync": dict(topk_ratio=0.25, update_interval="auto", select_interval=8),
    "zero-offload-u2": dict(topk_ratio=0.0, update_interval=2),
}


def make(model: torch.nn.Module, accumulate_on: str, block: dict, clip: float = CLIP,
         host_layout: str = "auto") -> ZenFlowAdamW:
    return ZenFlowAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, zenflow=copy.deepcopy(block),
                        gradient_clipping=clip, accumulate_on=accumulate_on, host_layout=host_layout)


def params_of(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def columns_of(opt: ZenFlowAdamW) -> list[ColumnState]:
    return [st for st in opt.state.values() if isinstance(st, ColumnState)]


def perturb(opt: ZenFlowAdamW) -> None:
    """Negative control: one element of one device accumulator with gradients in it, off by 1e-3."""
    st = next(st for st in columns_of(opt) if st.d_acc_count and st.d_acc.numel())
    st.d_acc.view(-1)[0] += 1e-3


def run(accumulate_on: str, name: str, steps: int = STEPS, perturb_at: int | None = None) -> dict:
    """One run: the parameters after every step and after the final drain, the steps after which a host update
    fired, the clipping coefficients, and the moment bytes that left the device at reselections."""
    dtype = torch.bfloat16 if "bf16" in name else torch.float32
    model = Interleaved(WIDTHS, dtype=dtype, seed=7)
    opt = make(model, accumulate_on, CONFIGS[name])
    after, fired, coefficients = [], [], []
    with opt:
        for i in range(steps):
            before = opt.host_updates
            train_steps(model, opt, 1, seed=3, start=i)
            if i == perturb_at:
                perturb(opt)
            after.append(params_of(model))
            fired += [i] if opt.host_updates > before else []
            coefficients.append(float(opt.clip.device))
    after.append(params_of(model))
    moved = opt.transfer_bytes.get(("d2h", "moments"), 0)
    return {"after": after, "fired": fired, "clip": coefficients, "moved": moved}


def identical(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> bool:
    return all(torch.equal(x, y) for step_a, step_b in zip(a, b) for x, y in zip(step_a, step_b))


# ---- one process: the same parameters as host accumulation, after every step --------------------------------
@pytest.mark.parametrize("name", list(CONFIGS))
def test_device_accumulation_gives_host_accumulations_parameters_after_every_step(name):
    host, device = run("host", name), run("device", name)
    assert identical(device["after"], host["after"])  # exact: the same additions in the same order
    assert device["fired"] == host["fired"] and len(host["fired"]) >= 4  # the same boundaries ("auto" too)
    assert max(host["clip"]) < 1.0  # clipping scaled every step
    if CONFIGS[name]["topk_ratio"] > 0:
        assert host["moved"] > 0  # reselection moved columns off the device (and their state)
    assert not identical(host["after"][:1], host["after"][-1:])  # it trained


@pytest.mark.parametrize("name", ["sync", "overlap-warmup", "auto-overlap"])
def test_negative_control_a_perturbed_accumulator_changes_the_parameters(name):
    host, device = run("host", name), run("device", name, perturb_at=9)  # inside an interval
    assert identical(device["after"][:9], host["after"][:9])
    assert not identical(device["after"], host["after"])


@pytest.mark.parametrize("name", ["sync", "auto-overlap"])  # no warm-up: a kept sum must fit the next interval's
def test_negative_control_skipping_every_other_ship_changes_the_parameters(name, monkeypatch):
    ship = accumulation_module.ship_
    calls = []

    def every_other(states, link, slot):  # the sums of odd intervals stay on the device (added to the next one)
        calls.append(slot)
        return ship(states, link, slot) if len(calls) % 2 else []

    monkeypatch.setattr(accumulation_module, "ship_", every_other)
    host, device = run("host", name), run("device", name)
    assert len(calls) >= 4
    assert not identical(device["after"], host["after"])


# ---- checkpoints inside an interval -------------------------------------------------------------------------
def saved_at(accumulate_on: str, name: str, stop_at: int) -> tuple[dict, int]:
    model = Interleaved(WIDTHS, seed=7)
    opt = make(model, accumulate_on, CONFIGS[name])
    train_steps(model, opt, stop_at, seed=5)
    since = opt.clock.since_boundary
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)  # a real round trip
    opt.close(flush=False)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False), since


def resumed(accumulate_on: str, name: str, saved: dict, stop_at: int, total: int) -> list[torch.Tensor]:
    model = Interleaved(WIDTHS, seed=7)
    opt = make(model, accumulate_on, CONFIGS[name])
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    with opt:
        train_steps(model, opt, total - stop_at, seed=5, start=stop_at)
    return params_of(model)


def uninterrupted(accumulate_on: str, name: str, total: int) -> list[torch.Tensor]:
    model = Interleaved(WIDTHS, seed=7)
    with make(model, accumulate_on, CONFIGS[name]) as opt:
        train_steps(model, opt, total, seed=5)
    return params_of(model)


@pytest.mark.parametrize("name", ["sync", "overlap-warmup"])
@pytest.mark.parametrize("stop_at", [7, 10])
@pytest.mark.parametrize("saved_by,loaded_by", [("device", "device"), ("host", "device"), ("device", "host")])
def test_resume_inside_an_interval_is_bit_exact_whichever_side_sums(name, stop_at, saved_by, loaded_by):
    total = 18
    saved, since = saved_at(saved_by, name, stop_at)
    assert since > 0  # saved inside an interval: a partial sum is in the checkpoint
    assert sum(sum(e["host_counts"]) for e in saved["opt"]["state"].values() if "host_counts" in e) > 0
    straight = uninterrupted(loaded_by, name, total)  # = the saving side's (the first test), checked here once more
    assert identical([resumed(loaded_by, name, saved, stop_at, total)], [straight])
    if saved_by != loaded_by:
        assert identical([straight], [uninterrupted(saved_by, name, total)])


@pytest.mark.parametrize("name", ["sync", "overlap-warmup"])
def test_negative_control_a_checkpoint_without_its_partial_sum_resumes_differently(name):
    total, stop_at = 18, 7
    saved, _ = saved_at("device", name, stop_at)
    for entry in saved["opt"]["state"].values():
        if "host_counts" in entry:
            entry["host_counts"] = [0] * len(entry["host_counts"])  # the interval's sum lost
    assert not identical([resumed("device", name, saved, stop_at, total)], [uninterrupted("device", name, total)])


def test_a_checkpoint_with_two_sums_in_flight_is_refused_by_device_accumulation():
    saved, _ = saved_at("host", "overlap-warmup", 7)
    entry = next(e for e in saved["opt"]["state"].values() if "host_counts" in e)
    entry["host_counts"] = [1, 2]
    model = Interleaved(WIDTHS, seed=7)
    opt = make(model, "device", CONFIGS["overlap-warmup"])
    with pytest.raises(ConfigError, match=r"host_counts = \[1, 2\] is not allowed with accumulate_on='device'"):
        opt.load_state_dict(saved["opt"])
    opt.close(flush=False)


# ---- bytes: (4 + b)·P/U per step over whole intervals ------------------------------------------------------
def host_owned_elements(model: torch.nn.Module, topk: float) -> list[int]:
    return [p.shape[0] * (p.shape[1] - num_selected(p.shape[1], topk)) for p in column_params(model)]


def link_bytes_per_step(accumulate_on: str, dtype: torch.dtype, interval: int, overlap: bool) -> tuple[float, list]:
    """Gradient and parameter bytes per step over three whole intervals in steady state (after the first selection
    and the first boundary), and each of those steps' gradient bytes."""
    model = Interleaved([40, 30, 20, 10], dtype=dtype, seed=0)
    block = dict(topk_ratio=0.1, update_interval=interval, overlap_step=overlap, select_interval=10_000)
    opt = make(model, accumulate_on, block, clip=0.0)
    grads = iter(grad_stream(model, 4 * interval, seed=1))
    for _ in range(interval):  # step 0 selects; the first boundary ends this interval
        set_grads(model, next(grads))
        opt.step()
    start, per_step = opt.transfer_bytes, []
    for g in grads:
        before = opt.transfer_bytes.get(("d2h", "grads"), 0)
        set_grads(model, g)
        opt.step()
        per_step.append(opt.transfer_bytes[("d2h", "grads")] - before)
    end = opt.transfer_bytes
    opt.close()
    moved = sum(end[key] - start.get(key, 0) for key in (("d2h", "grads"), ("h2d", "params")))
    return moved / (3 * interval), per_step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interval", [1, 2, 4])
@pytest.mark.parametrize("overlap", [False, True])
def test_device_accumulation_moves_four_plus_b_over_u_per_step(dtype, interval, overlap):
    b = torch.finfo(dtype).bits // 8
    p_host = sum(host_owned_elements(Interleaved([40, 30, 20, 10], dtype=dtype, seed=0), 0.1))
    device, grads = link_bytes_per_step("device", dtype, interval, overlap)
    host, _ = link_bytes_per_step("host", dtype, interval, overlap)
    assert device == (4 + b) * p_host / interval  # exact: counted bytes, no rounding
    assert host == b * p_host * (1 + 1 / interval)  # docs/design.md §2, the same window
    assert grads == ([0] * (interval - 1) + [4 * p_host]) * 3  # once per interval, fp32, at the boundary
    # device accumulation moves fewer bytes exactly when U > 4/b (bf16: U > 2, fp32: U > 1)
    assert (device < host) == (interval > 4 / b) and (device == host) == (interval == 4 / b)


def test_at_topk_01_u4_bf16_device_accumulation_moves_0675_model_bytes_per_step_against_1125():
    """The traffic device accumulation promises: at r = 0.1 (exact here: every width is a multiple of 10), U = 4
    and bf16, (1 − r)·(4 + 2)/4 = 0.675 model-bytes per step against (1 − r)·(1 + 1/4) = 1.125."""
    model_bytes = 2 * sum(p.numel() for p in column_params(Interleaved([40, 30, 20, 10], seed=0)))
    device, _ = link_bytes_per_step("device", torch.bfloat16, 4, overlap=True)
    host, _ = link_bytes_per_step("host", torch.bfloat16, 4, overlap=True)
    assert device / model_bytes == pytest.approx(0.675, rel=1e-12)
    assert host / model_bytes == pytest.approx(1.125, rel=1e-12)


def test_negative_control_shipping_every_step_breaks_the_byte_formula(monkeypatch):
    monkeypatch.setattr(ZenFlowAdamW, "_boundary_due", lambda self: True)  # a boundary (and a ship) every step
    p_host = sum(host_owned_elements(Interleaved([40, 30, 20, 10], seed=0), 0.1))
    device, _ = link_bytes_per_step("device", torch.float32, 4, overlap=False)
    assert device != (4 + 4) * p_host / 4
    assert device == (4 + 4) * p_host  # what it measured instead: every step's sum and upload


# ---- memory: the device accumulator, and the host's landing accumulators ------------------------------------
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_device_memory_is_four_bytes_per_host_owned_element_and_host_memory_is_host_bytes(overlap, dtype):
    """The memory of a GPU's layout (compact host parts); whole rows hold every column: test_host_layout.py."""
    model = Interleaved([40, 30, 20, 10], dtype=dtype, seed=0)
    opt = make(model, "device", dict(topk_ratio=0.1, update_interval=2, overlap_step=overlap), clip=0.0,
               host_layout="compact")
    for g in grad_stream(model, 3, seed=1):
        set_grads(model, g)
        opt.step()
    elements = host_owned_elements(model, 0.1)
    b = torch.finfo(dtype).bits // 8
    assert opt.device_accumulator_bytes == 4 * sum(elements)
    expected = host_bytes(elements, b, overlap_step=overlap, cuda=False, accumulate_on="device")
    assert opt.host_state_bytes == expected
    # negative control: host accumulation's formula is not what device accumulation holds (no gradient staging,
    # the accumulators are arena views)
    assert opt.host_state_bytes != host_bytes(elements, b, overlap_step=overlap, cuda=False)
    opt.close()


# ---- the CUDA ordering, on its CPU twin ------------------------------------------------------------------------
class FakeCopy:
    """Stands for the CUDA event of a ship's d2h copy (the copy itself runs on the CPU at once)."""

    def __init__(self, log: list) -> None:
        self.log = log

    def synchronize(self) -> None:
        self.log.append(("landed", self, None))


@pytest.mark.parametrize("overlap", [False, True])
def test_every_ship_is_waited_for_by_its_host_update_and_by_the_next_write(overlap, monkeypatch):
    """The order device_accumulation.py promises on CUDA, with the copy events faked: each ship's copy is waited for
    (synchronize) before the host update that reads its landing buffer, and the compute stream waits for it
    (Link.compute_waits_for) before the accumulator's next write. Negative controls: without either wait the check
    fails."""
    log: list = []  # (what, event, landing buffers), from the training thread and the worker
    gather, update = Link.gather_to_host, optimizer_module.host_adamw_

    def shipping(self, src, columns, dst):
        gather(self, src, columns, dst)
        if columns is not None:
            return None
        event = FakeCopy(log)
        log.append(("ship", event, {dst.data_ptr()}))
        return event

    def host_update(groups, slot):
        read = {p.accumulators[slot].data_ptr() for parts, _ in groups for p in parts if p.counts[slot]}
        log.append(("host-update", None, read))
        update(groups, slot)

    monkeypatch.setattr(Link, "gather_to_host", shipping)
    monkeypatch.setattr(Link, "compute_waits_for", lambda self, event: log.append(("write-waits", event, None)))
    monkeypatch.setattr(optimizer_module, "host_adamw_", host_update)
    assert ordered(log, overlap)
    log.clear()
    monkeypatch.setattr(GradCopy, "land", lambda self, link: self.staging)  # negative control: nobody waits
    assert not ordered(log, overlap)
    log.clear()
    monkeypatch.undo()
    monkeypatch.setattr(Link, "gather_to_host", shipping)
    monkeypatch.setattr(optimizer_module, "host_adamw_", host_update)
    monkeypatch.setattr(Link, "compute_waits_for", lambda self, event: None)  # negative control: writes don't wait
    assert not ordered(log, overlap)


def ordered(log: list, overlap: bool) -> bool:
    model = Interleaved([40, 30, 20, 10], seed=0)
    opt = make(model, "device", dict(topk_ratio=0.1, update_interval=2, overlap_step=overlap), clip=0.0)
    for g in grad_stream(model, 8, seed=1):
        set_grads(model, g)
        opt.step()
    opt.close()
    ships = [(i, event, landing) for i, (what, event, landing) in enumerate(log) if what == "ship"]
    assert len(ships) == 3 * 4  # three column params, four boundaries
    for i, event, landing in ships:  # landed before the host update that reads that landing buffer
        reader = next(j for j, (what, _, read) in enumerate(log) if what == "host-update" and j > i and landing <= read)
        if ("landed", event, None) not in log or not i < log.index(("landed", event, None)) < reader:
            return False
    # every accumulator's next ship (a write came between) comes after a wait for its last one
    return all(("write-waits", event, None) in log[i:j] for (i, event, _), (j, _, _) in zip(ships, ships[3:]))


# ---- configuration -------------------------------------------------------------------------------------------
def ds_config(zenflow_block: dict) -> dict:
    return {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": zenflow_block}}


@pytest.mark.parametrize("key", ["accumulate_on", "accumulate_on_device"])
def test_a_device_accumulation_request_in_the_zenflow_block_is_refused_by_name(key):
    block = {"topk_ratio": 0.1, "update_interval": 4}
    load_deepspeed_config(ds_config(block))  # negative control: the same config without the key loads
    message = rf"zenflow\.{key} = 'device' is not allowed: .*accumulate_on=\.\.\.\) with one of \('host', 'device'\)"
    with pytest.raises(ConfigError, match=message):
        load_deepspeed_config(ds_config({**block, key: "device"}))
    with pytest.raises(ConfigError, match=message):
        ZenFlowAdamW.from_deepspeed_config(Interleaved(WIDTHS).parameters(), ds_config({**block, key: "device"}))
    with pytest.raises(ConfigError, match=message):
        ZenFlowAdamW(Interleaved(WIDTHS).parameters(), zenflow={**block, key: "device"})


def test_the_keyword_takes_host_or_device_and_names_both_when_refused():
    params = list(Interleaved(WIDTHS).parameters())
    for bad in ("gpu", "Device", None, True):
        with pytest.raises(ConfigError, match=r"accumulate_on = .* is not allowed: expected one of \('host', "
                                              r"'device'\)"):
            ZenFlowAdamW(params, accumulate_on=bad)
    assert ZenFlowAdamW(params).accumulate_on == "host"  # the default: today's behaviour
    opt = ZenFlowAdamW.from_deepspeed_config(params, ds_config({"update_interval": 4}), accumulate_on="device")
    assert opt.accumulate_on == "device"
    assert all(st.host.device_sums for st in columns_of(opt))
