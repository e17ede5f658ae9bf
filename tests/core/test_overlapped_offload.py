"""OverlappedOffloadAdamW (ref-offload-overlap): exact AdamW semantics with the host steps started during
backward. Oracles against torch.optim.AdamW (fp32), with and without clipping; bf16 with clipping against torch's
AdamW on the landed gradients clipped by the module docstring's fp32 rule; negative controls for each. The device
gradients are dropped as they land."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from zenflow import ZenFlowAdamW
from zenflow.overlapped_offload import OverlappedOffloadAdamW
from zenflow.worker import HostWorkerError

HYPER = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)


def model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 8)).to(dtype)


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 16, generator=gen), torch.randn(4, 8, generator=gen)) for _ in range(n)]


def train(net: nn.Module, opt: torch.optim.Optimizer, steps: int, clip: float = 0.0, torch_clip: bool = False) -> None:
    for x, y in batches(steps):
        loss = ((net(x.to(next(net.parameters()).dtype)) - y) ** 2).mean() * 50  # large grads: clipping bites
        loss.backward()
        if torch_clip:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)


def groups(net: nn.Module) -> list[dict]:
    """Two groups: different lr and weight decay, as a user's decay / no-decay split."""
    return [{"params": [net[0].weight, net[3].weight]},
            {"params": [net[0].bias, net[1].weight, net[1].bias, net[3].bias], "lr": 3e-3, "weight_decay": 0.0}]


@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_equals_torch_adamw_in_fp32(clip: float) -> None:
    ours_net, ref_net = model(), model()
    with OverlappedOffloadAdamW(groups(ours_net), **HYPER, gradient_clipping=clip) as ours:
        train(ours_net, ours, 6, clip)
    ref = torch.optim.AdamW(groups(ref_net), **HYPER, fused=True)
    train(ref_net, ref, 6, clip, torch_clip=clip > 0)
    for a, b in zip(ours_net.parameters(), ref_net.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_a_one_step_late_update_is_not_adamw() -> None:
    """Negative control of the oracle: ZeRO-Offload's delayed parameter update (ZenFlowAdamW topk 0, U 1, overlap)
    is the same host AdamW applied one step late, and the comparison above tells it apart."""
    late_net, ref_net = model(), model()
    late = ZenFlowAdamW(late_net.parameters(), **HYPER, zenflow={"topk_ratio": 0.0, "update_interval": 1,
                                                                  "overlap_step": True, "select_interval": 10**6})
    train(late_net, late, 6)
    late.close()
    ref = torch.optim.AdamW(ref_net.parameters(), **HYPER, fused=True)
    train(ref_net, ref, 6)
    assert not all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(late_net.parameters(),
                                                                            ref_net.parameters()))


def test_host_steps_start_during_backward_and_after_it_with_clipping() -> None:
    """Without clipping the host steps of the last layers start while backward is still computing the first layer
    (held 50 ms there by a hook); with clipping none starts before step() knows the global norm."""
    for clip, during in ((0.0, True), (0.5, False)):
        net = model()
        started: list[float] = []
        with OverlappedOffloadAdamW(net.parameters(), **HYPER, gradient_clipping=clip) as opt:
            opt.worker.before_job = lambda kind, started=started: started.append(time.perf_counter())
            for x, y in batches(3):
                started.clear()
                hidden = net[0](x)
                hidden.register_hook(lambda g: (time.sleep(0.05), g)[1])  # backward reaches layer 0 50 ms later
                first_layer: list[float] = []
                handle = net[0].weight.register_post_accumulate_grad_hook(
                    lambda p, first_layer=first_layer: first_layer.append(time.perf_counter()))
                ((net[3](net[2](net[1](hidden))) - y) ** 2).mean().backward()
                handle.remove()
                early = [t for t in started if t < first_layer[0]]
                assert bool(early) is during, (clip, started, first_layer)
                opt.step()
                assert len(started) == 6  # every parameter stepped once


@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_each_device_gradient_is_dropped_as_it_lands(clip: float) -> None:
    """Half of the engine's point: a layer's gradient memory is freed while backward goes on, not at step(). The
    values cannot show it (the update reads the landed host copy), so the gradients themselves are looked at."""
    net = model()
    with OverlappedOffloadAdamW(net.parameters(), **HYPER, gradient_clipping=clip) as opt:
        last_layer_grads: list[bool] = []  # net[3]'s gradients, seen when backward reaches net[0] (landed earlier)
        net[0].weight.register_post_accumulate_grad_hook(
            lambda p: last_layer_grads.extend(q.grad is not None for q in net[3].parameters()))
        (x, y), = batches(1)
        ((net(x) - y) ** 2).mean().backward()
        assert last_layer_grads == [False, False]  # dropped at once, inside backward
        assert [p.grad is None for p in net.parameters()] == [True] * 6  # none kept until step()
        opt.step()
        assert all(opt.host[p].step == 1 for p in net.parameters())  # ...and each was still stepped


def _replayed_bf16_reference(landed: list[list[torch.Tensor]], clip: float,
                             clipped_in_fp32: bool) -> list[torch.Tensor]:
    """The fp32 masters of `model(bf16)` after torch's AdamW on each step's landed bf16 gradients, clipped by torch's
    clip_grad_norm_ coefficient (computed in the gradients' dtype). `clipped_in_fp32`: the stated rule, the gradient
    upcast exactly and scaled in fp32 (one rounding: zenflow.host.accumulate_into_); else torch's in-place clipping,
    the product rounded to bf16. Replayed, not recomputed: a bf16 LayerNorm's weight gradient depends on the intra-op
    thread count, which the worker's start changes for the training thread."""
    masters = [p.detach().float() for p in model(torch.bfloat16).parameters()]
    ref = torch.optim.AdamW(masters, **HYPER, fused=True)
    for grads in landed:
        coef = torch.clamp(clip / (torch.nn.utils.get_total_norm(grads) + 1e-6), max=1.0)  # bf16, as torch's
        assert coef < 1  # clipping bites, or both rules would be a plain copy
        for m, g in zip(masters, grads):
            m.grad = g.float() * coef.float() if clipped_in_fp32 else (g * coef).float()
        ref.step()
    return masters


def test_bf16_with_clipping_clips_the_exact_upcast_gradient_in_fp32() -> None:
    """The module docstring's rule (ZenFlow's host path, host.accumulate_into_), bit for bit; the other candidate, the
    clipped gradient rounded in bf16 as torch's in-place clipping writes it, is told apart (fp32 cannot tell them:
    the rules agree there)."""
    net, landed = model(torch.bfloat16), []
    with OverlappedOffloadAdamW(net.parameters(), **HYPER, gradient_clipping=0.5) as opt:
        for x, y in batches(4):
            (((net(x.to(torch.bfloat16)) - y) ** 2).mean() * 50).backward()
            opt.step()
            landed.append([opt.host[p].grad.clone() for p in net.parameters()])  # the step only read it
        masters = [opt.host[p].master for p in net.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(masters, _replayed_bf16_reference(landed, 0.5, True)))
    assert all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(net.parameters(), masters))
    assert not all(torch.equal(a, b) for a, b in zip(masters, _replayed_bf16_reference(landed, 0.5, False)))


def test_bf16_parameters_keep_an_fp32_master_and_get_its_cast() -> None:
    net = model(torch.bfloat16)
    with OverlappedOffloadAdamW(net.parameters(), **HYPER) as opt:
        train(net, opt, 3)
        for p in net.parameters():
            assert p.dtype == torch.bfloat16 and opt.host[p].master.dtype == torch.float32
            assert torch.equal(p, opt.host[p].master.to(torch.bfloat16))
            assert opt.host[p].step == 3


def test_bytes_are_every_gradient_down_and_every_parameter_up_per_step() -> None:
    net = model(torch.bfloat16)
    numel = sum(p.numel() for p in net.parameters())
    with OverlappedOffloadAdamW(net.parameters(), **HYPER) as opt:
        train(net, opt, 2)
        assert opt.transfer_bytes == {("d2h", "grads"): 2 * 2 * numel, ("h2d", "params"): 2 * 2 * numel}


def test_two_backwards_before_a_step_are_refused() -> None:
    net = model()
    with OverlappedOffloadAdamW(net.parameters(), **HYPER):
        (x, y), = batches(1)
        ((net(x) - y) ** 2).mean().backward()
        with pytest.raises(RuntimeError, match="gradient accumulation"):
            ((net(x) - y) ** 2).mean().backward()


def test_a_failing_host_step_raises_at_step_never_hangs() -> None:
    net = model()
    with OverlappedOffloadAdamW(net.parameters(), **HYPER) as opt:
        def fail(kind: str) -> None:
            raise OSError("host out of memory")
        opt.worker.before_job = fail
        (x, y), = batches(1)
        ((net(x) - y) ** 2).mean().backward()
        done = threading.Event()
        with pytest.raises(HostWorkerError, match="out of memory"):
            try:
                opt.step()
            finally:
                done.set()
        assert done.is_set()
        opt.worker.before_job = None
        train(net, opt, 1)  # the next step is a clean one

def test_bad_clipping_is_named() -> None:
    with pytest.raises(ValueError, match="gradient_clipping = -1"):
        OverlappedOffloadAdamW(model().parameters(), gradient_clipping=-1)
