"""The device<->host link: real copies into distinct buffers, counted.

CUDA: two side streams, one per direction (PCIe is full duplex: the two copy engines run at once), into and out of
pinned host buffers, ordered by events so the compute stream keeps going. Every device tensor a side stream writes
is allocated on that side stream, and `record_stream` marks every device tensor a stream other than its allocator's
reads, so the caching allocator never hands out a block another stream still uses (docs/host-worker.md).
CPU "device" (cpu-scale): the same calls are plain synchronous copies between distinct tensors.
"""

from __future__ import annotations

import math
import weakref

import torch

from zenflow.hooks import Observers
from zenflow.layout import put_columns, take_columns

ALIGN = 64  # bytes: every staging view starts on a cache line (vector loads of the host kernels, copy bursts)


def aligned(nbytes: int) -> int:
    """`nbytes` rounded up to a multiple of ALIGN."""
    return -(-nbytes // ALIGN) * ALIGN


class Link:
    def __init__(self, device: torch.device, observers: Observers) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.d2h_stream = torch.cuda.Stream(device) if self.cuda else None
        self.h2d_stream = torch.cuda.Stream(device) if self.cuda else None
        self.observers = observers

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host buffer that takes part in transfers: pinned when the device is a GPU."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.cuda)

    def compute_event(self) -> torch.cuda.Event | None:
        """CUDA: an event on the compute stream now (what later copies must wait for); None on the CPU device."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def to_host(self, src: torch.Tensor, dst: torch.Tensor, kind: str,
                counted: int | None = None) -> torch.cuda.Event | None:
        """Start a device->host copy; the returned event (CUDA) must be waited on before `dst` is read. `counted`:
        the bytes a link carries, when not all of src's (whole rows: not the shadows)."""
        self.observers.transfer("d2h", kind, src.numel() * src.element_size() if counted is None else counted)
        if not self.cuda:
            with self.observers.blocking("copy_d2h"):
                dst.copy_(src)
            return None
        self.d2h_stream.wait_stream(torch.cuda.current_stream(self.device))  # src was produced on compute
        with torch.cuda.stream(self.d2h_stream):
            dst.copy_(src, non_blocking=True)
            src.record_stream(self.d2h_stream)
            done = torch.cuda.Event()
            done.record(self.d2h_stream)
        return done

    def to_device(self, src: torch.Tensor, dst: torch.Tensor, kind: str) -> torch.cuda.Event | None:
        """Host->device copy into `dst` (any device tensor); later work on the compute stream is ordered after it
        (no host wait). CUDA: `dst` may have been allocated or used on the compute stream, so the copy first waits
        for the compute stream's queued work: use it off the hot path (reselection)."""
        self.observers.transfer("h2d", kind, src.numel() * src.element_size())
        if not self.cuda:
            with self.observers.blocking("copy_h2d"):
                dst.copy_(src)
            return None
        return self._copy_after_compute(src, dst)

    def _copy_after_compute(self, src: torch.Tensor, dst: torch.Tensor) -> torch.cuda.Event:
        """CUDA: copy into an existing device tensor on the h2d stream once the compute stream's queued reads and
        writes of it are done; later compute-stream work waits for the copy (no host wait)."""
        compute = torch.cuda.current_stream(self.device)
        self.h2d_stream.wait_stream(compute)
        with torch.cuda.stream(self.h2d_stream):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.h2d_stream)
        with self.observers.device_wait("copy_h2d", lambda: _timing_event(compute)):  # exposed upload: I/O
            compute.wait_event(done)
        return done

    def gather_to_host(self, src: torch.Tensor, columns: torch.Tensor | None,
                       dst: torch.Tensor) -> torch.cuda.Event | None:
        """`dst[:] = src[:, columns]` with `src` on the device and `dst` on the host. Bytes are counted by the
        caller (background copies are counted when submitted, so each step's bytes are deterministic).

        CUDA: the gather runs on the caller's (compute) stream, where `src` was produced: a fast kernel, after which
        the gradient itself is no longer needed, so `zero_grad()` frees it at once. Only the gathered block, one
        set of the unselected columns, waits for the link: it is copied on the d2h stream and `record_stream` keeps
        its memory until the copy is done. Returns the copy's event (wait on it before reading `dst`); no host wait
        here. Every column (warm-up, ZeRO-Offload; `columns` None: a device accumulator): no gather, the tensor is
        copied as it is. CPU device: the gather writes straight into the distinct host buffer, which is the copy;
        returns None.
        """
        every_column = columns is None or columns.numel() == src.shape[1]  # a plain copy, no gather
        if not self.cuda:
            with self.observers.blocking("copy_d2h"):
                if every_column:
                    dst.copy_(src)
                else:  # whole rows of a rank's block: a slice copy
                    take_columns(src, columns, out=dst)
            return None
        compute = torch.cuda.current_stream(self.device)
        block = src if every_column else src.index_select(1, columns)
        gathered = torch.cuda.Event()
        gathered.record(compute)
        with torch.cuda.stream(self.d2h_stream):
            self.d2h_stream.wait_event(gathered)
            dst.copy_(block, non_blocking=True)
            block.record_stream(self.d2h_stream)  # its owner drops it now; the allocator waits for this copy
            done = torch.cuda.Event()
            done.record(self.d2h_stream)
        return done

    def scatter_to_device(self, src: torch.Tensor, columns: torch.Tensor, dst: torch.Tensor, kind: str,
                          counted: int | None = None) -> torch.cuda.Event | None:
        """`dst[:, columns] = src` with `src` on the host; ordered before later work on the compute stream.
        `counted`: the bytes a link carries, when not all of src's (whole rows: not the shadows).
        CUDA: returns the event after which `src` may be overwritten."""
        self.observers.transfer("h2d", kind, src.numel() * src.element_size() if counted is None else counted)
        every_column = columns.numel() == dst.shape[1]  # columns are ascending and complete: identity
        if not self.cuda:
            with self.observers.blocking("copy_h2d"):
                if every_column:
                    dst.copy_(src)
                else:
                    put_columns(dst, columns, src)
            return None
        if every_column and dst.is_contiguous():
            return self._copy_after_compute(src, dst)  # straight into the weight, no landing buffer
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.h2d_stream):
            # allocated on the stream that writes it: its block is never one the compute stream
            # may still be using, and is not reused before the compute stream has read it (record_stream below)
            landing = torch.empty(src.shape, dtype=src.dtype, device=self.device)
            landing.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.h2d_stream)
        with self.observers.device_wait("copy_h2d", lambda: _timing_event(compute)):  # exposed upload: I/O
            compute.wait_event(done)
        dst.index_copy_(1, columns, landing)
        landing.record_stream(compute)
        return done

    def compute_waits_for(self, event: torch.cuda.Event | None) -> None:
        """CUDA: later work on the compute stream waits until a d2h copy has read its source (which that work is
        about to overwrite); no host wait, the exposed part is booked as copy_d2h. None: nothing to wait for."""
        if event is None:
            return
        compute = torch.cuda.current_stream(self.device)
        with self.observers.device_wait("copy_d2h", lambda: _timing_event(compute)):
            compute.wait_event(event)

    def wait(self, event: torch.cuda.Event | None) -> None:
        """Block the host until a copy finished (CUDA sync point; a no-op on the CPU device)."""
        if event is not None:
            with self.observers.blocking("copy_d2h"):
                event.synchronize()

    def synchronize(self) -> None:
        """Every copy on this link's streams has landed (CUDA: the whole device; a no-op on the CPU device, whose
        copies are done when they return)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)


def _timing_event(stream: torch.cuda.Stream) -> torch.cuda.Event:
    """A timing event recorded on `stream` now (the timeline reads it once the step's events completed)."""
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    return event


class StagingArena:
    """Every staging buffer of the host part as a view into one flat host allocation (page-locked on CUDA).

    One allocation of the exact sum of the views (each rounded up to ALIGN bytes), instead of one pinned allocation
    per buffer, which torch's CachingHostAllocator rounds up to a power of two each. The buffer is replaced only when
    a layout needs more than it holds, by one of exactly that size: its capacity is the largest layout so far.
    On CUDA the buffer is a plain host allocation page-locked with cudaHostRegister (`_Registration`), not torch's
    pinned allocator, which would round this one allocation up to a power of two too (34 GiB -> 64 GiB at 7B).
    """

    def __init__(self, link: Link) -> None:
        self.link = link
        self.buffer: torch.Tensor | None = None
        self.layout: list[tuple[tuple[int, ...], torch.dtype]] = []
        self._pinned: list[_Registration] = []  # the buffer's page-locking on CUDA (at most one)
        weakref.finalize(self, _release, self._pinned, False)  # not the arena itself: it must stay collectable

    @property
    def capacity(self) -> int:
        """Bytes allocated (what host memory this arena holds)."""
        return 0 if self.buffer is None else self.buffer.numel()

    def carve(self, layout: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
        """Views of the given (shape, dtype)s, in order, each starting on an ALIGN boundary; the same layout gives
        the same places. Grows the buffer when the layout needs more: the caller drops the old views first, so
        that the old buffer is freed before the new one is allocated, and makes sure nothing still uses them."""
        sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in layout]
        need = sum(aligned(n) for n in sizes)
        if self.buffer is None or need > self.capacity:
            _release(self._pinned)  # the caller has settled every copy that used the old buffer
            self.buffer = None
            self.buffer = torch.empty(need, dtype=torch.uint8)
        self.pin()
        self.layout = list(layout)
        views, offset = [], 0
        for (shape, dtype), n in zip(layout, sizes):
            views.append(self.buffer[offset:offset + n].view(dtype).view(shape))
            offset += aligned(n)
        return views


    def pin(self) -> None:
        """Page-lock the buffer on CUDA if it is not: a new one, or one unpinned at close() and used again."""
        if self.link.cuda and self.buffer is not None and not self._pinned:
            self._pinned.append(_Registration(self.buffer))

    def unpin(self) -> None:
        """Give the page-locking back now (close(): every copy is settled), not when the optimizer is collected,
        which a reference held anywhere may delay for the rest of the process. The buffer stays;
        the next step pins it again."""
        _release(self._pinned)


class _Registration:
    """A host buffer page-locked with cudaHostRegister for as long as it is registered: copies from and to it are
    truly asynchronous (DMA), as from torch's pinned memory, at its exact size. The arena unregisters it before
    replacing or dropping the buffer; every copy that used it has been waited for by then (ZenFlowAdamW.settle,
    close)."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self.ptr = buffer.data_ptr()
        self.buffer = buffer  # the memory must outlive the registration
        status = torch.cuda.cudart().cudaHostRegister(self.ptr, buffer.numel() * buffer.element_size(), 0)
        torch.cuda.check_error(status)


def _release(pinned: list[_Registration], strict: bool = True) -> None:
    """Unregister (and let go of) the arena's registered buffer, if any; at teardown errors are not raised."""
    while pinned:
        status = torch.cuda.cudart().cudaHostUnregister(pinned.pop().ptr)
        if strict:
            torch.cuda.check_error(status)
