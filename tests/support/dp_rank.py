"""One rank of the data-parallel tests (tests/core/test_distributed.py), started by torchrun (or by hand with RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT set). Each rank trains the same small model on its 1/W of every global batch
through ZenFlowAdamW under the default process group, and saves its parameters (and optimizer state) to --out.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/support/dp_rank.py --config '{...}' --out DIR
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from zenflow import ZenFlowAdamW

GLOBAL_BATCH = 8
# gloo's wait in a collective before it fails the rank: a normal collective of these tiny models takes well under
# a second even on a loaded 2-core VM; a bug that sends the ranks down different paths (one waits in a collective
# the other never makes) fails the test in this long instead of gloo's 60 s (93 s to fail, measured)
COLLECTIVE_TIMEOUT_S = 20
# The ZenFlow settings the two-rank tests share (tests/core/test_distributed.py, test_fsdp.py): reselection and
# clipping in sync mode; warm-up, reselection and clipping with overlap.
SYNC = {"lr": 0.01, "gradient_clipping": 1.0,
        "zenflow": {"topk_ratio": 0.25, "update_interval": 2, "select_interval": 4, "overlap_step": False}}
OVERLAP = {"lr": 0.01, "gradient_clipping": 0.5,
           "zenflow": {"topk_ratio": 0.25, "update_interval": 3, "select_interval": 3, "overlap_step": True,
                       "full_warm_up_rounds": 1}}


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.Linear(32, 24), torch.nn.GELU(),
                               torch.nn.Linear(24, 6))


def global_batches(steps: int, outputs: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input, target) of every step's global batch, from the seed alone; `outputs`: the target's width (the
    FSDP2 tests' model ends in one)."""
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(GLOBAL_BATCH, 12, generator=g), torch.randn(GLOBAL_BATCH, outputs, generator=g))
            for _ in range(steps)]


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, batches: list, rank: int, world: int) -> None:
    """Mean loss over this rank's shard: the mean of the ranks' gradients is the global batch's gradient."""
    share = GLOBAL_BATCH // world
    for x, y in batches:
        rows = slice(rank * share, (rank + 1) * share)
        torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        opt.step()
        opt.zero_grad()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True, help="ZenFlowAdamW keyword arguments, JSON")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--save-at", type=int, default=None, help="also save the optimizer state after this many steps")
    ap.add_argument("--resume-from", type=Path, default=None, help="load params and state saved by --save-at first")
    ap.add_argument("--die-at", type=int, default=None, help="rank 1 exits (as a crash would) before this step")
    ap.add_argument("--timeout", type=float, default=COLLECTIVE_TIMEOUT_S)
    ap.add_argument("--ddp", action="store_true", help="wrap the model in DistributedDataParallel (handled: tested)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung rank's stacks: kill -USR1 <pid>
    args.out.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model()
    opt = ZenFlowAdamW(model.parameters(), **json.loads(args.config))
    if args.ddp:
        model = torch.nn.parallel.DistributedDataParallel(model)
    batches = global_batches(args.steps)
    start = 0
    if args.resume_from is not None:
        saved = torch.load(args.resume_from / f"state-rank{rank}.pt", weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        start = saved["step"]
    for step in range(start, args.steps):
        if args.die_at is not None and step == args.die_at and rank == 1:
            os._exit(17)  # no cleanup, no goodbye: a crashed rank
        train(model, opt, batches[step:step + 1], rank, world)
        if args.save_at is not None and step + 1 == args.save_at:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step + 1},
                       args.out / f"state-rank{rank}.pt")
    opt.close()
    plain = model.module if args.ddp else model
    torch.save({k: v.detach().clone() for k, v in plain.state_dict().items()}, args.out / f"params-rank{rank}.pt")
    torch.save({**opt.transfer_bytes, "host_state_bytes": opt.host_state_bytes,
                "host_staging_bytes": opt.host_staging_bytes}, args.out / f"bytes-rank{rank}.pt")
    dist.destroy_process_group()
    # no interpreter teardown: a DDP Reducer freed at exit can deadlock with gloo's thread (zenflow/harness/runner.py)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
