"""The refusals of tests/core/test_fsdp_refusals.py, in a process of their own: a process group of one rank and
DTensors made here would stay referenced by DTensor's caches in the test process, where a later fork (a run child
started with a preexec_fn) could deadlock in their destructors. Prints one line per case: `name<TAB>outcome`.

    python tests/support/fsdp_refusals.py
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, distribute_tensor

from zenflow import ZenFlowAdamW
from zenflow.config import ConfigError
from zenflow.distributed import SingleProcess
from zenflow.fsdp import OneShard, is_dtensor, local_of


def sharded_linear(mesh: object) -> torch.nn.Module:
    model = torch.nn.Linear(6, 4)
    fully_shard(model, mesh=mesh)
    return model


def refusal(build) -> str:
    try:
        build()
    except ConfigError as exc:
        return f"refused: {exc}"
    return "accepted"


def trains_with_a_frozen_layer(mesh: object) -> str:
    """A frozen first layer and a trained second one, both fully_shard-ed, 5 steps: "trains" when the frozen weights
    stay as they were and the trained ones move, else what happened."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Linear(16, 3))
    model[0].requires_grad_(False)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    before = {k: local_of(v).detach().clone() for k, v in model.state_dict().items()}
    try:
        opt = ZenFlowAdamW(model.parameters(), lr=0.01, zenflow={"topk_ratio": 0.25, "update_interval": 2,
                                                                  "overlap_step": False})
        for _ in range(5):
            torch.nn.functional.mse_loss(model(torch.randn(8, 12)), torch.randn(8, 3)).backward()
            opt.step()
            opt.zero_grad()
        opt.close()
    except Exception as exc:  # noqa: BLE001  (the outcome is the line printed)
        return f"failed: {type(exc).__name__}: {exc}"
    after = {k: local_of(v).detach() for k, v in model.state_dict().items()}
    frozen = all(torch.equal(before[k], after[k]) for k in before if k.startswith("0."))
    trained = all(not torch.equal(before[k], after[k]) for k in before if k.startswith("1."))
    return "trains" if frozen and trained else f"frozen kept {frozen}, trained moved {trained}"


def main() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    model = sharded_linear(mesh)
    chosen = (isinstance(ZenFlowAdamW(model.parameters()).ranks, OneShard)
              and type(ZenFlowAdamW(torch.nn.Linear(6, 4).parameters()).ranks) is SingleProcess)
    local = local_of(model.weight)
    print(f"choice\t{chosen and all(map(is_dtensor, model.parameters())) and not is_dtensor(local)}"
          f" {tuple(local.shape)}")
    plain = torch.nn.Parameter(torch.zeros(3))
    print("plain\t" + refusal(lambda: ZenFlowAdamW([*model.parameters(), plain])))
    replicated = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 6), mesh, [Replicate()]))
    print("replicated\t" + refusal(lambda: ZenFlowAdamW([replicated])))
    print("group\t" + refusal(lambda: ZenFlowAdamW(sharded_linear(mesh).parameters(), process_group=dist.group.WORLD)))
    meshes = [init_device_mesh("cpu", (1,), mesh_dim_names=(name,)) for name in ("a", "b")]  # two meshes, unequal
    print("two meshes\t" + refusal(lambda: ZenFlowAdamW([p for m in meshes for p in sharded_linear(m).parameters()])))
    print(f"frozen\t{trains_with_a_frozen_layer(mesh)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
