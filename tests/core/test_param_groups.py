"""ZenFlowAdamW where users train: param groups added or unfrozen after construction, per-group lr and
weight decay on both parts, LR schedulers (which lr the host part uses), zero_grad(set_to_none=False), a state dict
that torch.load(weights_only=True) reads, tied weights. Oracles: topk 1 and topk 0 / interval 1 / sync are AdamW."""

from __future__ import annotations

import io

import pytest
import torch
from helpers import Interleaved, clone_model, grad_stream, set_grads

from zenflow import ZenFlowAdamW

TOL = dict(rtol=1e-6, atol=1e-7)
ADAMW_EVERY_STEP = {"topk_ratio 1": {"topk_ratio": 1.0, "update_interval": 3, "overlap_step": True},
                    "zero-offload": {"topk_ratio": 0.0, "update_interval": 1, "overlap_step": False}}


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(y, x, **TOL)


def split_model() -> tuple[torch.nn.Module, list, list]:
    model = Interleaved([6, 8, 5, 4], seed=3)
    params = list(model.parameters())
    return model, params[:4], params[4:]  # first Linear + LayerNorm; the rest joins later


@pytest.mark.parametrize("block", ADAMW_EVERY_STEP.values(), ids=ADAMW_EVERY_STEP)
def test_a_group_added_after_some_steps_trains_like_adamw_from_then_on(block: dict) -> None:
    """Progressive unfreezing with add_param_group: before, its parameters are not touched; after, they follow
    AdamW step for step (their own group's lr and weight decay), like torch's."""
    model, first, later = split_model()
    ref_model = clone_model(model)
    ref_params = list(ref_model.parameters())
    initial_later = [p.detach().clone() for p in later]
    ours = ZenFlowAdamW(first, lr=1e-2, weight_decay=0.1, zenflow={**block, "select_interval": 1000})
    ref = torch.optim.AdamW(ref_params[:4], lr=1e-2, weight_decay=0.1)
    grads = grad_stream(model, 8, seed=5)
    for i, g in enumerate(grads):
        if i == 3:
            ours.add_param_group({"params": later, "lr": 3e-2, "weight_decay": 0.0})
            ref.add_param_group({"params": ref_params[4:], "lr": 3e-2, "weight_decay": 0.0})
        set_grads(model, g)
        set_grads(ref_model, g)
        ours.step()
        ref.step()
    ours.close()
    assert_same(list(ref_model.parameters()), list(model.parameters()))
    assert all(not torch.equal(a, b) for a, b in zip(initial_later, later))  # the late group did train


def test_a_group_added_mid_run_in_a_mixed_config_is_updated_and_checkpointed(feed) -> None:
    model, first, later = split_model()
    before = [p.detach().clone() for p in later]
    opt = ZenFlowAdamW(first, lr=1e-2, zenflow={"topk_ratio": 0.5, "update_interval": 2, "overlap_step": True,
                                                "select_interval": 4})
    grads = grad_stream(model, 10, seed=7)
    for i, g in enumerate(grads[:5]):
        if i == 2:
            opt.add_param_group({"params": later})
        feed(model, opt, [g], zero_grad=False)
    assert all(not torch.equal(a, b) for a, b in zip(before, later))
    assert all(opt.state[p] for p in later)
    saved = opt.state_dict()
    # a fresh optimizer with the same groups resumes bit-exactly
    model_b = clone_model(model)
    params_b = list(model_b.parameters())
    opt_b = ZenFlowAdamW(params_b[:4], lr=1e-2, zenflow=opt.config)
    opt_b.add_param_group({"params": params_b[4:]})
    opt_b.load_state_dict(saved)
    for g in grads[5:]:
        feed(model, opt, [g], zero_grad=False)
        feed(model_b, opt_b, [g], zero_grad=False)
    opt.close()
    opt_b.close()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model_b.parameters()))


@pytest.mark.parametrize("block", ADAMW_EVERY_STEP.values(), ids=ADAMW_EVERY_STEP)
def test_parameters_unfrozen_after_construction_train_like_adamw(block: dict) -> None:
    """requires_grad_(True) after the optimizer was built: they get state at the next step (not silently
    skipped), as torch.optim.AdamW updates any parameter of its groups that has a gradient."""
    model = Interleaved([6, 8, 5, 4], seed=4)
    frozen = list(model.parameters())[4:]
    for p in frozen:
        p.requires_grad_(False)
    ref_model = clone_model(model)
    ours = ZenFlowAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, zenflow={**block, "select_interval": 1000})
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1)
    grads = grad_stream(model, 7, seed=6)
    for i, g in enumerate(grads):
        if i == 2:
            for p in [*frozen, *list(ref_model.parameters())[4:]]:
                p.requires_grad_(True)
        for m in (model, ref_model):
            for p, q in zip(m.parameters(), g):
                p.grad = q.clone() if p.requires_grad else None
        ours.step()
        ref.step()
    ours.close()
    assert_same(list(ref_model.parameters()), list(model.parameters()))


@pytest.mark.parametrize("block", ADAMW_EVERY_STEP.values(), ids=ADAMW_EVERY_STEP)
def test_per_group_lr_and_weight_decay_on_both_parts(feed, block: dict) -> None:
    model = Interleaved([6, 8, 5, 4], seed=8)
    ref_model = clone_model(model)
    groups = lambda ps: [{"params": ps[:4], "lr": 2e-2, "weight_decay": 0.3},  # noqa: E731
                         {"params": ps[4:], "lr": 5e-3, "weight_decay": 0.0}]
    ours = ZenFlowAdamW(groups(list(model.parameters())), zenflow={**block, "select_interval": 1000})
    ref = torch.optim.AdamW(groups(list(ref_model.parameters())))
    for g in grad_stream(model, 6, seed=9):
        feed(model, ours, [g], zero_grad=False)
        feed(ref_model, ref, [g], zero_grad=False)
    ours.close()
    assert_same(list(ref_model.parameters()), list(model.parameters()))


def test_the_host_part_uses_the_lr_of_the_boundary_step(feed) -> None:
    """topk 0, interval 3, sync: AdamW every 3 steps on the mean gradient, with the lr the scheduler set for the step
    that completes the interval (not the mean over the interval, not the first step's). No dense params (they are
    updated every step on the device)."""
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7, bias=False), torch.nn.Tanh(), torch.nn.Linear(7, 3, bias=False))
    ref_model = clone_model(model)
    ours = ZenFlowAdamW(model.parameters(), lr=1e-2, weight_decay=0.1,
                        zenflow={"topk_ratio": 0.0, "update_interval": 3, "overlap_step": False})
    lr_at = lambda step: 1e-2 * (step + 1)  # noqa: E731  (lr of step `step`: a different value each step)
    sched = torch.optim.lr_scheduler.LambdaLR(ours, lambda step: step + 1.0)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1)
    grads = grad_stream(model, 9, seed=3)
    for i, g in enumerate(grads):
        assert ours.param_groups[0]["lr"] == pytest.approx(lr_at(i))
        feed(model, ours, [g], zero_grad=False)
        sched.step()
        if i % 3 == 2:  # the boundary step
            for group in ref.param_groups:
                group["lr"] = lr_at(i)
            set_grads(ref_model, [sum(x[j] for x in grads[i - 2:i + 1]) / 3 for j in range(len(g))])
            ref.step()
    ours.close()
    assert_same(list(ref_model.parameters()), list(model.parameters()))


def test_zero_grad_without_set_to_none_gives_the_same_run() -> None:
    results = []
    for set_to_none in (True, False):
        model = Interleaved([6, 8, 4], seed=1)
        opt = ZenFlowAdamW(model.parameters(), lr=1e-2, zenflow={"topk_ratio": 0.5, "update_interval": 2,
                                                                 "overlap_step": True, "select_interval": 3})
        x = torch.randn(16, 6, generator=torch.Generator().manual_seed(0))
        for _ in range(7):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
        opt.close()
        results.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_a_saved_state_dict_loads_with_weights_only(feed) -> None:
    model = Interleaved([6, 8, 4], seed=1)
    opt = ZenFlowAdamW(model.parameters(), lr=1e-2, zenflow={"topk_ratio": 0.5, "update_interval": "auto",
                                                             "overlap_step": True, "select_interval": 3})
    feed(model, opt, grad_stream(model, 5, seed=1), zero_grad=False)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)  # plain tensors, numbers, strings, lists, dicts only
    model_b = clone_model(model)
    opt_b = ZenFlowAdamW(model_b.parameters(), lr=1e-2, zenflow=opt.config)
    opt_b.load_state_dict(loaded)
    assert (opt_b.t, opt_b.host_updates) == (opt.t, opt.host_updates)
    for g in grad_stream(model, 4, seed=2):  # the loaded copy continues exactly as the original
        feed(model, opt, [g], zero_grad=False)
        feed(model_b, opt_b, [g], zero_grad=False)
    opt.close()
    opt_b.close()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model_b.parameters()))


def test_tied_weights_are_one_parameter_and_train_like_adamw() -> None:
    """An embedding tied to the output head (one Parameter in two places): updated once per step."""
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.embed = torch.nn.Embedding(11, 6)
            self.head = torch.nn.Linear(6, 11, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(self.embed(ids)))

    ours_model, ref_model = Tied(), Tied()
    assert len(list(ours_model.parameters())) == 1
    ours = ZenFlowAdamW(ours_model.parameters(), lr=1e-2, weight_decay=0.1, zenflow=ADAMW_EVERY_STEP["zero-offload"])
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1)
    ids = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(0))
    for _ in range(5):
        for m, opt in ((ours_model, ours), (ref_model, ref)):
            torch.nn.functional.cross_entropy(m(ids).flatten(0, 1), ids.flatten()).backward()
            opt.step()
            opt.zero_grad()
    ours.close()
    assert_same(list(ref_model.parameters()), list(ours_model.parameters()))


def test_state_dict_and_step_hooks_run_as_for_torch_optimizers(feed) -> None:
    model = Interleaved([6, 8, 4], seed=1)
    opt = ZenFlowAdamW(model.parameters(), lr=1e-2, zenflow={"topk_ratio": 0.5, "update_interval": 2})
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("step-pre"))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append("step-post"))
    opt.register_state_dict_pre_hook(lambda o: calls.append("save-pre"))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "mine": 1})
    opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append(("load-pre", sd.get("mine"))))
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load-post"))
    feed(model, opt, grad_stream(model, 1, seed=0), zero_grad=False)
    sd = opt.state_dict()
    assert sd["mine"] == 1
    opt.load_state_dict(sd)
    assert calls == ["step-pre", "step-post", "save-pre", ("load-pre", 1), "load-post"]
    opt.close()


@pytest.mark.parametrize("block", ADAMW_EVERY_STEP.values(), ids=ADAMW_EVERY_STEP)
def test_parameters_without_a_gradient_in_some_steps_are_left_alone_as_adamw_does(block: dict) -> None:
    model = Interleaved([6, 8, 5, 4], seed=5)
    ref_model = clone_model(model)
    ours = ZenFlowAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, zenflow={**block, "select_interval": 1000})
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1)
    for i, g in enumerate(grad_stream(model, 8, seed=2)):
        for m in (model, ref_model):
            for j, (p, q) in enumerate(zip(m.parameters(), g)):
                # each parameter skips every third step, but not the selection step (step 0): a parameter without
                # a gradient there keeps its owners until the next selection (docs/step-semantics.md)
                p.grad = None if i > 0 and (j + i) % 3 == 0 else q.clone()
        ours.step()
        ref.step()
    ours.close()
    assert_same(list(ref_model.parameters()), list(model.parameters()))


def test_a_compiled_model_trains_as_the_eager_one() -> None:
    """torch.compile (dynamo; the aot_eager backend keeps it fast and compiler-free) changes nothing for the optimizer:
    the parameters are the module's own."""
    runs = []
    for compiled in (False, True):
        model = Interleaved([6, 8, 4], seed=1)
        opt = ZenFlowAdamW(model.parameters(), lr=1e-2, zenflow={"topk_ratio": 0.5, "update_interval": 2,
                                                                 "overlap_step": True, "select_interval": 3})
        forward = torch.compile(model, backend="aot_eager") if compiled else model
        x = torch.randn(16, 6, generator=torch.Generator().manual_seed(0))
        for _ in range(6):
            forward(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        opt.close()
        runs.append([p.detach().clone() for p in model.parameters()])
    assert_same(*runs)
