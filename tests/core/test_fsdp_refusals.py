"""What ZenFlowAdamW refuses of FSDP2's parameters, in one line, before any state exists (zenflow/fsdp.py), and the
choice itself: DTensors make a sharded strategy, plain parameters keep data parallelism's. Run in a process of its
own (tests/support/fsdp_refusals.py): a process group made in the test process would outlive the test in DTensor's
caches, and a later fork could deadlock on it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import fsdp_refusals
import pytest

pytestmark = pytest.mark.ranks  # two ranks (tests/README.md)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def outcomes() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, fsdp_refusals.__file__], capture_output=True, text=True, timeout=120,
                          env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(line.split("\t", 1) for line in done.stdout.splitlines() if "\t" in line)


def test_fsdp2_parameters_make_a_sharded_strategy_and_plain_ones_do_not(outcomes: dict[str, str]) -> None:
    assert outcomes["choice"] == "True (4, 6)"


def test_a_plain_parameter_beside_fsdp2s_is_refused(outcomes: dict[str, str]) -> None:
    assert outcomes["plain"].startswith("refused: parameter 2 (shape (3,)) is a plain tensor beside FSDP2's DTensors: "
                                        "expected every parameter")


def test_a_replicated_dtensor_is_refused(outcomes: dict[str, str]) -> None:
    assert outcomes["replicated"].startswith("refused: parameter 0 has placements (Replicate(),): expected "
                                             "(Shard(dim=0),)")


def test_a_process_group_beside_fsdp2s_mesh_is_refused(outcomes: dict[str, str]) -> None:
    assert "is not allowed with FSDP2's sharded parameters" in outcomes["group"]
    assert outcomes["group"].startswith("refused: process_group = ")


def test_parameters_on_two_device_meshes_are_refused(outcomes: dict[str, str]) -> None:
    """Every parameter of one 1-D mesh, "refused in one line otherwise"."""
    assert outcomes["two meshes"].startswith("refused: parameters on 2 device meshes: expected one")


def test_a_frozen_fsdp2_layer_stays_frozen_and_the_rest_trains(outcomes: dict[str, str]) -> None:
    """The step's view keeps each parameter's requires_grad (StepView.params: the trainable ones), so a
    frozen layer under FSDP2 is left alone while the others train."""
    assert outcomes["frozen"] == "trains"
