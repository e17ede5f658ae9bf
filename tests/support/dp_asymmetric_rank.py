"""One rank of the asymmetric data-parallel tests (tests/core/test_distributed_blocks.py and
tests/core/test_distributed_broadcast.py), started by torchrun like tests/support/dp_rank.py. Two scenarios, each a case
the symmetric fixtures of dp_rank.py cannot show:

- `broadcast`: rank 1 perturbs its weights before building ZenFlowAdamW, and the parameters of a group it adds later;
  each rank saves its parameters right after construction and right after `add_param_group` (no step taken).
- `odd-widths`: a model whose weight widths (13, 33, 25) the world size does not divide, trained as dp_rank.py trains
  (each rank on its 1/W of every global batch); each rank saves its parameters at the end.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \
        tests/support/dp_asymmetric_rank.py broadcast --out DIR
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

from zenflow import ZenFlowAdamW

GLOBAL_BATCH = 8
ODD_WIDTHS = (13, 33, 25, 6)  # inputs of every Linear: no width is a multiple of 2 (or of 4)


def odd_model() -> torch.nn.Module:
    torch.manual_seed(0)
    a, b, c, d = ODD_WIDTHS
    return torch.nn.Sequential(torch.nn.Linear(a, b), torch.nn.GELU(), torch.nn.Linear(b, c), torch.nn.GELU(),
                               torch.nn.Linear(c, d))


def odd_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(steps):
        x = torch.randn(GLOBAL_BATCH, ODD_WIDTHS[0], generator=g)
        batches.append((x, torch.randn(GLOBAL_BATCH, ODD_WIDTHS[-1], generator=g)))
    return batches


def base_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.GELU(), torch.nn.Linear(12, 4))


def late_layer() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Linear(4, 6)


def snapshot(*modules: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {f"{i}.{k}": v.detach().clone() for i, m in enumerate(modules) for k, v in m.state_dict().items()}


def broadcast(rank: int, out: Path, config: dict) -> None:
    model, late = base_model(), late_layer()
    with torch.no_grad():
        if rank == 1:  # a rank that did not seed like rank 0
            for p in model.parameters():
                p.add_(1.0)
            for p in late.parameters():
                p.add_(2.0)
    opt = ZenFlowAdamW(model.parameters(), **config)
    torch.save(snapshot(model), out / f"constructed-rank{rank}.pt")
    opt.add_param_group({"params": list(late.parameters())})
    torch.save(snapshot(late), out / f"added-rank{rank}.pt")
    opt.close()


def odd_widths(rank: int, world: int, out: Path, config: dict, steps: int) -> None:
    model = odd_model()
    opt = ZenFlowAdamW(model.parameters(), **config)
    share = GLOBAL_BATCH // world
    for x, y in odd_batches(steps):
        rows = slice(rank * share, (rank + 1) * share)
        torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        opt.step()
        opt.zero_grad()
    opt.close()
    torch.save(snapshot(model), out / f"params-rank{rank}.pt")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", choices=["broadcast", "odd-widths"])
    ap.add_argument("--config", default="{}", help="ZenFlowAdamW keyword arguments, JSON")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=dp_rank.COLLECTIVE_TIMEOUT_S))
    rank, world = dist.get_rank(), dist.get_world_size()
    config = json.loads(args.config)
    if args.scenario == "broadcast":
        broadcast(rank, args.out, config)
    else:
        odd_widths(rank, world, args.out, config, args.steps)
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown (as dp_rank.py: gloo's thread at exit)


if __name__ == "__main__":
    main()
