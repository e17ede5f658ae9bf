"""The differential check's CPU part (zenflow/harness/checks/differential.py): maxima reported
separately
for column params, dense params and losses; host updates and moved columns counted per run; the stress case; the
verdict, which fails on a negative control that passes. The CUDA-vs-CPU comparison itself and its races:
tests/harness/checks/test_cuda_differential.py; the negative controls run on CUDA only, inside `make gpu-check`."""

from __future__ import annotations

import torch

from zenflow.harness.checks import differential as d
from zenflow.harness.checks.verdict import control
from zenflow.link import Link

STEPS = 8


def test_maxima_are_reported_per_kind():
    ref = {"net.0.weight": torch.ones(4, 3), "net.1.weight": torch.ones(4), "<losses>": torch.ones(5)}
    dense_off = ref | {"net.1.weight": ref["net.1.weight"] + 2**-20}  # ~1e-6: 1% of the tolerance at 1.0
    res = d.compare(ref, dense_off)
    assert res["ok"] and res["worst"] == "net.1.weight"
    assert res["by_kind"]["dense"]["max_ratio"] > 0 and res["by_kind"]["dense"]["worst"] == "net.1.weight"
    assert res["by_kind"]["column"]["max_ratio"] == res["by_kind"]["losses"]["max_ratio"] == 0.0
    column_off = dense_off | {"net.0.weight": ref["net.0.weight"].clone().index_fill_(1, torch.tensor([2]), 1.1)}
    res = d.compare(ref, column_off)
    assert not res["ok"] and res["by_kind"]["column"]["elements_outside"] == 4
    assert res["by_kind"]["dense"]["elements_outside"] == 0 and res["worst"] == "net.0.weight"
    assert d.row_problems(d.case_row("c", ("cpu", "cpu"), 1, d.Trained(ref, 1, 0), d.Trained(column_off, 1, 0))) == [
        "c: outside tolerance (column)"]


def test_a_run_counts_its_host_updates_and_the_columns_it_moved():
    block, clipping, _ = d.CASES["ref-zenflow-sync"]  # topk 0.25, U 3, warm-up 2, reselection at steps 2 and 8
    run = d.train_run("cpu", block, clipping, steps=9)
    # warm-up: 2 host updates; boundaries at steps 4 and 7 (U 3 from the selection at step 2); step 8 (after the
    # reselection, which found nothing left to drain) accumulates once more, and close() applies it
    assert run.host_updates == 2 + 2 + 1
    # first selection at step 2: k = 24 + 48 + 48 columns leave the host; the one at step 8 moves more
    assert run.columns_moved > 120 and d.train_run("cpu", block, clipping, steps=8).columns_moved == 120
    block, clipping, _ = d.CASES["ref-offload"]
    offload = d.train_run("cpu", block, clipping, steps=STEPS)
    assert (offload.host_updates, offload.columns_moved) == (STEPS, 0)  # every step, nothing ever selected


def test_the_cpu_self_check_reports_every_case_with_its_paths():
    check, rows = d.differential_check(cuda=False, steps=STEPS)
    assert check["status"] == "not checked" and "exactly equal" in check["reason"]
    assert [r["case"] for r in rows] == [*d.CASES, d.STRESS]
    stress = rows[-1]
    assert stress["clipping"] == 0.0 and stress["backlog_cycles"] == 0  # no spin kernel without CUDA
    assert all(r["host_updates"][0] == r["host_updates"][1] > 0 for r in rows)
    assert {r["case"]: r["columns_moved"][0] > 0 for r in rows} == {
        "ref-offload": False, "ref-zenflow-sync": True, "ref-zenflow-overlap": True, "ref-zenflow-da-overlap": True,
        d.STRESS: True}
    assert {r["case"]: r["accumulate_on"] for r in rows} == {name: case[2] for name, case in d.CASES.items()} | {
        d.STRESS: "host"}
    assert [c["outcome"] for c in check["controls"]] == ["not run"] * len(d.CONTROLS)


def test_the_verdict_needs_every_case_inside_the_tolerance_on_the_same_paths_and_every_control_failed():
    ref = {"w": torch.ones(2, 2), "<losses>": torch.ones(2)}
    good = d.case_row("a", ("cuda", "cpu"), 2, d.Trained(ref, 3, 4), d.Trained(ref, 3, 4))
    failed = [control("upload without compute.wait_event", True, "x")]
    assert d.differential_verdict([good], failed)["status"] == "pass"
    res = d.differential_verdict([good], failed + [control("gather without record_stream", False, "y")])
    assert res["status"] == "fail" and res["reason"] == "negative control passed: gather without record_stream"
    other_path = d.case_row("a", ("cuda", "cpu"), 2, d.Trained(ref, 3, 4), d.Trained(ref, 2, 4))
    res = d.differential_verdict([other_path], failed)
    assert res["status"] == "fail" and "host updates differ (3 vs 2)" in res["reason"]
    assert d.self_check_verdict([other_path], [])["status"] == "fail"


def test_the_self_check_fails_on_cpu_runs_that_differ_even_within_the_tolerance():
    """CPU vs CPU must be bit-identical: 1e-6 apart on the same paths is inside the tolerance (row_problems finds
    nothing), and is still the non-determinism the self-check exists to report."""
    ref = {"w": torch.ones(2, 2), "<losses>": torch.ones(2)}
    apart = d.case_row("a", ("cpu", "cpu"), 2, d.Trained(ref, 3, 4), d.Trained(ref | {"w": ref["w"] + 1e-6}, 3, 4))
    assert apart["ok"] and d.row_problems(apart) == []
    res = d.self_check_verdict([apart], [])
    assert res["status"] == "fail" and "NOT equal: the CPU run is not deterministic" in res["reason"]
    equal = d.case_row("a", ("cpu", "cpu"), 2, d.Trained(ref, 3, 4), d.Trained(dict(ref), 3, 4))
    assert d.self_check_verdict([equal], [])["status"] == "not checked"


def test_a_broken_link_method_is_replaced_for_one_run_only():
    original = Link.scatter_to_device
    try:
        with d.broken_link("scatter_to_device", d._scatter_without_wait):
            assert Link.scatter_to_device is d._scatter_without_wait
            raise RuntimeError("the run failed")
    except RuntimeError:
        pass
    assert Link.scatter_to_device is original
    assert {method for method, _ in d.CONTROLS.values()} == {"scatter_to_device", "gather_to_host"}


def test_the_gpu_path_runs_every_case_and_both_controls(monkeypatch):
    """differential_check(cuda=True) with "cuda" runs made on the CPU and the Link left intact: the wiring a GPU
    host runs first. Nothing races on the CPU, so both controls pass, and that fails the check."""
    real, broken, seen = d.train_run, d.broken_link, []

    def on_cpu(device, *args, **kwargs):
        seen.append((device, kwargs.get("backlog_cycles", 0)))
        return real("cpu", *args[:3], widths=d.SMALL_WIDTHS, accumulate_on=kwargs.get("accumulate_on", "host"))

    monkeypatch.setattr(d, "train_run", on_cpu)
    monkeypatch.setattr(d, "broken_link", lambda method, variant: broken(method, getattr(Link, method)))
    check, rows = d.differential_check(cuda=True, steps=4)
    assert [r["case"] for r in rows] == [*d.CASES, d.STRESS] and rows[0]["devices"] == "cuda vs cpu"
    assert rows[-1]["widths"] == list(d.STRESS_WIDTHS) and rows[-1]["backlog_cycles"] == d.BACKLOG_CYCLES
    assert ("cuda", d.BACKLOG_CYCLES) in seen and seen.count(("cuda", 0)) == len(d.CASES) + len(d.CONTROLS)
    assert check["status"] == "fail" and [c["outcome"] for c in check["controls"]] == ["passed", "passed"]
    assert check["reason"].count("negative control passed") == 2
    assert [r["case"] for r in check["control_rows"]] == [f"control: {name}" for name in d.CONTROLS]
