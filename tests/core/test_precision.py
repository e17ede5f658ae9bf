"""bf16 models: exact integer step counters and fp32 masters (DeepSpeed's bf16 counter saturates at 256)."""

from __future__ import annotations

import torch
from helpers import Interleaved, clone_model, set_grads

STEPS = 320


def bf16_grads(model, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=gen).to(torch.bfloat16) for p in model.parameters()]
            for _ in range(steps)]


def test_bf16_model_counts_steps_exactly_and_bias_correction_matches_fp32_adamw_past_256(zenflow_opt):
    fp32 = Interleaved([16, 12, 8], seed=1)
    bf16 = clone_model(fp32).to(torch.bfloat16)
    fp32.load_state_dict({k: v.float() for k, v in bf16.state_dict().items()})  # same starting values
    opt = zenflow_opt(bf16, topk_ratio=1.0, update_interval=1, full_warm_up_rounds=3, lr=1e-3)
    ref = torch.optim.AdamW(fp32.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    for g in bf16_grads(bf16, STEPS, seed=9):
        set_grads(bf16, g)
        set_grads(fp32, [x.float() for x in g])
        opt.step()
        ref.step()
    for p, q in zip(bf16.parameters(), fp32.parameters()):
        st = opt.state[p]
        if p.dim() >= 2:
            assert st.d_step == STEPS and isinstance(st.d_step, int)
            assert st.host.step == 3  # the warm-up steps went through the host
            master = st.d_master
        else:
            assert st.step == STEPS
            master = st.master
        assert master.dtype == torch.float32
        torch.testing.assert_close(master, q.detach(), rtol=1e-6, atol=1e-7)  # the fp32 trajectory, exactly
        torch.testing.assert_close(p.detach(), q.detach().to(torch.bfloat16), rtol=0, atol=0)


def test_bf16_host_part_counts_exactly_over_many_boundaries(zenflow_opt):
    fp32 = Interleaved([8, 6, 4], seed=2)
    bf16 = clone_model(fp32).to(torch.bfloat16)
    fp32.load_state_dict({k: v.float() for k, v in bf16.state_dict().items()})
    opt = zenflow_opt(bf16, topk_ratio=0.0, update_interval=1, lr=1e-3)
    ref = torch.optim.AdamW(fp32.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    for g in bf16_grads(bf16, STEPS, seed=3):
        set_grads(bf16, g)
        set_grads(fp32, [x.float() for x in g])
        opt.step()
        ref.step()
    for p, q in zip(bf16.parameters(), fp32.parameters()):
        if p.dim() >= 2:
            part = opt.state[p].host
            assert part.step == STEPS
            assert torch.equal(part.cols, torch.arange(p.shape[1]))  # nothing selected: the host owns all
            torch.testing.assert_close(part.master, q.detach(), rtol=1e-6, atol=1e-7)
