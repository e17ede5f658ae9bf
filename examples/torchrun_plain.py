"""Data-parallel ZenFlowAdamW: one process per device, started by torchrun; no DDP wrapper (docs/distributed.md).

    torchrun --standalone --nproc-per-node 2 examples/torchrun_plain.py --steps 100

Each rank trains on its own shard of every global batch; ZenFlowAdamW averages the gradients, keeps its host
state to this rank's block of columns and gives every rank the same parameters (nccl on GPUs, gloo on CPUs).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist

from zenflow import ZenFlowAdamW


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--global-batch", type=int, default=64)
    args = ap.parse_args()
    cuda, local_rank = torch.cuda.is_available(), int(os.environ.get("LOCAL_RANK", 0))
    if cuda and local_rank >= torch.cuda.device_count():  # one process per GPU; say so rather than "invalid ordinal"
        sys.exit(f"local rank {local_rank} has no GPU of its own ({torch.cuda.device_count()} visible): start at "
                 "most that many processes per node, or CUDA_VISIBLE_DEVICES= to run every rank on the CPU")
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)  # NCCL's communicator for this rank lives on its own GPU
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(minutes=5))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # same data stream on every rank; each takes its shard
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).to(device)
    target = torch.nn.Linear(64, 64).to(device)
    opt = ZenFlowAdamW(model.parameters(), lr=3e-3, weight_decay=0.01,
                       zenflow={"topk_ratio": 0.1, "update_interval": 4, "overlap_step": True})
    share = args.global_batch // world
    for _ in range(args.steps):
        x = torch.randn(args.global_batch, 64, device=device)[rank * share:(rank + 1) * share]
        loss = torch.nn.functional.mse_loss(model(x), target(x).detach())  # the mean over this rank's shard
        loss.backward()
        opt.step()
        opt.zero_grad()
    opt.close()  # every rank: drains (a collective) and stops the worker
    checksum = torch.stack([p.detach().double().sum() for p in model.parameters()]).sum()
    print(f"rank {rank}/{world}: final loss {loss.item():.4f}, parameter checksum {checksum.item():.10f}, "
          f"host state {opt.host_state_bytes / 1e6:.2f} MB on this rank")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
