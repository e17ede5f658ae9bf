"""The placement (zenflow/harness/placement.py): a split moves a sync engine's host phases to the host cores and keeps
its device phases on the device cores, the record shows it, and a shared run (or a split whose switch does not move)
shows it did not. Each run trains in a fresh thread: a thread's affinity is its own, so pytest's stays untouched."""

from __future__ import annotations

import argparse
import os
import threading
from pathlib import Path

import pytest
import torch

from zenflow import ZenFlowAdamW
from zenflow.harness import cli
from zenflow.harness.engines.classes import ZenFlowEngine
from zenflow.harness.engines.registry import unavailable
from zenflow.harness.placement import (
    DEVICE,
    HOST,
    HOST_BLOCKS,
    PhaseSwitch,
    PlacementError,
    Shared,
    Split,
    phases_apart,
    placement_for,
)
from zenflow.harness.records import RunRecord
from zenflow.harness.result_sets import same_run
from zenflow.harness.session import RunSpec
from zenflow.hooks import BLOCKS, IO_BLOCKS, STALL_BLOCKS
from zenflow.reports.scenario import MixedPlacementError, engine_rows, runs_hardware_label

TWO_CORES = len(os.sched_getaffinity(0)) >= 2
needs_two_cores = pytest.mark.skipif(not TWO_CORES, reason="a split needs two cores; this runner has one")


class _Engine(ZenFlowEngine):
    """ref-offload's engine class around an optimizer built here (what Placement.bind reads: name, placed_by and
    attach_placement, which attaches the observer to the optimizer)."""

    def __init__(self, optimizer: ZenFlowAdamW) -> None:
        self.name, self.optimizer = "ref-offload", optimizer


def _train_in_a_thread(make_placement, steps: int = 3) -> dict:
    """ZeRO-Offload (ZenFlowAdamW, topk 0, every step a sync host update) on a small model, bound to the placement
    `make_placement()` returns, driven as Session drives it; the placement's facts (protocol.cores)."""
    out: dict = {}

    def train() -> None:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
        opt = ZenFlowAdamW(model.parameters(), lr=1e-3, zenflow={"topk_ratio": 0.0, "update_interval": 1,
                                                                  "overlap_step": False})
        placement = make_placement()
        placement.bind(_Engine(opt))
        for _ in range(steps):
            model(torch.randn(4, 32)).square().mean().backward()
            placement.note_device()
            with placement.optimizer_step():
                opt.step()
            opt.zero_grad()
        opt.close()
        out["facts"] = placement.facts()

    thread = threading.Thread(target=train)
    thread.start()
    thread.join()
    assert "facts" in out, "the training thread failed"
    return out["facts"]


@needs_two_cores
def test_a_split_runs_the_host_phases_on_the_host_cores_and_the_device_phases_on_the_device_cores():
    facts = _train_in_a_thread(lambda: placement_for("split"))
    device, host = facts["phases"][DEVICE], facts["phases"][HOST]
    assert device["phases"] == 3 and host["phases"] > 3  # one per forward; copies, adds, updates, uploads
    assert set(device["ran_on"]) <= set(facts["device"]) and set(host["ran_on"]) <= set(facts["host"])
    assert device["masks"] == [facts["device"]] and host["masks"] == [facts["host"]]
    assert phases_apart(facts)
    # a step's host blocks come in one run: two moves a step, not two per block
    assert facts["switches"] == 2 * 3


@needs_two_cores
def test_shared_runs_every_phase_on_every_core_and_the_record_says_they_were_not_apart():
    facts = _train_in_a_thread(Shared)
    assert facts["switches"] == 0 and facts["phases"][HOST]["phases"] > 0
    assert not phases_apart(facts)


@needs_two_cores
def test_a_split_whose_switch_does_not_move_fails_the_check():
    class Stuck(Split):  # the trainer pinned to the device cores, the host blocks never moved
        def __init__(self) -> None:
            cores = placement_for("split")
            super().__init__(cores.device, cores.host)
            self.switch = PhaseSwitch(None)

    facts = _train_in_a_thread(Stuck)
    assert facts["phases"][HOST]["masks"] == [facts["device"]]
    assert not phases_apart(facts)


def test_every_host_block_is_a_block_of_the_vocabulary():
    """A block renamed in zenflow/hooks.py would leave the split unseen: the host side must still name four."""
    assert HOST_BLOCKS <= BLOCKS and len(HOST_BLOCKS) == 4
    assert {"copy_d2h", "copy_h2d"} <= IO_BLOCKS and {"host_accumulate", "host_update"} <= STALL_BLOCKS


def test_a_split_is_two_disjoint_sets_and_an_engine_it_cannot_place_is_refused():
    with pytest.raises(PlacementError, match="disjoint"):
        Split([0], [0])
    with pytest.raises(PlacementError, match="cannot be placed"):
        Split([0], [1]).bind(type("Opaque", (), {"name": "fsdp2-offload", "placed_by": None})())
    assert not phases_apart(None) and not phases_apart({"placement": "shared"})


def test_a_bad_placement_is_refused_in_one_line_naming_the_allowed_ones():
    with pytest.raises(ValueError, match=r"placement = 'gpu' is not allowed: expected one of \('shared', 'split'\)"):
        RunSpec(engine="ref-offload", label="x", workload={}, ds_config={}, placement="gpu")
    with pytest.raises(ValueError, match="expected one of"):
        placement_for("both")


def test_a_split_says_which_engines_it_cannot_place_and_refuses_a_gpu():
    assert unavailable("ref-offload", "cpu", "split") is None and unavailable("no-offload", "cpu", "split") is None
    assert "cannot be placed" in unavailable("fsdp2-offload", "cpu", "split")
    assert unavailable("fsdp2-offload", "cpu", "shared") is None
    assert "GPU analog" in unavailable("ref-offload", "cuda", "split")


def _rec(engine: str, placement: str | None, cycle: float = 100.0) -> RunRecord:
    protocol = {} if placement is None else {"placement": placement}
    return RunRecord(engine=engine, protocol=protocol, environment={"cpu": {"model": "AMD EPYC", "allowed_cores": 2}},
                     summary={"step_ms": {"median": cycle}, "cycle_mean_ms": cycle, "stall_ms": 1.0})


def test_a_table_refuses_to_mix_placements_and_its_title_names_the_one_it_has():
    with pytest.raises(MixedPlacementError) as err:
        engine_rows([_rec("ref-offload", "split"), _rec("ref-zenflow", None)])
    assert "placement shared: ref-zenflow" in str(err.value) and "placement split: ref-offload" in str(err.value)
    split = [_rec("ref-offload", "split", 200.0), _rec("ref-zenflow", "split", 100.0)]
    assert [r["engine"] for r in engine_rows(split)] == ["ref-offload", "ref-zenflow"]  # one placement: tabulated
    assert runs_hardware_label(split, {}).endswith("placement split (GPU analog)")
    assert runs_hardware_label([_rec("ref-offload", None)], {}).endswith("placement shared")


def test_resume_keeps_a_record_only_at_the_same_placement(tmp_path: Path):
    spec = RunSpec(engine="ref-offload", label="x", workload={"seq_len": 8}, ds_config={"a": 1}, placement="split")
    old = RunRecord(engine="ref-offload", status="ok", config={"a": 1}, workload={"seq_len": 8},
                    protocol={"placement": "split"})
    assert same_run(old, spec)
    old.protocol["placement"] = "shared"
    assert not same_run(old, spec)
    del old.protocol["placement"]  # a record from before placements: shared
    assert not same_run(old, spec)
    spec.placement = "shared"
    assert same_run(old, spec)


def test_an_out_folder_of_another_placement_is_refused(tmp_path: Path):
    _rec("ref-offload", "split").write(tmp_path / "ref-offload-r0.json")
    assert cli.placement_problem(tmp_path, "split") is None
    assert "holds runs at placement split" in cli.placement_problem(tmp_path, "shared")
    assert cli.placement_name("shared") == "" and cli.placement_name("split") == "placement-split"



def test_a_split_is_refused_in_one_line_on_a_gpu_or_with_one_core_per_rank(monkeypatch, capsys):
    ap = cli.ArgumentParser(prog="llama7b.py")
    split = argparse.Namespace(placement="split")
    with pytest.raises(SystemExit):
        cli.check_placement_args(ap, split, cuda=True)
    assert "argument --placement: 'split' is not allowed on a GPU" in capsys.readouterr().err
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    with pytest.raises(SystemExit):
        cli.check_placement_args(ap, split, cuda=False, nproc=2)
    assert "'split' is not allowed with 1 core(s) per rank: expected at least 2" in capsys.readouterr().err
    cli.check_placement_args(ap, split, cuda=False, nproc=1)  # two cores, one rank: allowed
    cli.check_placement_args(ap, argparse.Namespace(placement="shared"), cuda=True)  # shared: anywhere
