"""ZenFlow's data parallelism over torch.distributed: what each rank sends, and to whom.

Every rank holds the whole model and its own 1/W of the global batch; the model is not wrapped in DDP. Per step:

- dense params and selected columns: their gradients are averaged across ranks (all-reduce), and every rank applies
  the same device update;
- unselected columns: column `j` of a weight with `n` columns belongs to the host of rank `j * W // n` (contiguous
  blocks of columns, fixed for the whole run, so a column that stays on the host never changes rank); its gradient
  is reduced to that rank only, which accumulates it and runs host AdamW on it; at the boundary each rank sends
  its updated columns to the others (a broadcast per rank: an all-gather of unequal blocks);
- selection: ranks agree on the top-k columns by summing one number per column (each column's norm, contributed
  by the rank that holds its averaged gradient), never gradients;
- clipping: the global norm is summed across ranks from the parts each rank holds averaged.

Host memory per rank is then about 1/W of one process's (its block of the unselected columns). A rank that dies
makes the others' next collective fail: with gloo as soon as the connection drops, otherwise after the process
group's `timeout` (set it at `init_process_group`; docs/distributed.md). The error names this rank and the step.

Which strategy an optimizer holds is chosen once, by `zenflow.fsdp.ranks_for`: FSDP2's row shards when the
parameters are its DTensors, else this module's `data_parallel` (a DataParallel, or a SingleProcess).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist

from zenflow.hooks import NET, Observers
from zenflow.layout import put_columns, take_columns
from zenflow.selection import as_columns, column_scores
from zenflow.state import ColumnState, StepView


class Ranks(Protocol):
    """What the optimizer holds as `ranks`, decided once at construction: a SingleProcess, a DataParallel, or FSDP2's
    zenflow.fsdp.Sharded. Each step calls every method on every rank, in the same order."""

    rank: int
    world: int

    def view(self, param_groups: list[dict], state: dict) -> StepView: ...
    def owned(self, cols: torch.Tensor, width: int) -> torch.Tensor: ...
    def broadcast_from_first_(self, tensors: list[torch.Tensor]) -> None: ...
    def average_gradients_(self, params: list[torch.Tensor], state: dict) -> None: ...
    def share_blocks_(self, weights: list[torch.Tensor]) -> None: ...
    def total_norm(self, params: list[torch.Tensor], state: dict) -> torch.Tensor: ...
    def column_scores(self, grad: torch.Tensor, norm: str) -> torch.Tensor: ...
    def share_entering_gradients_(self, grad: torch.Tensor, new_sel: torch.Tensor, old_sel: torch.Tensor) -> None: ...
    def columns_from_owners(self, source: torch.Tensor, cols: torch.Tensor, width: int,
                            position: torch.Tensor) -> torch.Tensor: ...
    def whole_rms(self, numels: list[int], rms: list[float]) -> list[float]: ...
    def selected_rms(self, numels: list[int]) -> Callable[[list[float]], list[float]] | None: ...


def owner_of(cols: torch.Tensor, width: int, world: int) -> torch.Tensor:
    """The rank whose host owns each of `cols` (columns of a weight with `width` columns): contiguous blocks."""
    return cols * world // width


def block_of(rank: int, width: int, world: int) -> slice:
    """The columns `owner_of` gives to `rank`, as a slice: [ceil(rank·width/W), ceil((rank+1)·width/W))."""
    return slice((rank * width + world - 1) // world, ((rank + 1) * width + world - 1) // world)


class DistributedError(RuntimeError):
    """A collective with the other ranks failed: a rank died, or did not answer within the group's timeout."""


def data_parallel(process_group: object, observers: Observers) -> DataParallel | SingleProcess:
    """`process_group=None`: the default group when one is initialized with more than one rank; a group: that group;
    `False`: no data parallelism (each process trains alone). One process: a SingleProcess."""
    if process_group is False or not dist.is_available() or not dist.is_initialized():
        if process_group not in (None, False):
            raise ValueError("process_group was given but torch.distributed is not initialized: call "
                             "torch.distributed.init_process_group first (torchrun sets up its environment)")
        return SingleProcess()
    group = None if process_group is None else process_group
    if dist.get_world_size(group) == 1:
        return SingleProcess()
    return DataParallel(group, observers)


class SingleProcess:
    """One process, no exchange (the stand-in for DataParallel): its host owns every column, the collectives are
    no-ops, and the global norm is torch's."""

    rank, world = 0, 1

    def view(self, param_groups: list[dict], state: dict) -> StepView:
        return StepView(param_groups, state)  # the parameters themselves

    def owned(self, cols: torch.Tensor, width: int) -> torch.Tensor:
        return cols

    def broadcast_from_first_(self, tensors: list[torch.Tensor]) -> None:
        pass

    def average_gradients_(self, params: list[torch.Tensor], state: dict) -> None:
        pass

    def share_blocks_(self, weights: list[torch.Tensor]) -> None:
        pass

    def total_norm(self, params: list[torch.Tensor], state: dict) -> torch.Tensor:
        return torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])

    def column_scores(self, grad: torch.Tensor, norm: str) -> torch.Tensor:
        return column_scores(grad, norm)

    def share_entering_gradients_(self, grad: torch.Tensor, new_sel: torch.Tensor, old_sel: torch.Tensor) -> None:
        pass

    def columns_from_owners(self, source: torch.Tensor, cols: torch.Tensor, width: int,
                            position: torch.Tensor) -> torch.Tensor:
        return take_columns(source, position[cols])

    def whole_rms(self, numels: list[int], rms: list[float]) -> list[float]:
        return rms

    def selected_rms(self, numels: list[int]) -> None:
        return None  # the selected columns' masses are whole already


class Collectives:
    """A process group's collectives as the optimizer runs them: on the training thread, counted in the optimizer's
    byte counters, a failure raised as DistributedError. DataParallel and zenflow.fsdp.Sharded exchange through it."""

    def __init__(self, group: dist.ProcessGroup | None, observers: Observers) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.observers = observers
        # where tensors must be for this group's collectives (nccl: the current GPU; gloo: the CPU)
        nccl = dist.get_backend(group) == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    def sum_(self, t: torch.Tensor, kind: str) -> None:
        self._count(kind, t)
        self._run(dist.all_reduce, t, group=self.group)

    def whole_rms(self, numels: list[int], rms: list[float]) -> list[float]:
        """Per weight, the RMS of the whole accumulated sum from each rank's RMS of its block ("auto" interval)."""
        t = torch.tensor([r * r * n for r, n in zip(rms, numels)] + list(numels), dtype=torch.float64)
        t = t.to(self.device)
        self.sum_(t, "auto_masses")
        squares, counts = t[:len(rms)].cpu(), t[len(rms):].cpu()
        return (squares / counts.clamp(min=1)).sqrt().tolist()

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def _count(self, kind: str, t: torch.Tensor) -> None:
        self.observers.transfer(NET, kind, t.numel() * t.element_size())

    def _run(self, collective: object, *args: object, **kwargs: object) -> None:
        try:
            with self.observers.blocking("collective"):  # exposed communication: I/O in the step's split
                collective(*args, **kwargs)
        except Exception as exc:  # gloo: connection closed; nccl/gloo: timeout (the group's `timeout`)
            raise DistributedError(
                f"zenflow: rank {self.rank} of {self.world}: {collective.__name__} with the other ranks failed (a "
                f"rank died or did not answer within the process group's timeout): {exc}") from exc


class DataParallel(Collectives):
    """This rank's side of the exchange: who owns which host columns, and the collectives of a step."""

    def selected_rms(self, numels: list[int]) -> None:
        return None  # the selected columns are averaged on every rank: their masses are whole already

    def view(self, param_groups: list[dict], state: dict) -> StepView:
        return StepView(param_groups, state)  # replicated parameters: the step reads them whole

    # ---- ownership --------------------------------------------------------------------------------------
    def owners(self, cols: torch.Tensor, width: int) -> torch.Tensor:
        return owner_of(cols, width, self.world)

    def owned(self, cols: torch.Tensor, width: int) -> torch.Tensor:
        return cols[self.owners(cols, width) == self.rank]

    # ---- collectives (each on the training thread, in the same order on every rank) --------------------
    def reduce_blocks_to_owners_(self, grads: list[torch.Tensor]) -> None:
        """Each weight's column block becomes, on the rank that owns it, the mean over ranks of that block; elsewhere
        it is left as it was (and not read again). One reduce per owner and bucket: a reduce-scatter of unequal
        blocks. Whole blocks (the selected columns in them too) move as contiguous slices, no column gather."""
        for owner in range(self.world):
            for bucket in _buckets([(g, block_of(owner, g.shape[1], self.world)) for g in grads]):
                flat = _flatten(bucket)
                self._count("grad_reduce", flat)
                self._run(dist.reduce, flat, dst=self._global(owner), group=self.group)
                if owner == self.rank:
                    _unflatten_into(flat.div_(self.world), bucket)

    def share_blocks_(self, weights: list[torch.Tensor]) -> None:
        """After the host updates, each owner sends its column block of every weight (`[out, in]`) to every rank: its
        host's columns, and selected columns that are the same on every rank already. One broadcast per owner and
        bucket: an all-gather of unequal blocks."""
        for owner in range(self.world):
            for bucket in _buckets([(w, block_of(owner, w.shape[1], self.world)) for w in weights]):
                flat = _flatten(bucket)
                self._count("param_gather", flat)
                self._run(dist.broadcast, flat, src=self._global(owner), group=self.group)
                if owner != self.rank:
                    _unflatten_into(flat, bucket)

    # ---- the pieces of a ZenFlow step ----------------------------------------------------------------------
    def broadcast_from_first_(self, tensors: list[torch.Tensor]) -> None:
        """Every rank starts from rank 0's parameters (as DDP does at construction)."""
        with torch.no_grad():
            for t in tensors:
                self._run(dist.broadcast, t.detach(), src=self._global(0), group=self.group)

    def average_gradients_(self, params: list[torch.Tensor], state: dict) -> None:
        """Dense gradients and selected columns averaged on every rank; each weight's column block averaged on the
        rank that owns it (its host's columns are in it). In place in `p.grad` (as DDP does); a column's gradient is
        read only where it is averaged."""
        everywhere, blocks = [], []  # (tensor, columns or None) averaged on every rank; column gradients
        for p in params:
            if p.grad is None:
                continue
            st = state[p]
            if not isinstance(st, ColumnState):
                everywhere.append((p.grad, None))
                continue
            grad = as_columns(p.grad)
            blocks.append(grad)
            if st.sel.numel():
                everywhere.append((grad, st.sel))
        averaged = []  # gathered first: the block reduce below rewrites the owners' blocks, selected columns too
        for bucket in _buckets(everywhere):
            flat = _flatten(bucket)
            self._count("grad_average", flat)
            self._run(dist.all_reduce, flat, group=self.group)
            averaged.append((flat.div_(self.world), bucket))
        self.reduce_blocks_to_owners_(blocks)
        for flat, bucket in averaged:  # the same values on every rank, whatever the block reduce wrote
            _unflatten_into(flat, bucket)

    def total_norm(self, params: list[torch.Tensor], state: dict) -> torch.Tensor:
        """L2 norm of the averaged gradient: each rank counts its own column blocks (averaged there) and rank 0 the
        dense gradients; the squares are summed across ranks."""
        square = torch.zeros((), dtype=torch.float64, device=params[0].device)
        for p in params:
            if p.grad is None:
                continue
            if not isinstance(state[p], ColumnState):
                if self.rank == 0:
                    square += torch.linalg.vector_norm(p.grad, dtype=torch.float32).double().square()
                continue
            grad = as_columns(p.grad)
            mine = grad[:, block_of(self.rank, grad.shape[1], self.world)]
            square += torch.linalg.vector_norm(mine, dtype=torch.float32).double().square()
        square = square.reshape(1).to(self.device)
        self.sum_(square, "grad_norm")
        return square.sqrt().float()[0].to(params[0].device)

    def column_scores(self, grad: torch.Tensor, norm: str) -> torch.Tensor:
        """Every column's norm of the averaged gradient, on every rank: each rank scores its own block, one number
        per column crosses."""
        scores = torch.zeros(grad.shape[1], dtype=torch.float32, device=grad.device)
        mine = block_of(self.rank, grad.shape[1], self.world)
        scores[mine] = column_scores(grad[:, mine], norm)
        self.sum_(scores, "column_norms")
        return scores

    def share_entering_gradients_(self, grad: torch.Tensor, new_sel: torch.Tensor, old_sel: torch.Tensor) -> None:
        """Columns that become selected (in `new_sel`, not in `old_sel`): their averaged gradient, held by their owner,
        goes to every rank."""
        entering = new_sel[~torch.isin(new_sel, old_sel)]  # the same on every rank
        if entering.numel():
            block = self.from_owners(grad, entering, grad.shape[1])
            self.sum_(block, "grad_average")
            grad.index_copy_(1, entering, block)

    def columns_from_owners(self, source: torch.Tensor, cols: torch.Tensor, width: int,
                            position: torch.Tensor) -> torch.Tensor:
        """Columns `cols` of a weight, each from the host of the rank that owns it (`source[:, position[col]]`
        there), on every rank: one sum across ranks, on the group's device (nccl: the GPU)."""
        block = self.from_owners(source, cols, width, position).to(self.device)
        self.sum_(block, "moved_state")
        return block

    def from_owners(self, source: torch.Tensor, cols: torch.Tensor, width: int,
                    position: torch.Tensor | None = None) -> torch.Tensor:
        """A `[rows, len(cols)]` block with the columns this rank owns filled from `source` (column `col` of the
        weight is `source[:, position[col]]`, or `source[:, col]`) and zeros elsewhere. Summed across ranks (sum_),
        each entry comes from exactly one rank, so the sum is that rank's value, exactly."""
        block = torch.zeros(source.shape[0], cols.numel(), dtype=source.dtype, device=source.device)
        mine = (self.owners(cols, width) == self.rank).to(source.device)
        cols = cols.to(source.device)
        index = cols[mine] if position is None else position.to(source.device)[cols[mine]]
        block[:, mine] = source.index_select(1, index)
        return block


BUCKET_ELEMENTS = 1 << 25  # per collective: few calls (gloo's latency is per call), bounded extra memory (64 MB bf16)


def _buckets(pieces: list[tuple[torch.Tensor, slice | torch.Tensor | None]]) -> list[list]:
    """Consecutive (tensor, columns) pieces of one dtype, up to BUCKET_ELEMENTS each; columns: a slice (a block), an
    index tensor, or None (the whole tensor). Empty pieces are left out."""
    buckets: list[list] = []
    size = 0
    for t, cols in pieces:
        n = math.prod(_shape(t, cols))
        if n == 0:
            continue
        if not buckets or size + n > BUCKET_ELEMENTS or buckets[-1][0][0].dtype != t.dtype:
            buckets.append([])
            size = 0
        buckets[-1].append((t, cols))
        size += n
    return buckets


def _shape(t: torch.Tensor, cols: slice | torch.Tensor | None) -> tuple[int, ...]:
    if cols is None:
        return tuple(t.shape)
    return (t.shape[0], len(range(t.shape[1])[cols]) if isinstance(cols, slice) else cols.numel())


def _piece(t: torch.Tensor, cols: slice | torch.Tensor | None) -> torch.Tensor:
    if cols is None:
        return t
    return t[:, cols] if isinstance(cols, slice) else take_columns(t, cols)


def _flatten(bucket: list) -> torch.Tensor:
    """One contiguous buffer of the bucket's pieces, in order."""
    return torch.cat([_piece(t, cols).reshape(-1) for t, cols in bucket])


def _unflatten_into(flat: torch.Tensor, bucket: list) -> None:
    offset = 0
    for t, cols in bucket:
        shape = _shape(t, cols)
        piece = flat[offset:offset + math.prod(shape)].view(shape)
        if isinstance(cols, torch.Tensor):
            put_columns(t, cols, piece)
        else:
            _piece(t, cols).copy_(piece)
        offset += piece.numel()
