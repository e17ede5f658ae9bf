"""ZenFlowAdamW over FSDP2's sharded parameters (`torch.distributed.fsdp.fully_shard`): the Sharded strategy.

FSDP2 shards every parameter on dim 0 (rows) as a `Shard(0)` DTensor; ZenFlow selects columns (dim 1). So every
rank holds *all* columns of *its* rows, and everything a ZenFlow step does to a column is local to the shard once the
ranks agree on which columns are selected:

- gradients: FSDP2 has already averaged them (its reduce-scatter): each rank holds its rows of the mean gradient;
- selection: a column's L2 norm squared (or L1 norm) is a sum over rows, so each rank sums its rows and one
  all-reduce of one fp32 number per column gives every rank the same scores, hence the same top-k (the paper's
  "lightweight selection": 1/rows of the gradient's size crosses, never gradients);
- clipping and overflow: the global norm from each rank's sum of squares of its shards, summed;
- the "auto" interval: each rank's masses of its rows (selected and accumulated), summed when the rule reads them;
- the device update, the offload, the host AdamW and the upload: this rank's rows only, on its own device and host.
  Nothing else crosses between ranks; FSDP2 all-gathers the updated rows at the next forward, as it always does.

Host state per rank is its rows' unselected columns: 1/W of one process's, as with data parallelism, but the device
holds only 1/W of the weights too (FSDP2's point). The optimizer works on the local shards (`step_view`): plain
tensors that alias FSDP2's storage, so the update lands in the sharded parameters in place. Uneven shards (rows not
divisible by W: FSDP2 pads internally, `to_local()` is unpadded; a rank may hold no rows at all) need nothing special.
Mixed precision is FSDP2's (`MixedPrecisionPolicy`): the sharded parameters the optimizer sees keep their dtype.
docs/distributed.md, "FSDP2".
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch

from zenflow.config import ConfigError
from zenflow.distributed import Collectives, Ranks, SingleProcess, data_parallel
from zenflow.hooks import Observers
from zenflow.selection import column_sums
from zenflow.state import StepView


def ranks_for(params: list[torch.Tensor], process_group: object, observers: Observers) -> Ranks:
    """The optimizer's strategy, decided once: Sharded when the parameters are FSDP2's DTensors, otherwise data
    parallelism as distributed.data_parallel decides it."""
    if not any(is_dtensor(p) for p in params):
        return data_parallel(process_group, observers)
    mesh = check_sharded(params, process_group)
    if mesh.size() == 1:
        return OneShard()
    return Sharded(mesh.get_group(), observers)


def check_sharded(params: list[torch.Tensor], process_group: object) -> object:
    """Every parameter a `Shard(0)` DTensor of one 1-D mesh (what `fully_shard` makes); refused in one line
    otherwise, before any state exists. Returns the mesh."""
    from torch.distributed.tensor import Shard

    if process_group is not None:
        raise ConfigError(f"process_group = {process_group!r} is not allowed with FSDP2's sharded parameters: expected "
                          "None (the parameters' device mesh is the group)")
    meshes = set()
    for i, p in enumerate(params):
        if not is_dtensor(p):
            raise ConfigError(f"parameter {i} (shape {tuple(p.shape)}) is a plain tensor beside FSDP2's DTensors: "
                              "expected every parameter sharded by fully_shard (apply it to the root module too)")
        if tuple(p.placements) != (Shard(0),):
            raise ConfigError(f"parameter {i} has placements {tuple(p.placements)}: expected (Shard(dim=0),), "
                              "FSDP2's fully_shard on a 1-D mesh (HSDP and tensor parallelism are not supported)")
        meshes.add(p.device_mesh)
    if len(meshes) != 1:
        raise ConfigError(f"parameters on {len(meshes)} device meshes: expected one (fully_shard with one mesh)")
    return meshes.pop()


def is_dtensor(t: object) -> bool:
    """Whether `t` is a DTensor, without importing torch.distributed.tensor (it pulls in sympy: `import zenflow` needs
    torch alone): whoever made a DTensor has imported it already."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def local_of(t: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a DTensor (FSDP2's storage itself, unpadded), or the tensor itself."""
    if not is_dtensor(t):
        return t
    with torch.no_grad():
        return t.to_local()


def sharded_view(param_groups: list[dict], state: dict) -> StepView:
    """The step's view of FSDP2's parameters: per parameter a fresh alias of its local rows, with its local gradient
    rows as `.grad`, and the state keyed by those aliases. Made again at every step: FSDP2 may replace a parameter's
    local tensor (`reset_sharded_param`), and an alias kept between steps would hold the last gradient alive."""
    views, local_state = {}, {}
    for group in param_groups:
        for p in group["params"]:
            view = local_of(p).detach().requires_grad_(p.requires_grad)  # FSDP2's storage: updates land in place
            view.grad = None if p.grad is None else local_of(p.grad)
            views[p] = view
            if p in state:
                local_state[view] = state[p]
    groups = [{**g, "params": [views[p] for p in g["params"]]} for g in param_groups]
    return StepView(groups, local_state)


class OneShard(SingleProcess):
    """FSDP2 on a mesh of one rank: one process's step on the DTensors' local tensors (the whole parameters)."""

    def view(self, param_groups: list[dict], state: dict) -> StepView:
        return sharded_view(param_groups, state)


class Sharded(Collectives):
    """This rank's side of a ZenFlow step over FSDP2: its rows of every parameter, all their columns on its host."""

    # ---- ownership: every column of this rank's rows is this rank's ------------------------------------------
    def owned(self, cols: torch.Tensor, width: int) -> torch.Tensor:
        return cols

    def view(self, param_groups: list[dict], state: dict) -> StepView:
        return sharded_view(param_groups, state)

    # ---- what FSDP2 does already: nothing to exchange -------------------------------------------------------
    def broadcast_from_first_(self, tensors: list[torch.Tensor]) -> None:
        pass  # fully_shard kept each rank's rows of the model it built: build it alike on every rank (a seed)

    def average_gradients_(self, params: list[torch.Tensor], state: dict) -> None:
        pass  # FSDP2's reduce-scatter averaged them: each rank holds its rows of the mean gradient

    def share_blocks_(self, weights: list[torch.Tensor]) -> None:
        pass  # each rank updated its own rows; FSDP2 all-gathers them at the next forward

    def share_entering_gradients_(self, grad: torch.Tensor, new_sel: torch.Tensor, old_sel: torch.Tensor) -> None:
        pass  # an entering column's gradient rows are on this rank already

    def columns_from_owners(self, source: torch.Tensor, cols: torch.Tensor, width: int,
                            position: torch.Tensor) -> torch.Tensor:
        return source.index_select(1, position[cols])  # this rank's host holds its rows of every column

    # ---- what the ranks must agree on ------------------------------------------------------------------------
    def total_norm(self, params: list[torch.Tensor], state: dict) -> torch.Tensor:
        """L2 norm of the whole (averaged) gradient: each rank's squares of its rows of every parameter, summed."""
        device = params[0].device
        square = torch.zeros((), dtype=torch.float64, device=device)
        for p in params:
            if p.grad is not None and p.grad.numel():
                square += torch.linalg.vector_norm(p.grad, dtype=torch.float32).double().square()
        square = square.reshape(1).to(self.device)
        self.sum_(square, "grad_norm")
        return square.sqrt().float()[0].to(device)

    def selected_rms(self, numels: list[int]) -> Callable[[list[float]], list[float]]:
        """The "auto" interval's selected mass: each rank holds its rows of the selected columns, so their RMS is
        summed over the ranks as the accumulated sums' is (whole_rms), once, when the rule reads it."""
        return functools.partial(self.whole_rms, numels)

    def column_scores(self, grad: torch.Tensor, norm: str) -> torch.Tensor:
        """Every column's norm over all ranks' rows, the same on every rank: partial sums (of squares for L2, of
        magnitudes for L1) over this rank's rows, one all-reduce of one fp32 number per column."""
        partial = column_sums(grad, norm).to(self.device)  # a rank without rows: zeros
        self.sum_(partial, "column_norms")
        scores = partial.sqrt() if norm == "l2" else partial
        return scores.to(grad.device)

