"""The optimizer peers (engines/optimizer_peers.py): each says exactly why it cannot run where it
cannot, and its memory row is the arithmetic its docstring states."""

from __future__ import annotations

import importlib.util

import pytest

from zenflow.harness.engines import memory, registry
from zenflow.harness.engines import optimizer_peers as op
from zenflow.harness.memory_plan import ModelShape


def test_megatron_and_bitsandbytes_say_why_not_on_a_cpu_device() -> None:
    for fraction in op.OFFLOAD_FRACTIONS:
        reason = registry.ENGINE_SPECS[f"megatron-hybrid-{fraction}"].unavailable("cpu")
        assert reason and "CUDA parameters only" in reason and "param.is_cuda" in reason
    assert "CUDA kernels" in registry.ENGINE_SPECS["bnb-adamw8bit"].unavailable("cpu")


def test_on_a_gpu_host_a_missing_package_is_named(monkeypatch) -> None:
    """The negative control of the CPU reasons: with CUDA the reason is the package, not the device."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.split(".")[0] in ("megatron", "bitsandbytes", "torchao")
                        else real(name, *a))
    assert op.MegatronHybridEngine.unavailable("megatron-hybrid-0.5", cuda=True).startswith("megatron-core not")
    assert op.BitsAndBytesAdamW8bitEngine.unavailable("bnb-adamw8bit", cuda=True).startswith("bitsandbytes not")
    for cuda in (False, True):  # torchao's AdamW8bit runs on the CPU too: only a missing package stops it
        assert op.TorchAOAdamW8bitEngine.unavailable("torchao-adamw8bit", cuda=cuda).startswith("torchao not")


def test_each_fraction_is_its_own_class_and_row() -> None:
    classes = {registry.ENGINE_SPECS[f"megatron-hybrid-{f}"].engine_class for f in op.OFFLOAD_FRACTIONS}
    assert {c.offload_fraction for c in classes} == set(op.OFFLOAD_FRACTIONS)
    assert all(registry.ENGINE_SPECS[f"megatron-hybrid-{f}"].host_share == f for f in op.OFFLOAD_FRACTIONS)
    assert all(c.stall_includes_io for c in classes)  # its copies and host AdamW are inside one step() call


@pytest.mark.parametrize("cuda", [False, True])
def test_memory_rows(cuda: bool) -> None:
    """Offload fraction 0 would be no-offload-fp32's device footprint; 1.0 moves all 12 B of state to the host;
    8-bit AdamW adds 2 B per parameter (and its block scales) to no-offload's training footprint."""
    shape = ModelShape.from_workload({"model": "cpu-scale"})
    m = memory.MemoryInputs(shape=shape, b=2, cuda=cuda, block={}, acts=1000, base=0)
    fp32 = registry.ENGINE_SPECS["no-offload-fp32"].footprint(m)
    assert registry.ENGINE_SPECS["no-offload-fp32"].memory is memory.memory_device_fp32
    spec = registry.ENGINE_SPECS["megatron-hybrid-0.5"]
    zero = registry.EngineSpec("x", spec.engine_class, "other", "peer", memory=spec.memory, host_share=0.0).footprint(m)
    assert zero.device == fp32.device and zero.pinned == 0 and zero.pageable == 0
    half, whole = (registry.ENGINE_SPECS[f"megatron-hybrid-{f}"].footprint(m) for f in (0.5, 1.0))
    assert spec.memory is memory.memory_megatron_hybrid
    assert half.device != fp32.device and whole.device == m.trained
    assert whole.pageable == 8 * shape.params and whole.pinned >= 8 * shape.params
    eight = registry.ENGINE_SPECS["torchao-adamw8bit"].footprint(m)
    assert registry.ENGINE_SPECS["torchao-adamw8bit"].memory is memory.memory_device_8bit
    assert eight.device - m.trained == 2 * shape.params + 8 * shape.params // 256
