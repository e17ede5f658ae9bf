"""Golden loss curve of a small cpu-scale run: catches silent numerical changes in the optimizer or harness.

Regenerate (only after an intended numerical change, and say why in the commit):
    ZENFLOW_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/harness/test_golden_loss.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from zenflow.harness.session import Session
from zenflow.harness.workloads import Workload

GOLDEN = Path(__file__).parent / "golden" / "cpu_scale_losses.json"
# device "cpu": the goldens are CPU numbers; on a GPU host this curve still runs on the CPU.
# data "synthetic": texts generated from the seed, the same on every machine. With "auto" the texts come from
# ../shared/data when it is there, and a GPU host (which gets the checkout alone) trained on other texts (2026-11-24).
WORKLOAD = Workload(dtype="fp32", seq_len=16, hidden=64, layers=2, intermediate=128, heads=4, seed=7, device="cpu",
                    data="synthetic")
BLOCK = {"topk_ratio": 0.1, "update_interval": 4, "full_warm_up_rounds": 2, "select_interval": 8}
STEPS = 24


@pytest.mark.parametrize("engine", ["ref-zenflow", "ref-offload"])
def test_cpu_scale_loss_curve_matches_the_golden_file(run_spec, engine):
    torch.manual_seed(0)
    spec = run_spec(engine, block=BLOCK, weight_decay=0.01, workload=WORKLOAD.to_dict(), label="golden",
                    warmup_steps=0, timed_steps=STEPS, threads=torch.get_num_threads())
    session = Session(spec)  # the harness's one run loop, in this process
    assert session.engine.device == torch.device("cpu")
    session.step(STEPS)
    losses = [t.loss for t in session.timeline.steps]
    session.close()
    golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    if os.environ.get("ZENFLOW_UPDATE_GOLDEN"):
        GOLDEN.write_text(json.dumps({**golden, engine: losses}, indent=1) + "\n")
        pytest.skip("golden file updated")
    assert engine in golden, f"no golden curve for {engine}: run with ZENFLOW_UPDATE_GOLDEN=1"
    assert losses[-1] < losses[0]  # it trains
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(golden[engine]), rtol=1e-5, atol=1e-5)
