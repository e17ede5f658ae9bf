"""ref-zenflow-fsdp2: ZenFlowAdamW over FSDP2's sharded parameters (zenflow/fsdp.py), for models that outgrow one
GPU.

`fully_shard` per decoder layer and at the root, as fsdp2-offload shards, but without FSDP2's CPUOffloadPolicy: the
parameters stay on the device in the training dtype (as ref-zenflow's), row-sharded over the ranks, and ZenFlow
moves the unselected columns of each rank's rows to that rank's host itself. Each rank holds 1/W of the weights,
gradients and ZenFlow's state; FSDP2 all-gathers one layer at a time for the forward and backward and
reduce-scatters the gradients; ZenFlow adds one fp32 number per column per selection between the ranks.
"""

from __future__ import annotations

from typing import Any

import torch

from zenflow import ZenFlowAdamW
from zenflow.harness.engines.classes import ZenFlowEngine, fingerprints
from zenflow.harness.engines.peers import decoder_layers, fsdp2_missing
from zenflow.harness.engines.process import join_ranks


class ShardedZenFlowEngine(ZenFlowEngine):
    """ZenFlowAdamW on the DTensor parameters of a model sharded by FSDP2 (a process group even for one rank)."""

    @classmethod
    def unavailable(cls, name: str, cuda: bool) -> str | None:
        return fsdp2_missing("fully_shard")

    def build_optimizer(self, distributed: bool) -> ZenFlowAdamW:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        self.device = join_ranks(self.device, single=True)  # FSDP2 needs a process group, even of one
        mesh = init_device_mesh(self.device.type, (torch.distributed.get_world_size(),))
        for layer in decoder_layers(self.model):  # one all-gather per decoder layer
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        return ZenFlowAdamW.from_deepspeed_config(self.model.parameters(), self.ds_config,
                                                  accumulate_on=self.accumulate_on)

    def weight_fingerprints(self) -> dict[str, Any]:
        """The sharded parameters gathered whole (a collective: every rank)."""
        return fingerprints((n, p.full_tensor()) for n, p in self.model.named_parameters())
