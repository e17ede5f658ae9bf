"""One rank of the FSDP2 tests (tests/core/test_fsdp.py), started by torchrun: the model sharded by `fully_shard`
(per layer and at the root), ZenFlowAdamW on its DTensor parameters, each rank on its 1/W of every global batch.
Saves the full parameters (`params-rank{r}.pt`), each column param's selected columns (`selected-rank{r}.pt`) and the
optimizer's counters (`bytes-rank{r}.pt`).

The model's row counts are uneven on purpose: 33, 25 and 1 rows over 2 ranks (17/16, 13/12, and 1/0: rank 1 holds
no row of the last layer at all).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/support/fsdp_rank.py --config JSON --out DIR
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import dp_rank
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from zenflow import ZenFlowAdamW
from zenflow.fsdp import Sharded
from zenflow.sharded_checkpoint import ShardedState


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 33), torch.nn.GELU(), torch.nn.Linear(33, 25), torch.nn.GELU(),
                               torch.nn.Linear(25, 1))


def global_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return dp_rank.global_batches(steps, outputs=1)  # the data-parallel tests' batches, for a one-output model


def shard_model(model: torch.nn.Module, mixed_precision: bool) -> torch.nn.Module:
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision \
        else MixedPrecisionPolicy()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mp_policy=policy)
    return fully_shard(model, mp_policy=policy)


def selected(opt: ZenFlowAdamW, model: torch.nn.Module) -> list[list[int]]:
    return [opt.state[p].sel.tolist() for p in model.parameters() if p.dim() >= 2]


def skip_the_norm_all_reduce() -> None:
    """The negative control: every rank ranks columns by its own rows only (no all-reduce of the partial norms)."""
    def local_scores(self: Sharded, grad: torch.Tensor, norm: str) -> torch.Tensor:
        return grad.float().square().sum(dim=0).sqrt() if norm == "l2" else grad.float().abs().sum(dim=0)
    Sharded.column_scores = local_scores


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True, help="ZenFlowAdamW keyword arguments, JSON")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--mixed-precision", action="store_true", help="MixedPrecisionPolicy(param_dtype=bf16)")
    ap.add_argument("--torch-adamw", action="store_true", help="torch.optim.AdamW instead (the reference)")
    ap.add_argument("--skip-norm-all-reduce", action="store_true", help="the negative control")
    ap.add_argument("--dcp-save-at", type=int, default=None, help="save model and optimizer with DCP after N steps")
    ap.add_argument("--dcp-resume", type=Path, default=None, help="load a DCP checkpoint saved by --dcp-save-at first")
    args = ap.parse_args()
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=dp_rank.COLLECTIVE_TIMEOUT_S))
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.skip_norm_all_reduce:
        skip_the_norm_all_reduce()
    model = shard_model(build_model(), args.mixed_precision)
    config = json.loads(args.config)
    opt = torch.optim.AdamW(model.parameters(), lr=config["lr"], weight_decay=0.0) if args.torch_adamw \
        else ZenFlowAdamW(model.parameters(), **config)
    batches, start = global_batches(args.steps), 0
    if args.dcp_resume is not None:
        state = {"model": get_model_state_dict(model), "optimizer": ShardedState(opt), "step": 0}
        dcp.load(state, checkpoint_id=args.dcp_resume)
        set_model_state_dict(model, state["model"])
        start = state["step"]
    for step in range(start, args.steps):
        dp_rank.train(model, opt, batches[step:step + 1], rank, world)  # this rank's share of the global batch
        if args.dcp_save_at is not None and step + 1 == args.dcp_save_at:
            state = {"model": get_model_state_dict(model), "optimizer": ShardedState(opt), "step": step + 1}
            dcp.save(state, checkpoint_id=args.out / "dcp")
    if not args.torch_adamw:
        opt.close()
        torch.save(selected(opt, model), args.out / f"selected-rank{rank}.pt")
        torch.save({**opt.transfer_bytes, "host_state_bytes": opt.host_state_bytes,
                    "host_staging_bytes": opt.host_staging_bytes}, args.out / f"bytes-rank{rank}.pt")
    full = {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}  # a collective: every rank
    torch.save(full, args.out / f"params-rank{rank}.pt")
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
