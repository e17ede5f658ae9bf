"""The staging arena on CUDA is page-locked at its exact size with cudaHostRegister (torch's pinned allocator would
round it up to a power of two: 34 -> 64 GiB at Llama-2-7B), and unregistered before it is replaced or dropped.
The CUDA runtime is faked here, so the CPU proves the order of the calls; a GPU host runs the real ones."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch

from zenflow.link import ALIGN, StagingArena


class FakeCudart:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []
        self.registered: dict[int, int] = {}

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.calls.append(("register", ptr, size))
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr, self.registered.pop(ptr)))
        return 0


@pytest.fixture
def cudart(monkeypatch) -> FakeCudart:
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch.cuda, "check_error", lambda status: None if status == 0 else 1 / 0)
    return fake


def test_the_arena_is_registered_at_its_exact_size_and_unregistered_before_it_grows(cudart):
    arena = StagingArena(SimpleNamespace(cuda=True))
    views = arena.carve([((3, 5), torch.bfloat16), ((7,), torch.float32)])
    exact = 2 * ALIGN  # 30 B and 28 B, each view on its own cache line
    assert cudart.calls == [("register", arena.buffer.data_ptr(), exact)]
    assert all(v.untyped_storage().data_ptr() == arena.buffer.data_ptr() for v in views)
    arena.carve([((3, 5), torch.bfloat16), ((7,), torch.float32)])  # same layout: nothing new
    assert len(cudart.calls) == 1
    first = arena.buffer.data_ptr()
    arena.carve([((100,), torch.float32)])  # grows: the old registration goes first
    assert [c[0] for c in cudart.calls] == ["register", "unregister", "register"]
    assert cudart.calls[1] == ("unregister", first, exact)
    assert cudart.calls[2][2] == 400 + (-400 % ALIGN)


def test_a_dropped_arena_unregisters_its_buffer(cudart):
    arena = StagingArena(SimpleNamespace(cuda=True))
    arena.carve([((64,), torch.uint8)])
    del arena
    gc.collect()
    assert [c[0] for c in cudart.calls] == ["register", "unregister"] and not cudart.registered


def test_on_the_cpu_device_nothing_is_registered(cudart):
    """Negative control of the two above: a CPU link pins nothing, so the fake sees no call."""
    arena = StagingArena(SimpleNamespace(cuda=False))
    arena.carve([((64,), torch.uint8)])
    del arena
    gc.collect()
    assert cudart.calls == []
