"""ZenFlow's knobs at the command line: "auto" wherever an interval is set. One argparse type for
--update-interval / --select-interval (harness/cli.py: interval), the chosen block in every planned run and
record, a folder of its own for a setting other than the default, and the knobs study's driver
(reproduce/knobs.py): its budget from the committed records, and its smoke run end to end."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zenflow.harness import cli
from zenflow.harness.configs import DEEPSPEED_EXAMPLES_BLOCK, GLUE_BLOCK
from zenflow.harness.records import RunRecord, read_records

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "reproduce"))
import glue  # noqa: E402  (reproduce/glue.py)
import knobs  # noqa: E402  (reproduce/knobs.py)
import llama7b  # noqa: E402  (reproduce/llama7b.py)

ALLOWED = 'expected "auto" or an integer >= 1'


@pytest.mark.parametrize("value", ["0", "-1", "abc", "1.5"])
def test_interval_type_refuses_what_the_zenflow_block_refuses(value):
    with pytest.raises(argparse.ArgumentTypeError) as refused:
        cli.interval(value)
    assert str(refused.value) == f"{value!r} is not allowed: {ALLOWED}"


def test_interval_type_takes_auto_and_integers():
    assert cli.interval("auto") == "auto" and cli.interval("3") == 3


@pytest.mark.parametrize(("main", "args", "line"), [
    (llama7b.main, ["--update-interval", "0"], f"argument --update-interval: '0' is not allowed: {ALLOWED}"),
    (llama7b.main, ["--select-interval", "1.5"], f"argument --select-interval: '1.5' is not allowed: {ALLOWED}"),
    (llama7b.main, ["--topk-ratio", "1.5"], "argument --topk-ratio: '1.5' is not allowed: expected a number in [0, 1]"),
    (glue.main, ["--update-interval", "abc"], f"argument --update-interval: 'abc' is not allowed: {ALLOWED}"),
    (glue.main, ["--update-interval", "8", "--select-interval", "4"],
     "argument --select-interval: zenflow.select_interval = 4 is not allowed: expected an integer >= update_interval"),
], ids=["llama-U-0", "llama-S-1.5", "llama-topk-1.5", "glue-U-abc", "glue-S-below-U"])
def test_a_bad_knob_is_refused_in_one_line_before_any_work(main, args, line, tmp_path, capsys):
    """Were a knob let through, the work after parsing stops at once here (llama7b's --plan runs nothing, an empty
    --glue-dir is refused), so the test fails in seconds instead of running a reproduction."""
    out = tmp_path / "out"
    (tmp_path / "no-tasks").mkdir()
    stop = ["--plan"] if main is llama7b.main else ["--glue-dir", str(tmp_path / "no-tasks")]
    assert main([*args, *stop, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and line in err[0], err
    assert not out.exists()


def _zenflow_blocks(planned) -> dict[str, dict]:
    return {run.spec.engine: run.spec.ds_config["zero_optimization"].get("zenflow") for run in planned}


def test_the_chosen_block_is_in_every_planned_zenflow_run():
    knobs_args = ["--update-interval", "auto", "--select-interval", "auto", "--topk-ratio", "0.2"]
    args = llama7b.parse_args(["--smoke", "--engines", "ref-zenflow", "ds-zenflow", "ref-offload", *knobs_args])
    blocks = _zenflow_blocks(llama7b.plan(args))
    chosen = {**DEEPSPEED_EXAMPLES_BLOCK, "update_interval": "auto", "select_interval": "auto", "topk_ratio": 0.2}
    assert blocks["ref-zenflow"] == blocks["ds-zenflow"] == chosen  # DeepSpeed's ZenFlow runs "auto" too
    assert blocks["ref-offload"]["topk_ratio"] == 0.0  # ZeRO-Offload keeps its own block
    args = glue.parse_args(["--engines", "ref-zenflow", "--seeds", "0", *knobs_args])
    assert _zenflow_blocks(glue.plan(args, ["SST-2"], "m"))["ref-zenflow"] == {**GLUE_BLOCK, **{
        "update_interval": "auto", "select_interval": "auto", "topk_ratio": 0.2}}


def test_another_setting_gets_a_folder_of_its_own(capsys):
    """--report-only without --out names the default folder it looked in: the setting is in its name."""
    assert llama7b.main(["--smoke", "--update-interval", "auto", "--topk-ratio", "0.05", "--report-only"]) == 2
    assert "/topk-ratio-0.05_update-interval-auto'" in capsys.readouterr().err
    assert cli.setting_name(DEEPSPEED_EXAMPLES_BLOCK, DEEPSPEED_EXAMPLES_BLOCK) == ""  # the default: as before


def test_an_out_folder_holding_another_setting_is_refused(tmp_path):
    block = {**DEEPSPEED_EXAMPLES_BLOCK, "update_interval": 2}
    config = {"zero_optimization": {"stage": 2, "zenflow": block}}
    RunRecord(engine="ref-zenflow", config=config).write(tmp_path / "ref-zenflow-r0.json")
    RunRecord(engine="ref-offload", config={"zero_optimization": {"zenflow": {"update_interval": 1}}}).write(
        tmp_path / "ref-offload-r0.json")  # a fixed block of its own: not a setting
    assert cli.setting_problem(tmp_path, block) is None
    problem = cli.setting_problem(tmp_path, {**block, "update_interval": "auto"})
    assert problem and "ref-zenflow-r0.json: update_interval 2" in problem and "folder of its own" in problem


def _collect_bench(interval: str = "", **variables: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "ZENFLOW_BENCH_INTERVAL": interval, "ZENFLOW_BENCH_SMALL": "1", **variables}
    return subprocess.run([sys.executable, "-m", "pytest", "bench/", "-q", "--collect-only", "-p", "no:cacheprovider"],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)


@pytest.mark.script
def test_the_bench_measures_auto_under_names_of_its_own_and_refuses_a_bad_knob():
    ids = _collect_bench("auto").stdout
    assert "test_optimizer_step[zenflow-overlap-Uauto]" in ids
    assert "test_train_step[cpu-scale-small-Uauto-ref-zenflow]" in ids
    assert "test_device_selective_update[256x256-Uauto]" in ids and "[zenflow-sync]" not in ids
    refused = _collect_bench("0")
    assert refused.returncode == 4, refused.stdout + refused.stderr
    assert f"ERROR: ZENFLOW_BENCH_INTERVAL: '0' is not allowed: {ALLOWED}" in refused.stderr.strip().splitlines()


@pytest.mark.script
def test_the_bench_measures_the_split_under_names_of_its_own_and_refuses_a_bad_placement():
    ids = _collect_bench(ZENFLOW_BENCH_PLACEMENT="split").stdout
    assert "test_train_step[cpu-scale-small-split-ref-zenflow]" in ids
    assert "test_train_step[cpu-scale-small-ref-zenflow]" not in ids  # never compared with the shared benchmarks
    refused = _collect_bench(ZENFLOW_BENCH_PLACEMENT="sideways")
    assert refused.returncode == 4, refused.stdout + refused.stderr
    assert ("ERROR: ZENFLOW_BENCH_PLACEMENT: placement = 'sideways' is not allowed: expected one of ('shared', "
            "'split')") in refused.stderr.strip().splitlines()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a split needs two cores")
def test_the_study_at_the_split_places_every_run_and_never_shares_a_folder_with_the_other(tmp_path, capsys):
    args = knobs.parse_args(["--workloads", "llama", "--placement", "split", "--smoke", "--out", str(tmp_path)])
    runs = knobs.plan("llama", args)
    assert runs and {r.spec.placement for _, r in runs} == {"split"}
    shared = knobs.parse_args(["--workloads", "llama", "--smoke"])
    assert {r.spec.placement for _, r in knobs.plan("llama", shared)} == {"shared"}  # the control
    (tmp_path / "llama").mkdir()
    RunRecord(engine="ref-offload", protocol={"placement": "shared"}).write(tmp_path / "llama" / "ref-offload-s0.json")
    assert knobs.main(["--workloads", "llama", "--placement", "split", "--smoke", "--out", str(tmp_path)]) == 2
    assert "placement" in capsys.readouterr().err


def test_the_study_fits_its_budget_from_the_committed_records(tmp_path):
    args = knobs.parse_args(["--workloads", "llama", "--budget-min", "1", "--out", str(tmp_path)])
    runs = knobs.plan("llama", args)
    assert {s.name for s, _ in runs} == {s.name for s in knobs.SETTINGS} and len(runs) == 3 * len(knobs.SETTINGS)
    seeds = [r.spec.workload["seed"] for _, r in runs]
    assert seeds == sorted(seeds)  # interleaved: every setting's seed s before any seed s + 1
    seconds, source = knobs.run_seconds("llama", "no-such-machine")
    assert source.endswith("/convergence") and {"ref-offload", "ref-zenflow", "ds-zenflow"} <= set(seconds)
    least = 3 * sum(seconds[s.engine] for s in knobs.SETTINGS[:knobs.ESSENTIAL]) / 60
    args.budget_min = least * 0.9
    with pytest.raises(knobs.Refused, match="--budget-min"):
        knobs.fit("llama", runs, tmp_path / "llama", args, "no-such-machine")
    args.budget_min = least * 1.1 + 3 * seconds["ref-zenflow"] / 60  # room for one more setting, not two
    kept = list(dict.fromkeys(s.name for s, _ in knobs.fit("llama", runs, tmp_path / "llama", args, "x")))
    assert kept == [s.name for s in knobs.SETTINGS[:knobs.ESSENTIAL + 1]]


def test_the_settings_kept_are_a_prefix_of_the_priority_order(tmp_path, monkeypatch):
    """Settings are dropped from the end of SETTINGS: once one does not fit, no later one is kept, even
    a cheaper one that would (here ds-zenflow's 100 s runs do not fit, ref-zenflow's 1 s runs after it would)."""
    monkeypatch.setattr(knobs, "run_seconds", lambda workload, hw: ({"ref-offload": 1.0, "ref-zenflow": 1.0,
                                                                      "ds-zenflow": 100.0}, "made up"))
    args = knobs.parse_args(["--workloads", "llama", "--budget-min", "1", "--out", str(tmp_path)])
    runs = knobs.plan("llama", args)
    args.budget_min = 16 / 60  # 3 seeds: the four settings before ds-update-interval-auto take 12 s, one more 15 s
    kept = list(dict.fromkeys(s.name for s, _ in knobs.fit("llama", runs, tmp_path / "llama", args, "x")))
    names = [s.name for s in knobs.SETTINGS]
    assert names[len(kept)] == "ds-update-interval-auto"
    assert kept == names[:len(kept)] == ["ref-offload", "update-interval-4", "update-interval-auto",
                                         "select-interval-auto"]


def test_a_record_of_another_setting_under_the_runs_name_is_not_this_runs_record(tmp_path):
    """`recorded` is "a record of this very run (same engine, config asked for and workload)": a record
    named like the run but asked with another config does not let a resume skip the run."""
    args = knobs.parse_args(["--workloads", "llama", "--budget-min", "1", "--out", str(tmp_path)])
    first = {}
    for s, r in knobs.plan("llama", args):
        first.setdefault(s.name, r)  # each setting's run of the first seed
    run, other = first["update-interval-4"], first["update-interval-2"]
    assert run.spec.ds_config != other.spec.ds_config and run.spec.workload == other.spec.workload
    folder = tmp_path / "llama"
    folder.mkdir()
    RunRecord(engine=other.spec.engine, status="ok", config=other.spec.ds_config,
              workload=other.spec.workload).write(folder / run.name)
    assert not knobs.recorded(folder, run, failed_too=True)
    RunRecord(engine=run.spec.engine, status="ok", config=run.spec.ds_config,
              workload=run.spec.workload).write(folder / run.name)
    assert knobs.recorded(folder, run, failed_too=False)  # the control: its own record is recognised


@pytest.mark.slow
def test_smoke_study_writes_table_figures_and_verdict_and_records_what_auto_chose(tmp_path):
    """The tiny study (< 60 s on a quiet 2-core machine): three runs through the run loop, the report's files; the
    "auto" run's record holds "auto" in its config and the host updates it chose in its steps; a second call
    reruns nothing."""
    assert knobs.main(["--smoke", "--out", str(tmp_path)]) == 0
    for name in ("knobs.md", "knobs.csv", "verdict.json", "frontier.png", "auto-intervals.png"):
        assert (tmp_path / name).is_file(), name
    verdict = json.loads((tmp_path / "verdict.json").read_text())["workloads"]["llama"]
    assert list(verdict) == ["ref-zenflow U=auto S=64 k=0.1"]
    assert verdict["ref-zenflow U=auto S=64 k=0.1"]["verdict"] in ("holds", "fails", "undecided")
    auto = RunRecord.read(tmp_path / "llama" / "update-interval-auto-s1234.json")
    assert auto.config["zero_optimization"]["zenflow"]["update_interval"] == "auto"
    boundaries = [s["step"] for s in auto.steps if (s["decisions"] or {}).get("host_update")]
    assert boundaries and len(boundaries) == auto.metrics["zenflow"]["host_updates"]
    before = {r.engine + str(r.metrics["wall_seconds"]) for r in read_records(tmp_path / "llama")}
    assert knobs.main(["--smoke", "--out", str(tmp_path)]) == 0
    assert {r.engine + str(r.metrics["wall_seconds"]) for r in read_records(tmp_path / "llama")} == before
