"""The memory plan's multi-GPU rows (zenflow/harness/scale_plan.py): Llama-2-13B and 70B on hosts of 1, 2, 4 and 8
GPUs of 80 GB. What must hold, from the footprints' construction: FSDP2 divides ZenFlow's device footprint by the
ranks (down to the layers it gathers) where data parallelism does not; the ranks' host state adds up to about one
process's whatever W; and the verdicts that follow (which engine fits where) are the ones the docs quote."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from zenflow.harness import scale_plan as sp
from zenflow.harness.memory_plan import GiB

BASE = 2 * GiB


def device(engine: str, model: str, world: int, block: dict = sp.OVERLAP) -> float:
    return sp.cell(engine, block, sp.MODELS[model], world, BASE).device


def test_fsdp2_divides_zenflows_device_footprint_and_data_parallelism_does_not():
    for model in sp.MODELS:
        sharded = [device("ref-zenflow-fsdp2", model, w) for w in sp.GPUS]
        replicated = [device("ref-zenflow", model, w) for w in sp.GPUS]
        assert all(a > b for a, b in zip(sharded, sharded[1:]))  # falls with every doubling
        assert sharded[1] < 0.6 * sharded[0] and sharded[-1] < 0.25 * sharded[0]
        assert len(set(replicated)) == 1  # the whole model on every GPU


def test_the_ranks_host_state_adds_up_to_one_process():
    for engine in ("ref-zenflow", "ref-zenflow-fsdp2", "fsdp2-offload", "ds-zero-offload"):
        one = sp.cell(engine, sp.OVERLAP, sp.MODELS["Llama-2-13B"], 1, BASE).host - BASE
        eight = sp.cell(engine, sp.OVERLAP, sp.MODELS["Llama-2-13B"], 8, BASE).host - 8 * BASE
        assert eight == pytest.approx(one, rel=0.02), engine


@pytest.mark.parametrize("model,world,engine,block,fits", [
    ("Llama-2-13B", 1, "ref-zenflow", sp.OVERLAP, False),        # overlap's device buffers: over one GPU
    ("Llama-2-13B", 1, "ref-zenflow", sp.SYNC, True),
    ("Llama-2-13B", 2, "ref-zenflow", sp.OVERLAP, False),        # replicated: more GPUs do not help
    ("Llama-2-13B", 2, "ref-zenflow-fsdp2", sp.OVERLAP, True),   # sharded: two GPUs do
    ("Llama-2-70B", 8, "ref-zenflow-fsdp2", sp.SYNC, True),
    ("Llama-2-70B", 4, "ref-zenflow-fsdp2", sp.SYNC, False),
    ("Llama-2-70B", 8, "ref-zenflow-fsdp2", sp.OVERLAP, False),
    ("Llama-2-70B", 8, "fsdp2-offload", sp.OVERLAP, True),
    ("Llama-2-70B", 8, "ds-zero-offload", sp.OVERLAP, False),    # ZeRO-2 keeps the whole model on every GPU
])
def test_which_engines_fit_where(model, world, engine, block, fits):
    assert (sp.cell(engine, block, sp.MODELS[model], world, BASE).why is None) == fits


def test_the_sharding_is_what_makes_70b_fit_negative_control():
    """ref-zenflow-fsdp2's footprint read as one rank's of a single-GPU host: 70B on 8 GPUs no longer fits."""
    assert sp.cell("ref-zenflow-fsdp2", sp.SYNC, sp.MODELS["Llama-2-70B"], 1, BASE).why is not None


def test_the_table_has_a_row_per_model_and_host_and_a_column_per_engine():
    table = sp.render(BASE)
    rows = [line for line in table.splitlines() if line.startswith("| Llama")]
    assert len(rows) == len(sp.MODELS) * len(sp.GPUS)
    assert all(row.count("fits:") + row.count("no:") == len(sp.COLUMNS) for row in rows)
    assert "| Llama-2-13B | 2 × 80 GB, 512 GiB" in table


def test_a_rank_over_95_percent_of_its_gpu_does_not_fit(monkeypatch):
    """The device verdict leaves the plan's headroom (the header: "95% of each GPU ... usable"): a rank
    of 78 GiB does not fit an 80 GiB GPU (76 GiB usable), one of 75 GiB does."""
    def spec_of(device_gib):
        held = SimpleNamespace(device=device_gib * GiB, pinned=0, pageable=0)
        return SimpleNamespace(own_block=lambda block: None, footprint=lambda inputs: held)

    for device_gib, why in ((78, "GPU 78 GiB"), (75, None)):
        monkeypatch.setattr(sp, "engine_spec", lambda engine, d=device_gib: spec_of(d))
        assert sp.cell("ref-zenflow", sp.OVERLAP, sp.MODELS["Llama-2-13B"], 1, BASE).why == why
