"""The host part: fp32 master columns, AdamW moments and gradient accumulators in CPU memory, and the arithmetic on
them (accumulate_, host_adamw_). Who runs it: the training thread inline, or worker.py's thread in the background
when `overlap_step` is on. docs/host-worker.md has the host memory this module's buffers take (`host_bytes`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from zenflow.adam import AdamWHyper, adamw_
from zenflow.layout import offloaded_positions, take_columns
from zenflow.link import Link, aligned


@dataclass
class HostColumns:
    """Host state of the host-owned (unselected) columns of one column parameter `W[out, in]`.

    Every buffer is a contiguous `[out, n_host]` block whose column `i` is column `cols[i]` of `W`, so the fused
    AdamW kernel runs on whole tensors and the device gathers and scatters whole column sets in one kernel.

    Built lazily: until the first step that offloads the parameter the part is *pending*: it holds no buffer, and
    stands for master = the weight's columns `cols` (nothing has updated them), zero moments. So columns a first
    selection hands to the device never get host buffers. The staging buffers are views into the optimizer's one
    pinned arena (link.StagingArena), pointed here by `ownership.carve_staging`.

    With device accumulation (`n_staging` 0, `device_sums`) no gradient crosses per step: the accumulators are fp32
    views in the arena too, where the device's interval sums land once per interval (device_accumulation.py).
    """

    cols: torch.Tensor            # [n_host] int64, ascending: which columns of W these are
    rows: int                     # out
    dtype: torch.dtype            # the model dtype: that of the staging buffers
    counts: list[int]             # gradients summed in each accumulator (one, two with overlap_step) since its update
    n_staging: int = 1            # gradient staging buffers: two on CUDA with overlap_step; 0: device accumulation
    step: int = 0                 # host AdamW updates applied to this parameter
    staged: bool = False          # param_staging holds an update not yet uploaded
    master: torch.Tensor | None = None      # [out, n_host] fp32 (None: pending)
    exp_avg: torch.Tensor | None = None     # [out, n_host] fp32
    exp_avg_sq: torch.Tensor | None = None  # [out, n_host] fp32
    accumulators: list[torch.Tensor] = field(default_factory=list)  # per count: [out, n_host] fp32 gradient sums
    grad_staging: list[torch.Tensor] = field(default_factory=list)  # n_staging [out, n_host] landing buffers (views)
    param_staging: torch.Tensor | None = None  # [out, n_host] source of host->device parameter copies (a view)
    # whole rows (layout.py): `cols` is this host's whole block and `shadow` the positions in it of the selected
    # columns, which the device holds (stale here, never read); compact: `cols` are the unselected ones, no shadows
    whole_rows: bool = False
    shadow: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))

    @property
    def n_host(self) -> int:
        return self.cols.numel()

    @property
    def n_offloaded(self) -> int:
        """Columns whose gradient this host sums and whose values it updates: the part's columns less its shadows."""
        return self.n_host - self.shadow.numel()

    @property
    def offloaded_elements(self) -> int:
        """Elements whose gradient crosses a link each step and whose values come back: rows x n_offloaded."""
        return self.rows * self.n_offloaded

    @property
    def offloaded_cols(self) -> torch.Tensor:
        """The columns whose gradient this host sums and whose values it updates (ascending): `cols` less shadows."""
        return self.offloaded(self.cols.unsqueeze(0)).squeeze(0)

    def offloaded(self, t: torch.Tensor) -> torch.Tensor:
        """`t` ([out, n_host]) without the shadow columns: itself when there are none."""
        if self.shadow.numel() == 0:
            return t
        return take_columns(t, offloaded_positions(self.n_host, self.shadow).to(t.device))

    @property
    def built(self) -> bool:
        return self.master is not None

    @property
    def device_sums(self) -> bool:
        """Device accumulation: the accumulators are landing views in the arena, not buffers of their own."""
        return self.n_staging == 0

    @classmethod
    def pending(cls, rows: int, cols: torch.Tensor, dtype: torch.dtype, n_accumulators: int,
                n_staging: int = 1, whole_rows: bool = False, shadow: torch.Tensor | None = None) -> HostColumns:
        """No buffers yet: the host owns `cols` (every column, or this rank's block of them with data parallelism),
        whose values are the weight's; `shadow`: the positions in `cols` of the selected ones (whole rows)."""
        return cls(cols=cols, rows=rows, dtype=dtype, counts=[0] * n_accumulators, n_staging=n_staging,
                   whole_rows=whole_rows, shadow=_positions(shadow))

    @classmethod
    def create(cls, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, cols: torch.Tensor,
               dtype: torch.dtype, n_accumulators: int, n_staging: int = 1, step: int = 0,
               whole_rows: bool = False, shadow: torch.Tensor | None = None) -> HostColumns:
        """A built part from its fp32 state; zero accumulators; staging comes from carve_staging."""
        part = cls(cols=cols, rows=master.shape[0], dtype=dtype, counts=[0] * n_accumulators, n_staging=n_staging,
                   step=step, master=master, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, whole_rows=whole_rows,
                   shadow=_positions(shadow))
        if not part.device_sums:  # device accumulation: they are the arena's landing views (carve_staging)
            part.accumulators = [torch.zeros(master.shape) for _ in range(n_accumulators)]
        return part

    def build_(self) -> None:
        """Pending -> built from `param_staging`, which the caller filled with the weight's columns `cols`."""
        shape = (self.rows, self.n_host)
        self.master = torch.empty(shape, dtype=torch.float32).copy_(self.param_staging)  # exact upcast, no temporary
        self.exp_avg, self.exp_avg_sq = torch.zeros(shape), torch.zeros(shape)
        if not self.device_sums:  # device accumulation: the arena's landing views, carved before the build
            self.accumulators = [torch.zeros(shape) for _ in self.counts]

    def staging_layout(self) -> list[tuple[tuple[int, int], torch.dtype]]:
        """The views this part takes in the arena: its gradient staging buffers (device accumulation: its fp32
        accumulators, one per count), then its parameter staging."""
        shape = (self.rows, self.n_host)
        landing = [(shape, torch.float32)] * len(self.counts) if self.device_sums else []
        return [(shape, self.dtype)] * self.n_staging + landing + [(shape, self.dtype)]

    def take_views(self, views: Iterator[torch.Tensor]) -> None:
        """Point the staging buffers at the next views of the arena, in staging_layout's order."""
        self.grad_staging = [next(views) for _ in range(self.n_staging)]
        if self.device_sums:
            self.accumulators = [next(views) for _ in self.counts]
        self.param_staging = next(views)

    def drop_views(self) -> None:
        """Let go of the arena's views (before it is re-carved, so an outgrown buffer can be freed first)."""
        self.grad_staging, self.param_staging = [], None
        if self.device_sums:
            self.accumulators = []

    @property
    def state_bytes(self) -> int:
        """fp32 master, moments and accumulators (0 while pending); staging is the arena's (device accumulation: the
        accumulators too)."""
        if not self.built:
            return 0
        own = [] if self.device_sums else self.accumulators
        return sum(t.numel() * t.element_size() for t in (self.master, self.exp_avg, self.exp_avg_sq, *own))


def _positions(shadow: torch.Tensor | None) -> torch.Tensor:
    return torch.empty(0, dtype=torch.long) if shadow is None else shadow


def grad_staging_count(overlap_step: bool, cuda: bool) -> int:
    """Gradient staging buffers per host part with host accumulation: two on CUDA with overlap_step, so that step
    t's copy lands in one while the worker still reads step t-1's from the other; one otherwise (inline, or the
    CPU device, whose copy is made by the accumulation itself). The one place this rule is written."""
    return 2 if overlap_step and cuda else 1


def host_bytes(host_elements: Sequence[int], model_bytes: int, *, overlap_step: bool, cuda: bool,
               arena_elements: Sequence[int] | None = None, accumulate_on: str = "host") -> int:
    """Host bytes ZenFlowAdamW holds (= its `host_state_bytes`), from per-parameter element counts.

    host_elements: per built column param, out x (host-owned columns of this rank); a param not built yet has none.
    arena_elements: per column param, the element counts of the largest staging layout so far (the arena only
    grows): host_elements by default; the rank's whole column block (every column in one process) when warm-up
    built full-width parts first. model_bytes: the model dtype's element size.

        4 * (3 + n_acc) * sum(host_elements)                  master, exp_avg, exp_avg_sq, accumulators (pageable)
      + (n_grad + 1) * sum(aligned(model_bytes * e))          the staging arena (pinned on CUDA), ALIGN per view

    n_acc = 2 with overlap_step else 1; n_grad = grad_staging_count(...). docs/host-worker.md.
    accumulate_on="device": no gradient staging; the accumulators are fp32 views in the arena instead:

        4 * 3 * sum(host_elements) + sum(n_acc * aligned(4 * e) + aligned(model_bytes * e))
    """
    n_acc = 2 if overlap_step else 1
    n_grad = grad_staging_count(overlap_step, cuda)
    staged = host_elements if arena_elements is None else arena_elements
    if accumulate_on == "device":
        return 4 * 3 * sum(host_elements) + sum(n_acc * aligned(4 * e) + aligned(model_bytes * e) for e in staged)
    return 4 * (3 + n_acc) * sum(host_elements) + (n_grad + 1) * sum(aligned(model_bytes * e) for e in staged)


@dataclass
class GradCopy:
    """One parameter's unselected gradient columns on their way into a host staging buffer (device accumulation:
    its interval's fp32 sum on its way into a landing accumulator: copied at once on the CPU device, `done` on CUDA).

    CUDA: the training thread has already started the copy (`done` is its event) and holds no device tensor, so
    the step's gradient can be freed at once. CPU device: the copy is CPU work, done by whoever runs the
    accumulation (the worker's core in overlap mode, as a copy engine would), so `grad` is held until then.
    """

    part: HostColumns
    staging: torch.Tensor
    grad: torch.Tensor | None = None      # [out, in] view of the gradient (CPU device only)
    columns: torch.Tensor | None = None   # host-owned columns to gather (CPU device only)
    done: torch.cuda.Event | None = None  # CUDA: the copy's event

    def land(self, link: Link) -> torch.Tensor:
        """Return the staging buffer once it holds the gradient columns."""
        if self.done is not None:
            with link.observers.blocking("copy_d2h"):
                self.done.synchronize()  # CUDA sync point: wait for this parameter's copy only
        elif self.grad is not None:
            link.gather_to_host(self.grad, self.columns, self.staging)
            self.grad = None  # the gradient is no longer needed: let it go now
        return self.staging


def accumulate_(link: Link, copies: list[GradCopy], slot: int, clip_coef: torch.Tensor | None = None,
                report_mass: bool = False) -> list[float] | None:
    """Add this step's unselected gradient columns into the fp32 accumulators of `slot`.

    Runs inline or on the worker; the caller counted the bytes. Parameters are taken in order, so on CUDA the copy
    of the next one proceeds while this one is added (copy engine and CPU work at once). `clip_coef` is the step's
    global clipping coefficient. `report_mass`: return, per copy, the RMS per element of the accumulated sum after
    this step (what the "auto" update interval compares); computed here, off the training thread in overlap mode.
    """
    masses = [] if report_mass else None
    for copy in copies:
        part, staging = copy.part, copy.land(link)
        with link.observers.blocking("host_accumulate"):  # host work the step waits for (inline only)
            acc = part.accumulators[slot]
            # first of the interval: a copy (no zero-fill, no add); clipped inside the same pass over memory
            accumulate_into_(acc, staging, clip_coef, first=part.counts[slot] == 0)
            if masses is not None:  # the sum of the columns this host updates (whole rows: not the shadows)
                summed = part.offloaded(acc)
                masses.append(float(torch.linalg.vector_norm(summed)) / max(1, summed.numel()) ** 0.5)
        part.counts[slot] += 1
    return masses


# Elements per block of accumulate_into_. Every torch call hands the GIL back, and a training thread running Python
# (the forward pass) keeps it for up to a switch interval, so blocks are few and large; but the fp32 scratch should
# stay in the cache. Adding 40.6M bf16 elements on one Xeon core, as fractions of the triad bound, alone / beside a
# Python-busy thread: 256K blocks 0.90 / 0.61, 1M 0.84 / 0.70, 2M 0.88 / 0.81, 4M 0.81 / 0.77, 8M 0.71 / 0.70.
ACCUMULATE_BLOCK = 1 << 21


def accumulate_into_(acc: torch.Tensor, src: torch.Tensor, clip: torch.Tensor | float | None = None,
                     first: bool = False, block_elements: int = ACCUMULATE_BLOCK) -> None:
    """acc (fp32) = clip·src (`first`) or acc += clip·src, every element rounded once, in fp32, in one pass over memory.

    The clipped gradient is formed in fp32 (src upcast exactly, then scaled), as the device part forms its own
    (device.device_update_), never rounded back to src's dtype; the add with its factor is torch's `add_(x, alpha=)`,
    a fused multiply-add: acc + clip·src with one rounding, which is also what the first gradient gets (acc = 0).
    Narrower src is upcast a cache-sized block of rows at a time, so the pass reads src once and reads + writes acc
    once (10 bytes per bf16 element): torch's one-call mixed-dtype add runs ~3x slower than the blocks.
    docs/host-worker.md, "The host path at the bandwidth bound", has the rates."""
    scale = 1.0 if clip is None else float(clip)  # a Python number: no 0-dim tensor to unwrap per block
    if scale == 1.0 and (first or src.dtype == acc.dtype):
        # nothing to scale (torch's clamped coefficient when the norm is within bounds): one kernel, exact
        acc.copy_(src) if first else acc.add_(src)
        return
    if src.dtype == acc.dtype:  # nothing to upcast: one kernel
        torch.mul(src, scale, out=acc) if first else acc.add_(src, alpha=scale)
        return
    width = acc[0].numel() if acc.dim() > 1 else 1
    rows = max(1, block_elements // max(1, width))
    wide = _scratch(rows * width, acc.dtype).view(rows, *acc.shape[1:])
    for start in range(0, acc.shape[0], rows):
        n = min(rows, acc.shape[0] - start)
        if first:
            acc[start:start + n].copy_(src[start:start + n]).mul_(scale)  # the second pass reads the cache
        else:
            acc[start:start + n].add_(wide[:n].copy_(src[start:start + n]), alpha=scale)  # exact upcast, then FMA


_scratches = threading.local()  # per thread: accumulate_into_ runs on the worker and, on the CPU device, the trainer


def _scratch(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat buffer of at least `numel` elements, kept per thread and reused: a fresh one per call (8 MB at the
    default block) was mapped and page-faulted again in some allocator states, 200-700 faults per 14.7M-element
    accumulation and up to 1.5x its time. At most one block (4·ACCUMULATE_BLOCK bytes) per thread that adds."""
    held = getattr(_scratches, "buffer", None)
    if held is None or held.dtype != dtype or held.numel() < numel:
        held = _scratches.buffer = torch.empty(numel, dtype=dtype)
    return held[:numel]


def add_upcast_(acc: torch.Tensor, src: torch.Tensor, chunk_elements: int = ACCUMULATE_BLOCK) -> None:
    """acc (fp32) += src (any float dtype): accumulate_into_ without clipping."""
    accumulate_into_(acc, src, block_elements=chunk_elements)


def host_adamw_(groups: list[tuple[list[HostColumns], AdamWHyper]], slot: int) -> None:
    """AdamW on the host-owned rows with the mean accumulated gradient; stage the result for upload.

    Runs inline (sync) or on the worker thread (overlap); touches only the host buffers and the given slot.
    A parameter that received no gradient since its last update is left alone (as torch.optim does).
    """
    for parts, hp in groups:
        parts = [p for p in parts if p.counts[slot] > 0]  # a rank's empty block still counts the update
        for p in parts:
            p.step += 1
        for count in sorted({p.counts[slot] for p in parts}):  # the mean's divisor: one kernel call per count
            same = [p for p in parts if p.counts[slot] == count]
            adamw_([p.master for p in same], [p.accumulators[slot] for p in same], [p.exp_avg for p in same],
                   [p.exp_avg_sq for p in same], [p.step for p in same], hp, divisor=count)
        for p in parts:
            p.param_staging.copy_(p.master)  # fp32 -> model dtype, ready to upload
            p.counts[slot] = 0  # the next accumulation overwrites the buffer
            p.staged = True
