"""What ZenFlowAdamW refuses of FSDP2's parameters, in one line, before any state exists (zenflow/fsdp.py), in a
process group of one rank made for each test. And the choice itself: DTensors make a sharded strategy, plain
parameters keep data parallelism's choice."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, distribute_tensor

from zenflow import ZenFlowAdamW
from zenflow.config import ConfigError
from zenflow.distributed import SingleProcess
from zenflow.fsdp import OneShard, is_dtensor, local_of


@pytest.fixture
def mesh() -> Iterator[object]:
    if dist.is_initialized():
        pytest.fail("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def sharded_linear(mesh: object) -> torch.nn.Module:
    model = torch.nn.Linear(6, 4)
    fully_shard(model, mesh=mesh)
    return model


def test_fsdp2_parameters_make_a_sharded_strategy_and_plain_ones_do_not(mesh: object) -> None:
    model = sharded_linear(mesh)
    assert all(is_dtensor(p) for p in model.parameters())
    assert isinstance(ZenFlowAdamW(model.parameters()).dp, OneShard)
    assert type(ZenFlowAdamW(torch.nn.Linear(6, 4).parameters()).dp) is SingleProcess
    assert not is_dtensor(local_of(model.weight)) and local_of(model.weight).shape == (4, 6)


def test_a_plain_parameter_beside_fsdp2s_is_refused(mesh: object) -> None:
    model = sharded_linear(mesh)
    with pytest.raises(ConfigError, match=r"parameter 2 .* plain tensor beside FSDP2's DTensors: expected every"):
        ZenFlowAdamW([*model.parameters(), torch.nn.Parameter(torch.zeros(3))])


def test_a_replicated_dtensor_is_refused(mesh: object) -> None:
    replicated = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 6), mesh, [Replicate()]))
    with pytest.raises(ConfigError, match=r"placements \(Replicate\(\),\): expected \(Shard\(dim=0\),\)"):
        ZenFlowAdamW([replicated])


def test_a_process_group_beside_fsdp2s_mesh_is_refused(mesh: object) -> None:
    with pytest.raises(ConfigError, match="process_group = .* is not allowed with FSDP2's sharded parameters"):
        ZenFlowAdamW(sharded_linear(mesh).parameters(), process_group=dist.group.WORLD)
