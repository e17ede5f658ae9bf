"""DeepSpeed 0.19.8's ZenFlow weight-view regression (PR #8277; docs/design.md §7, row G) against the installed
DeepSpeed: reproduce/ds_zenflow_regression.py as a smoke, and the engine ds-zenflow-intended, whose registry row
restores the view, beside ds-zenflow as shipped. Each in a fresh process (DeepSpeed changes the process's threads
and affinity, docs/design.md §3). A DeepSpeed release that fixes the view fails the asserts on "transposed": then
the script's verdict and the engines' rows are to be read again. The repair's no-op on a release whose view is
right: tests/harness/engines/test_ds_weight_view.py, and the script run against 0.19.6 by hand (§7).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zenflow.harness.preflight import torch_extensions_dir

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "reproduce" / "ds_zenflow_regression.py"
NO_DEEPSPEED = importlib.util.find_spec("deepspeed") is None


def child_env() -> dict[str, str]:
    """DeepSpeed on its CPU accelerator, its ops from the harness's cache, no rank inherited from a launcher."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    return {**env, "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "", "PYTHONWARNINGS": "ignore",
            "TORCH_EXTENSIONS_DIR": str(torch_extensions_dir()), "PYTHONPATH": str(ROOT)}


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--steps", "many"]])
def test_bad_input_is_one_line_naming_what_is_allowed(argv, tmp_path, capsys):
    sys.path.insert(0, str(SCRIPT.parent))
    import ds_zenflow_regression

    with pytest.raises(SystemExit) as exc:
        ds_zenflow_regression.main(argv)
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and "\n" not in err and "expected an integer >= 1" in err
    with pytest.raises(SystemExit) as exc:
        ds_zenflow_regression.main(["--json", str(tmp_path)])
    assert exc.value.code == 2 and "is a folder: expected a file path in a writable folder" in capsys.readouterr().err


@pytest.mark.deepspeed
@pytest.mark.skipif(NO_DEEPSPEED, reason="DeepSpeed not installed")
def test_the_script_finds_the_regression_in_the_installed_deepspeed(tmp_path):
    """0.19.8: every weight transposed at initialize (both stages); the shipped ZenFlow trains to a loss well above
    torch AdamW's and scrambles a pretrained model, while the intended view keeps it and trains as torch does.
    ZeRO-Offload without ZenFlow (the control) keeps the weights and is torch AdamW."""
    out = tmp_path / "found.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--json", str(out)], env=child_env(), capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = json.loads(out.read_text())
    runs, torch_loss, pretrained = found["runs"], found["torch_adamw"]["loss_after"], found["pretrained"]
    for stage in (2, 1):
        shipped, intended = runs[f"zero{stage}-zenflow-shipped"], runs[f"zero{stage}-zenflow-intended"]
        assert (shipped["weights"], intended["weights"]) == ("transposed", "equal")
        assert shipped["loss_after"] > 2 * torch_loss
        assert intended["loss_after"] == pytest.approx(torch_loss, rel=0.05)
        assert pretrained[f"zero{stage}-zenflow-shipped"] > 10 * pretrained["torch"]
        assert pretrained[f"zero{stage}-zenflow-intended"] == pytest.approx(pretrained["torch"], rel=1e-6)
        assert "viewed 2 ZenFlow weights untransposed" in intended["repair"]
    control = runs["zero2-offload-control"]
    assert control["weights"] == "equal" and control["loss_after"] == pytest.approx(torch_loss, rel=1e-4)
    assert found["regression"] is True and found["deepspeed"] == "0.19.8"
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("(c) REGRESSION: DeepSpeed 0.19.8's ZenFlow") and "PR #8277" in last


# The two engines built through the harness's Session (its engine, its protocol), one process: ds-zenflow first,
# so that the repair ds-zenflow-intended's row installs cannot reach it.
ENGINES = r"""
import json, sys
from zenflow.harness.engines.build import deepspeed_config
from zenflow.harness.session import RunSpec, Session
BLOCK = {"topk_ratio": 0.25, "update_interval": 2, "full_warm_up_rounds": 0, "overlap_step": False,
         "select_strategy": "step", "select_interval": 100}
WORKLOAD = {"model": "cpu-scale", "dtype": "fp32", "seq_len": 8, "hidden": 32, "layers": 1, "intermediate": 64,
            "heads": 2, "data": "synthetic", "device": "cpu"}
found = {}
for engine in ("ds-zenflow", "ds-zenflow-intended"):
    cfg = deepspeed_config(engine, BLOCK, "fp32", 1, lr=1e-3, weight_decay=0.0, clipping=1.0, cuda=False)
    session = Session(RunSpec(engine=engine, label="view", workload=WORKLOAD, ds_config=cfg, progress=False))
    found[engine] = {"changed": session.engine.weights_changed_at_init, "protocol": session.record.protocol}
print("FOUND " + json.dumps(found, default=str))
"""


@pytest.mark.deepspeed
@pytest.mark.skipif(NO_DEEPSPEED, reason="DeepSpeed not installed")
def test_ds_zenflow_intended_keeps_the_models_weights_and_ds_zenflow_does_not():
    proc = subprocess.run([sys.executable, "-c", ENGINES], env=child_env(), capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("FOUND ")), None)
    assert line, proc.stderr[-4000:]
    found = json.loads(line[len("FOUND "):])
    shipped, intended = found["ds-zenflow"], found["ds-zenflow-intended"]
    assert shipped["changed"] and intended["changed"] == []  # every 2-D weight scrambled; none
    assert "ds_weight_view" not in shipped["protocol"] and "ds_repair_weight_view" not in intended["protocol"]
    view = intended["protocol"]["ds_weight_view"]  # the row's decision, what it did, recorded in the run's protocol
    assert view["restored_at_init"] == len(shipped["changed"]) and view["deepspeed"] == "0.19.8"
    assert "viewed" in view["note"] and "PR #8277" in view["note"]
    assert f"ds-zenflow-intended: {view['note']}" in proc.stderr  # the one-line note
