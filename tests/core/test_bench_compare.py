"""The benchmark compare command (zenflow/bench_compare.py), bench/conftest.py's hooks, and the GPU bench workflow."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from zenflow.bench_compare import CompareError, Thresholds, check_hardware, compare_runs, judge, load_run, main

ROOT = Path(__file__).resolve().parents[2]
HW = "cpu-scale-test-cpu-2c"


def sample(n: int = 20, scale: float = 1.0, cv: float = 0.02, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return [scale * max(1e-6, rng.gauss(0.1, 0.1 * cv)) for _ in range(n)]


def run_json(benchmarks: dict[str, list[float] | None], hw: str | None = HW, commit: str = "a" * 40,
             when: str = "2026-01-01T00:00:00") -> dict:
    rows = []
    for name, data in benchmarks.items():
        stats = {"median": sorted(data)[len(data) // 2] if data else 0.1, "rounds": len(data or [1] * 10)}
        if data is not None:
            stats["data"] = data
        rows.append({"name": name, "fullname": f"bench/test_x.py::{name}", "stats": stats})
    return {"machine_info": {"hardware_id": hw}, "commit_info": {"id": commit}, "datetime": when,
            "benchmarks": rows}


def write(path: Path, run: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(run))
    return path


# ---- verdicts on synthetic timings with known answers -------------------------------------------------------------
def test_identical_distributions_are_no_change() -> None:
    assert judge(sample(seed=1), sample(seed=2)).verdict == "No change"
    verdicts = [judge(sample(seed=s), sample(seed=s + 50)).verdict for s in range(40)]
    assert "Regression" not in verdicts and verdicts.count("No change") >= 36  # Suspicious: ~alpha of the time


def test_a_20_percent_slowdown_is_a_regression() -> None:
    v = judge(sample(seed=1), sample(scale=1.2, seed=2))
    assert v.verdict == "Regression" and v.ratio == pytest.approx(1.2, rel=0.03) and v.p_slower < 1e-6


def test_a_20_percent_speedup_is_an_improvement() -> None:
    assert judge(sample(seed=1), sample(scale=0.8, seed=2)).verdict == "Improvement"
    for beyond in (True, False):  # significantly faster, but within the threshold
        assert judge(sample(seed=1), sample(scale=0.97, seed=2), beyond=beyond).verdict == "No change"


def test_a_3_percent_slowdown_in_heavy_noise_is_not_a_regression() -> None:
    for seed in range(10):  # CV 30%: sample medians move by ~10%, so the ratio alone would often say "regression"
        v = judge(sample(n=10, cv=0.3, seed=seed), sample(n=10, scale=1.03, cv=0.3, seed=seed + 100))
        assert v.verdict != "Regression", (seed, v)


def test_changes_within_the_threshold_fail_at_most_alpha_of_the_time() -> None:
    """The U test asks "slower by more than the threshold?", so a 3% slowdown under a 5% threshold is a false alarm
    with probability <= alpha whatever the noise; the textbook rule ("slower at all" + ratio) and the bare ratio
    threshold (pytest-benchmark's --benchmark-compare-fail) are not."""
    draws = [(sample(n=10, cv=0.1, seed=s), sample(n=10, scale=1.03, cv=0.1, seed=s + 1000)) for s in range(400)]
    ours = sum(judge(b, c).verdict == "Regression" for b, c in draws) / len(draws)
    plain = sum(judge(b, c, beyond=False).verdict == "Regression" for b, c in draws) / len(draws)
    bare = sum(judge(b, c).ratio > 1.05 for b, c in draws) / len(draws)
    assert ours <= 0.05 and plain > 2 * ours and bare > 0.3, (ours, plain, bare)


def test_both_must_agree_else_suspicious() -> None:
    tight = judge(sample(seed=1), sample(scale=1.03, seed=2))  # significant, but within the threshold
    assert (tight.verdict, tight.p_slower < 0.05, tight.ratio < 1.05) == ("Suspicious", True, True)
    noisy = judge([0.10, 0.30, 0.11, 0.29, 0.12], [0.12, 0.28, 0.13, 0.31, 0.10])  # slower median, not significant
    assert (noisy.verdict, noisy.ratio > 1.05, noisy.p_slower > 0.05) == ("Suspicious", True, True)
    # slower, significantly, and the median by more than 5% -- but not significantly by more than 5%
    edge = judge(sample(seed=1), sample(scale=1.065, seed=2))
    assert (edge.verdict, edge.ratio > 1.05, edge.p_slower < 0.05, edge.p_beyond > 0.05) == ("Suspicious", True,
                                                                                           True, True)
    assert judge(sample(seed=1), sample(scale=1.065, seed=2), beyond=False).verdict == "Regression"


def test_too_few_rounds_or_no_raw_data_is_insufficient() -> None:
    few = judge(sample(n=4, seed=1), sample(n=20, scale=2.0, seed=2))
    assert few.verdict == "Insufficient data" and "at least 5" in few.note
    assert judge(sample(n=5, seed=1), sample(n=5, scale=2.0, seed=2)).verdict == "Regression"
    missing = judge(None, sample(scale=2.0), medians=(0.1, 0.2))
    assert missing.verdict == "Insufficient data" and missing.ratio == pytest.approx(2.0, rel=0.05)
    assert "baseline" in missing.note


def test_thresholds_per_benchmark_and_command_line(tmp_path: Path) -> None:
    (tmp_path / "t.toml").write_text('[thresholds]\ndefault = 0.10\n"test_a[*]" = 0.30\n')
    th = Thresholds.load(tmp_path / "t.toml")
    assert (th.threshold("test_a[x]"), th.threshold("test_b[x]")) == (0.30, 0.10)
    assert judge(sample(seed=1), sample(scale=1.2, seed=2), threshold=th.threshold("test_a[x]")).verdict != \
        "Regression"
    base = write(tmp_path / "b.json", run_json({"test_a[x]": sample(seed=1), "test_b[x]": sample(seed=3)}))
    cand = write(tmp_path / "c.json", run_json({"test_a[x]": sample(scale=1.2, seed=2), "test_b[x]": sample(seed=4)}))
    (tmp_path / "empty.toml").write_text("")
    assert main([str(base), str(cand), "--thresholds", str(tmp_path / "empty.toml")]) == 1
    assert main([str(base), str(cand), "--threshold-for", "test_a[*]=0.25"]) == 0
    assert main([str(base), str(cand), "--threshold", "0.25", "--thresholds", str(tmp_path / "empty.toml")]) == 0
    assert main([str(base), str(cand), "--thresholds", str(tmp_path / "missing.toml")]) == 2


# ---- whole runs: exit codes, hardware ids, inputs, accepted regressions, outputs ---------------------------------
@pytest.fixture
def runs(tmp_path: Path) -> tuple[Path, Path, Path]:
    same = {"test_same": sample(seed=5)}
    base = write(tmp_path / "base.json", run_json({**same, "test_slow": sample(seed=1)}))
    slow = write(tmp_path / "slow.json", run_json({**same, "test_slow": sample(scale=1.2, seed=2)}))
    fine = write(tmp_path / "fine.json", run_json({**same, "test_slow": sample(seed=2)}))
    return base, slow, fine


def test_exit_code_is_1_on_regression_only(runs, capsys) -> None:
    base, slow, fine = runs
    assert main([str(base), str(slow)]) == 1
    assert "| `test_slow` |" in capsys.readouterr().out
    assert main([str(base), str(fine)]) == 0


def test_different_hardware_ids_are_refused_unless_forced(runs, tmp_path: Path, capsys) -> None:
    base, slow, _ = runs
    other = write(tmp_path / "h100.json", {**json.loads(slow.read_text()), "machine_info": {"hardware_id": "h100x1"}})
    assert main([str(base), str(other)]) == 2
    err = capsys.readouterr().err
    assert HW in err and "h100x1" in err and "--force" in err
    assert main([str(base), str(other), "--force"]) == 1  # compared: the regression is found
    assert "forced comparison" in capsys.readouterr().out
    unknown = run_json({"test_same": sample()}, hw=None)
    with pytest.raises(CompareError, match="unknown"):
        check_hardware(json.loads(base.read_text()), unknown, force=False)


def test_a_folder_means_its_newest_run(tmp_path: Path) -> None:
    write(tmp_path / "runs" / "m" / "0001_old.json", run_json({"t": sample()}, when="2026-01-01T00:00:00"))
    write(tmp_path / "runs" / "m" / "0002_new.json", run_json({"t": sample()}, when="2026-02-01T00:00:00"))
    (tmp_path / "runs" / "notes.json").write_text("[]")  # not a pytest-benchmark run: ignored
    assert load_run(tmp_path / "runs")[0].name == "0002_new.json"
    assert main([str(tmp_path / "empty"), str(tmp_path / "runs")]) == 2


def test_accepted_regression_passes_only_against_its_baseline(runs, tmp_path: Path, capsys) -> None:
    base, slow, _ = runs
    entry = '[[accepted]]\nbenchmark = "test_slow"\nbaseline_commit = "{c}"\nmax_ratio = {r}\nreason = "on purpose"\n'
    (tmp_path / "ok.toml").write_text(entry.format(c="aaaaaaa", r=1.3))
    assert main([str(base), str(slow), "--thresholds", str(tmp_path / "ok.toml")]) == 0
    assert "accepted: on purpose" in capsys.readouterr().out
    (tmp_path / "stale.toml").write_text(entry.format(c="bbbbbbb", r=1.3))
    assert main([str(base), str(slow), "--thresholds", str(tmp_path / "stale.toml")]) == 1
    assert "stale" in capsys.readouterr().out
    (tmp_path / "small.toml").write_text(entry.format(c="aaaaaaa", r=1.1))  # a larger slowdown still fails
    assert main([str(base), str(slow), "--thresholds", str(tmp_path / "small.toml")]) == 1


def test_markdown_goes_to_file_and_job_summary(runs, tmp_path: Path, monkeypatch) -> None:
    base, slow, _ = runs
    summary = tmp_path / "step_summary.md"
    summary.write_text("earlier step\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    main([str(base), str(slow), "--markdown", str(tmp_path / "out.md")])
    table = (tmp_path / "out.md").read_text()
    assert "| benchmark |" in table and "**Regression**" in table
    assert summary.read_text() == "earlier step\n" + table


def test_benchmarks_in_one_run_only_are_listed_not_judged(runs, tmp_path: Path) -> None:
    base = json.loads(runs[0].read_text())
    cand = run_json({"test_same": sample(seed=5), "test_new": sample()})
    verdicts, notes = compare_runs(base, cand, Thresholds())
    assert [v.name for v in verdicts] == ["test_same"]
    assert any("test_slow" in n for n in notes) and any("test_new" in n for n in notes)


# ---- bench/conftest.py --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bench_conftest():
    spec = importlib.util.spec_from_file_location("bench_conftest", ROOT / "bench" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MACHINE_KEYS = {"hardware_id", "cpu_model", "cpu_cores", "gpu_name", "gpu_count", "gpu_driver", "pcie_gen",
                "pcie_width", "torch_version", "cuda_version", "deepspeed_version", "git_commit"}


def test_machine_info_hook_adds_the_hardware_facts(bench_conftest, monkeypatch) -> None:
    env = {"hardware_id": "nvidia-h100x1-pcie5", "cpu": {"model": "AMD EPYC", "allowed_cores": 32},
           "torch": {"version": "2.13.0", "cuda": "12.8"}, "deepspeed": {"version": "0.19.8"},
           "git": {"commit": "c0ffee", "dirty": False},
           "nvml": {"available": True, "driver": "570.1", "devices": [
               {"name": "NVIDIA H100", "pcie_gen": 1, "pcie_width": 16, "pcie_gen_max": 5, "pcie_width_max": 16}]}}
    monkeypatch.setattr(bench_conftest, "_ENV", {})
    monkeypatch.setattr(bench_conftest, "capture_environment", lambda: env)
    info = {"cpu": {"brand_raw": "kept"}}
    bench_conftest.pytest_benchmark_update_machine_info(None, info)
    assert MACHINE_KEYS <= set(info) and info["cpu"] == {"brand_raw": "kept"}
    assert (info["gpu_name"], info["gpu_driver"], info["pcie_gen"], info["pcie_width"]) == ("NVIDIA H100", "570.1",
                                                                                            5, 16)
    assert (info["hardware_id"], info["git_commit"], info["cuda_version"]) == ("nvidia-h100x1-pcie5", "c0ffee", "12.8")
    assert set(info["load_average"]) == {"start", "end"}  # how busy the machine was


def test_machine_info_hook_on_this_machine(bench_conftest, monkeypatch) -> None:
    from zenflow.telemetry.environment import capture_environment

    monkeypatch.setattr(bench_conftest, "_ENV", {})
    info: dict = {}
    bench_conftest.pytest_benchmark_update_machine_info(None, info)
    assert MACHINE_KEYS <= set(info) and info["hardware_id"] == capture_environment()["hardware_id"]
    assert info["cpu_cores"] >= 1 and info["torch_version"]


def test_storage_is_kept_per_hardware_id_unless_given(bench_conftest, monkeypatch) -> None:
    monkeypatch.setattr(bench_conftest, "_ENV", {"hardware_id": HW})
    monkeypatch.delenv("ZENFLOW_BENCH_NO_SAVE", raising=False)

    def option(**kw):
        return SimpleNamespace(**{"benchmark_storage": bench_conftest.DEFAULT_STORAGE, "benchmark_disable": False,
                                  "benchmark_save": None, "benchmark_autosave": None, "benchmark_save_data": False,
                                  **kw})

    opt = option()
    bench_conftest.configure_benchmark_options(opt)
    assert (opt.benchmark_storage, opt.benchmark_save_data) == (f"file://./.benchmarks/{HW}", True)
    assert opt.benchmark_autosave
    given = option(benchmark_storage="file:///srv/bench", benchmark_save="nightly")
    bench_conftest.configure_benchmark_options(given)
    assert (given.benchmark_storage, given.benchmark_autosave) == ("file:///srv/bench", None)
    smoke = option(benchmark_disable=True)
    bench_conftest.configure_benchmark_options(smoke)
    assert (smoke.benchmark_storage, smoke.benchmark_autosave) == (bench_conftest.DEFAULT_STORAGE, None)


# ---- .github/workflows/gpu-bench.yml ------------------------------------------------------------------------------
def make_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z0-9_.-]+):", (ROOT / "Makefile").read_text(), flags=re.M))


def test_workflow_parses_and_names_only_what_exists() -> None:
    flow = yaml.safe_load((ROOT / ".github" / "workflows" / "gpu-bench.yml").read_text())
    job = flow["jobs"]["bench"]
    assert job["runs-on"] == ["self-hosted", "gpu"]
    scripts = "\n".join(step.get("run", "") for step in job["steps"])
    targets = set(re.findall(r"\bmake\s+(?:-\S+\s+)*([a-z][\w-]*)", scripts))
    assert {"install", "bench-compare"} <= targets and targets <= make_targets()
    modules = set(re.findall(r"python -m ([\w.]+)", scripts))
    assert "zenflow.bench_compare" in modules or "bench-compare" in targets
    assert all(importlib.util.find_spec(m) for m in modules), modules
    for script in set(re.findall(r"(\.ci/[\w.-]+)", scripts)):
        assert os.access(ROOT / script, os.X_OK), script
    for path in set(re.findall(r"\b(bench/[\w./-]*)", scripts)):
        assert (ROOT / path).exists(), path
