"""GLUE study: the paired deficit and its interval against hand-computed values, the verdicts, the rule
that ZenFlow runs borrow the default's ZeRO-Offload scores only at the same budget, the knob flags reaching the
ZenFlow block, and a tiny study end to end through reproduce/glue_study.py."""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

import pytest

from zenflow.harness.records import RunRecord, read_records
from zenflow.reports.glue_study import budget, deficits, paired, reproduced, study_report, study_rows, t975, verdict

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "reproduce"))
import glue as reproduce_glue  # noqa: E402  (reproduce/glue.py)
import glue_study  # noqa: E402  (reproduce/glue_study.py)

SHARED_GLUE = ROOT.parent / "shared" / "data" / "glue"


def run(engine: str, task: str, seed: int, score: float, epochs: int = 1, train: int = 2048) -> RunRecord:
    return RunRecord(engine=engine, workload={"kind": "glue", "seed": seed, "train_size": train, "epochs": epochs,
                                              "seq_len": 128, "micro_batch": 16, "dtype": "fp32"},
                     config={"optimizer": {"params": {"lr": 1e-4}}}, metrics={"task": task, "score": score})


def test_paired_interval_matches_the_hand_computed_t_interval():
    diffs = [-1.0, -2.0, -4.5]
    got = paired(diffs)
    half = 4.303 * statistics.stdev(diffs) / math.sqrt(3)  # t(0.975, 2) = 4.303
    assert got["mean"] == pytest.approx(-2.5) and got["n"] == 3
    assert got["low"] == pytest.approx(-2.5 - half) and got["high"] == pytest.approx(-2.5 + half)
    assert paired([1.0])["low"] is None


def test_t_quantiles_beyond_the_table_continue_it():
    assert t975(2) == 4.303
    assert t975(11) == pytest.approx(2.201, rel=3e-3) and t975(30) == pytest.approx(2.042, rel=3e-3)
    assert t975(10_000) == pytest.approx(1.96, rel=1e-3)


def test_verdicts_name_the_deficit_and_the_change():
    below, around = {"low": -3.0, "high": -1.0}, {"low": -1.0, "high": 2.0}
    assert verdict(below, None) == "deficit"
    assert verdict({"low": 0.5, "high": 2.0}, None) == "ZenFlow above"
    assert verdict(around, {"low": 0.2, "high": 3.0}, below) == "no deficit detected (interval contains 0); closes it"
    # the default had no detected deficit: a smaller one is not "closed"
    assert verdict(around, {"low": 0.2, "high": 3.0}, around).endswith("; smaller than the default's")
    assert verdict(below, {"low": 0.2, "high": 3.0}, below) == "deficit; smaller than the default's"
    assert verdict(below, {"low": -3.0, "high": -0.1}) == "deficit; larger than the default's"
    assert verdict(around, {"low": -1.0, "high": 1.0}).endswith("no detectable change from the default")


def test_deficits_pair_by_seed_and_average_over_tasks():
    default = [run("ref-offload", t, s, base + s) for t, base in (("SST-2", 80.0), ("MRPC", 70.0)) for s in range(3)]
    default += [run("ref-zenflow", t, s, base + s - d) for t, base, d in (("SST-2", 80.0, 2.0), ("MRPC", 70.0, 1.0))
                for s in range(3)]
    knob = [run("ref-zenflow", t, s, base + s - 0.5) for t, base in (("SST-2", 80.0), ("MRPC", 70.0)) for s in range(3)]
    longer = [run(e, "SST-2", s, 85.0 + s, epochs=3) for e in ("ref-offload", "ref-zenflow") for s in range(3)]
    rows = {(r["setting"], r["task"]): r for r in study_rows(default, {"topk-0.2": knob, "budget-3-epochs": longer})}
    assert rows[("default", "SST-2")]["deficit"] == pytest.approx(-2.0)
    assert rows[("default", "average")]["deficit"] == pytest.approx(-1.5)
    # identical differences on every seed: a zero-width interval, so the verdicts are exact
    assert rows[("default", "SST-2")]["verdict"] == "deficit"
    assert rows[("topk-0.2", "SST-2")]["deficit"] == pytest.approx(-0.5)  # against the default's ZeRO-Offload
    assert rows[("topk-0.2", "SST-2")]["change"] == pytest.approx(1.5)
    assert rows[("topk-0.2", "MRPC")]["verdict"] == "deficit; smaller than the default's"
    assert rows[("budget-3-epochs", "SST-2")]["offload_from"] == "this setting"
    assert rows[("budget-3-epochs", "SST-2")]["verdict"] == "no deficit detected (interval contains 0); closes it"


def test_zenflow_runs_of_another_budget_do_not_borrow_the_default_offload_scores():
    default = [run(e, "SST-2", s, 80.0) for e in ("ref-offload", "ref-zenflow") for s in range(2)]
    other = [run("ref-zenflow", "SST-2", s, 70.0, train=64) for s in range(2)]
    assert budget(other) != budget(default)
    assert not [r for r in study_rows(default, {"interval-2": other}) if r["setting"] == "interval-2"]
    assert deficits({"SST-2": {0: 1.0}}, {"SST-2": {1: 2.0}}) == {}  # no common seed: nothing to pair


def test_reproduced_counts_identical_scores():
    default = [run("ref-offload", "SST-2", 0, 80.0), run("ref-zenflow", "SST-2", 0, 79.0)]
    again = [run("ref-offload", "SST-2", 0, 80.0), run("ref-zenflow", "SST-2", 0, 79.5)]
    assert reproduced(default, again) == (1, 2, 0.5)


def test_knob_flags_reach_the_zenflow_block_and_bad_values_are_refused(capsys):
    args = reproduce_glue.parse_args(["--update-interval", "2", "--topk-ratio", "0.05", "--engines", "ref-zenflow",
                                      "ref-offload", "--seeds", "0"])
    plans = {p.spec.engine: p.spec.ds_config["zero_optimization"]["zenflow"]
             for p in reproduce_glue.plan(args, ["SST-2"], "model")}
    assert plans["ref-zenflow"]["update_interval"] == 2 and plans["ref-zenflow"]["topk_ratio"] == 0.05
    assert plans["ref-offload"]["topk_ratio"] == 0.0  # ZeRO-Offload keeps its own block
    for bad, message in ((["--topk-ratio", "1.5"], "expected a number in [0, 1]"),
                         (["--topk-ratio", "-0.1"], "expected a number in [0, 1]"),
                         (["--update-interval", "0"], 'expected "auto" or an integer >= 1')):
        with pytest.raises(SystemExit) as exc:
            reproduce_glue.parse_args(bad)
        assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.script
@pytest.mark.skipif(not SHARED_GLUE.is_dir(), reason="../shared/data/glue not present")
def test_tiny_study_end_to_end_keeps_finished_settings_and_reports(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tiny = "--tasks MRPC --seeds 0 1 --train-examples 16 --eval-examples 16 --seq-len 32 --warmup-steps 1"
    default, out = tmp_path / "default", tmp_path / "study"
    assert reproduce_glue.main([*tiny.split(), "--engines", "ref-offload", "ref-zenflow", "--out", str(default)]) == 0
    argv = ["--settings", "interval-2", f"--glue-args={tiny}", "--default-runs", str(default), "--out", str(out)]
    assert glue_study.main(argv) == 0
    made = read_records(out / "interval-2")
    assert sorted(r.engine for r in made) == ["ref-zenflow", "ref-zenflow"]
    assert {r.config["zero_optimization"]["zenflow"]["update_interval"] for r in made} == {2}
    table = (out / "table.md").read_text()
    assert "| interval-2" in table and "| default" in table and (out / "figure.png").stat().st_size > 0
    capsys.readouterr()
    assert glue_study.main(argv) == 0  # finished: kept, not rerun
    assert "interval-2: kept" in capsys.readouterr().err
    assert study_report(read_records(default), {"interval-2": made}, tmp_path / "again") == table.rstrip("\n")
