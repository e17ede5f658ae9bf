"""The zero_optimization blocks an engine's registry row names (`EngineSpec.zero`): each is (cuda, nvme_path) -> the
block, before the row's ZenFlow block is added to it. Only the DeepSpeed engines read more than its stage.
"""

from __future__ import annotations

from typing import Any

# Twin-Flow: the share of the optimizer's sub-groups DeepSpeed keeps on the host (offload_optimizer.ratio), and how
# many sub-groups the model is cut into for it (DeepSpeed splits by whole sub-groups; its default sub_group_size of
# 1e9 elements makes one group of any model under 1B parameters, and then the ratio has nothing to split).
TWIN_FLOW_RATIO = 0.5
TWIN_FLOW_SUB_GROUPS = 16


def zero_offload(cuda: bool, nvme_path: str | None) -> dict[str, Any]:
    """ZeRO-2 with the optimizer on the host (ZeRO-Offload); ours read only the ZenFlow block inside it."""
    return {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": cuda}}


def zero_infinity(cuda: bool, nvme_path: str | None) -> dict[str, Any]:
    """ZeRO-3 with parameters and optimizer on the host, or on NVMe at `nvme_path`."""
    where = {"device": "nvme", "nvme_path": nvme_path} if nvme_path else {"device": "cpu"}
    return {"stage": 3, "offload_optimizer": {**where, "pin_memory": cuda},
            "offload_param": {**where, "pin_memory": cuda}}


def twin_flow(cuda: bool, nvme_path: str | None) -> dict[str, Any]:
    """ZeRO-3 with TWIN_FLOW_RATIO of the optimizer's sub-groups on the host; "auto": resolve_sub_groups."""
    return {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": cuda, "ratio": TWIN_FLOW_RATIO},
            "sub_group_size": "auto"}


def not_deepspeed(cuda: bool, nvme_path: str | None) -> dict[str, Any]:
    """Not DeepSpeed: only the config's optimizer, clipping and dtype are read."""
    return {"stage": 0}


def resolve_sub_groups(ds_config: dict[str, Any], numel: int) -> dict[str, Any]:
    """sub_group_size "auto" (ds-twin-flow): a model of `numel` parameters in TWIN_FLOW_SUB_GROUPS groups, so that
    offload_optimizer.ratio has groups to split. The engine's config (and so the run record) holds the number."""
    zero = ds_config.get("zero_optimization", {})
    if zero.get("sub_group_size") != "auto":
        return ds_config
    return {**ds_config, "zero_optimization": {**zero, "sub_group_size": -(-numel // TWIN_FLOW_SUB_GROUPS)}}
