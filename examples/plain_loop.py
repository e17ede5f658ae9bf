"""The smallest ZenFlowAdamW training loop: a plain PyTorch model, loop and optimizer (no harness, no DeepSpeed).

    python examples/plain_loop.py --steps 200
"""

from __future__ import annotations

import argparse

import torch

from zenflow import ZenFlowAdamW


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    target = torch.nn.Linear(64, 64)  # the function to learn
    opt = ZenFlowAdamW(model.parameters(), lr=3e-3, weight_decay=0.01,
                       zenflow={"topk_ratio": 0.1, "update_interval": 4, "overlap_step": True})
    with opt:  # stops the host worker at the end, after applying the last host update
        for step in range(args.steps):
            x = torch.randn(32, 64)
            loss = torch.nn.functional.mse_loss(model(x), target(x).detach())
            loss.backward()
            opt.step()
            opt.zero_grad()
            if step == 0:
                first = loss.item()
        opt.drain()  # the last in-flight host update, before evaluating
        with torch.no_grad():
            x = torch.randn(256, 64)
            final = torch.nn.functional.mse_loss(model(x), target(x)).item()
    print(f"loss {first:.4f} -> {final:.4f} after {args.steps} steps ({opt.host_updates} host updates)")


if __name__ == "__main__":
    main()
