"""The device<->host link: real copies into distinct buffers, counted.

CUDA: copies run on a side stream into pinned host buffers, ordered by events, so the compute stream keeps going.
CPU "device" (cpu-scale): the same calls are plain synchronous copies between distinct tensors.
"""

from __future__ import annotations

import torch

from zenflow.hooks import Observers


class Link:
    def __init__(self, device: torch.device, observers: Observers) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.observers = observers

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host buffer that takes part in transfers: pinned when the device is a GPU."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.cuda)

    def to_host(self, src: torch.Tensor, dst: torch.Tensor, kind: str) -> torch.cuda.Event | None:
        """Start a device->host copy; the returned event (CUDA) must be waited on before `dst` is read."""
        self.observers.transfer("d2h", kind, src.numel() * src.element_size())
        if not self.cuda:
            with self.observers.blocking("copy_d2h"):
                dst.copy_(src)
            return None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # src was produced on the compute stream
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            src.record_stream(self.stream)
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def to_device(self, src: torch.Tensor, dst: torch.Tensor, kind: str) -> torch.cuda.Event | None:
        """Host->device copy; later work on the compute stream is ordered after it (no host wait)."""
        self.observers.transfer("h2d", kind, src.numel() * src.element_size())
        if not self.cuda:
            with self.observers.blocking("copy_h2d"):
                dst.copy_(src)
            return None
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        torch.cuda.current_stream(self.device).wait_event(done)
        return done

    def gather_to_host(self, src: torch.Tensor, columns: torch.Tensor, dst: torch.Tensor, kind: str,
                       count: bool = True, ready: torch.cuda.Event | None = None) -> None:
        """`dst[:] = src[:, columns]` with `src` on the device and `dst` on the host; returns when `dst` is ready.

        CUDA: gather and copy on the side stream, after `ready` (an event recorded where `src` was produced; the
        caller's current stream if None), then a host wait (sync point). CPU device: the gather writes straight
        into the distinct host buffer, which is the copy. `count=False`: the caller counted the bytes already
        (background jobs are counted when submitted, so each step's bytes are deterministic).
        """
        if count:
            self.observers.transfer("d2h", kind, dst.numel() * src.element_size())
        if not self.cuda:
            with self.observers.blocking("copy_d2h"):
                if columns.numel() == src.shape[1]:  # every column (warm-up, ZeRO-Offload): a plain copy
                    dst.copy_(src)
                else:
                    torch.index_select(src, 1, columns, out=dst)
            return
        producer = torch.cuda.current_stream(self.device)  # read before switching streams
        with torch.cuda.stream(self.stream):
            if ready is not None:
                self.stream.wait_event(ready)
            else:
                self.stream.wait_stream(producer)
            dst.copy_(src.index_select(1, columns), non_blocking=True)
            src.record_stream(self.stream)  # src may be freed by its owner while this stream still reads it
        with self.observers.blocking("copy_d2h"):
            self.stream.synchronize()  # the host reads dst next

    def scatter_to_device(self, src: torch.Tensor, columns: torch.Tensor, dst: torch.Tensor,
                          kind: str) -> torch.cuda.Event | None:
        """`dst[:, columns] = src` with `src` on the host; ordered before later work on the compute stream.
        CUDA: returns the event after which `src` may be overwritten."""
        if not self.cuda:
            self.observers.transfer("h2d", kind, src.numel() * src.element_size())
            with self.observers.blocking("copy_h2d"):
                if columns.numel() == dst.shape[1]:  # columns are ascending and complete: identity
                    dst.copy_(src)
                else:
                    dst.index_copy_(1, columns, src)
            return None
        landing = torch.empty(src.shape, dtype=src.dtype, device=self.device)
        done = self.to_device(src, landing, kind)
        dst.index_copy_(1, columns, landing)
        return done

    def wait(self, event: torch.cuda.Event | None) -> None:
        """Block the host until a copy finished (CUDA sync point; a no-op on the CPU device)."""
        if event is not None:
            with self.observers.blocking("copy_d2h"):
                event.synchronize()
