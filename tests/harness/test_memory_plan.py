"""The memory plan (zenflow/harness/memory_plan.py): which engines fit a host, and estimates that match what our
engines hold."""

from __future__ import annotations

from dataclasses import replace

import pytest

from zenflow.harness import memory_plan as mp
from zenflow.harness.configs import DEEPSPEED_EXAMPLES_BLOCK, ENGINES, SHAPES
from zenflow.harness.runner import run_in_subprocess

H100_HOST = mp.Host.simulated(126, 80)  # a lent GPU host: one H100 80 GB, ~126 GiB of host memory
BASE = 2 * mp.GiB
LLAMA2_7B = mp.ModelShape(32000, SHAPES["llama2-7b"]["hidden"], SHAPES["llama2-7b"]["intermediate"], 32, 32, 32)


def needs(shape: mp.ModelShape, engines=ENGINES) -> dict[str, mp.Need]:
    return {n.engine: n for n in mp.plan(list(engines), shape, 2, True, DEEPSPEED_EXAMPLES_BLOCK, 512, 1, BASE)}


def test_llama2_7b_parameter_count_is_the_published_one():
    assert LLAMA2_7B.all_params == 6_738_415_616


def test_full_7b_marks_the_offload_engines_that_cannot_fit_a_126_gib_host():
    verdicts = {e: mp.fits(n, H100_HOST) for e, n in needs(LLAMA2_7B).items()}
    for engine in ("ref-offload", "ref-zenflow", "ds-zero-offload", "ds-zero-offload-gas", "ds-zenflow"):
        assert verdicts[engine] and verdicts[engine].startswith("needs ~"), engine
        assert "GiB host" in verdicts[engine] and "126.0 available" in verdicts[engine]
    assert verdicts["no-offload"] is None  # bf16 state on the device, nothing on the host


def test_every_engine_fits_at_eight_layers():
    eight = needs(replace(LLAMA2_7B, layers=8))
    assert {e: mp.fits(n, H100_HOST) for e, n in eight.items()} == {e: None for e in ENGINES}


def test_a_smaller_host_refuses_what_fits_a_larger_one():  # the verdict depends on the host, not on the engine only
    eight = needs(replace(LLAMA2_7B, layers=8), ["ref-zenflow"])["ref-zenflow"]
    assert mp.fits(eight, mp.Host.simulated(20, 80)) is not None
    assert mp.fits(eight, mp.Host.simulated(126, 80)) is None


def test_ours_needs_no_more_host_than_deepspeeds_zenflow_at_7b():
    full = needs(LLAMA2_7B, ["ref-zenflow", "ds-zenflow"])
    assert full["ref-zenflow"].host <= full["ds-zenflow"].host


def test_default_layers_leave_the_margin_and_fit():
    layers = mp.largest_layers(list(ENGINES), LLAMA2_7B, H100_HOST, 2, True, DEEPSPEED_EXAMPLES_BLOCK, 512, 1, BASE,
                               32)
    assert 8 <= layers < 32
    # every engine at the chosen layers keeps DEFAULT_MARGIN free (a count chosen without the margin fails here) ...
    chosen = needs(replace(LLAMA2_7B, layers=layers))
    assert {e: mp.fits(n, H100_HOST, mp.DEFAULT_MARGIN) for e, n in chosen.items()} == {e: None for e in ENGINES}
    over = needs(replace(LLAMA2_7B, layers=layers + 1))
    assert any(mp.fits(n, H100_HOST, mp.DEFAULT_MARGIN) for n in over.values())  # ... and the next one would not


def _need(device: int = 0, pageable: int = 0) -> mp.Need:
    """A Need with only the bytes a verdict reads (times are irrelevant to fits())."""
    return mp.Need("ref-zenflow", device, 0, pageable, step_s=1.0, init_s=1.0)


def test_a_run_may_use_only_the_headroom_of_what_the_host_has_available():
    """HEADROOM (95%): 97 GiB of a 100 GiB host is refused, 94 GiB fits; the rest is the page cache's and the
    parent's."""
    host = mp.Host.simulated(100, 80)
    assert mp.fits(_need(pageable=97 * mp.GiB), host).startswith("needs ~97.0 GiB host (0.0 pinned + 97.0 pageable)")
    assert mp.fits(_need(pageable=94 * mp.GiB), host) is None


def test_a_run_that_needs_more_than_the_device_has_gets_a_device_verdict():
    """A skipped record instead of a child dying of "CUDA error: out of memory": 90 GiB of an 80 GiB GPU is
    refused, 75 GiB (within the 95% headroom) fits, and a CPU device has no device verdict."""
    assert mp.fits(_need(device=90 * mp.GiB, pageable=mp.GiB), H100_HOST) == (
        "needs ~90.0 GiB on the device, 80.0 there")
    assert mp.fits(_need(device=75 * mp.GiB, pageable=mp.GiB), H100_HOST) is None
    assert mp.fits(_need(device=90 * mp.GiB, pageable=mp.GiB), mp.Host.simulated(126, None)) is None


def test_pinned_rounding_is_torchs_power_of_two():
    assert [mp.pow2(n) for n in (1, 2, 3, 1000, 1024, 1025)] == [1, 2, 4, 1024, 1024, 2048]


def test_frozen_embedding_removes_it_from_the_trainable_columns():
    frozen = replace(LLAMA2_7B, layers=8, frozen_embedding=True)
    assert frozen.all_params == replace(LLAMA2_7B, layers=8).all_params
    assert frozen.params == replace(LLAMA2_7B, layers=8).params - 32000 * 4096


def test_cgroup_room(tmp_path):
    (tmp_path / "memory.max").write_text("1000\n")
    (tmp_path / "memory.current").write_text("400\n")
    assert mp._cgroup_room(tmp_path) == 600
    (tmp_path / "memory.max").write_text("max\n")
    assert mp._cgroup_room(tmp_path) is None


# ---- estimates against what our engines hold (cpu-scale, real runs) -------------------------------------------------

@pytest.fixture(scope="module")
def held(tmp_path_factory, run_spec):
    """Our engines on the cpu-scale model (58M parameters), a few steps each, in fresh children like every run."""
    out = tmp_path_factory.mktemp("held")
    workload = {"model": "cpu-scale", "dtype": "bf16", "seq_len": 16, "device": "cpu", "data": "synthetic"}
    records = {}
    for engine in ("ref-offload", "ref-zenflow", "ref-zenflow-da", "no-offload"):
        spec = run_spec(engine, block=DEEPSPEED_EXAMPLES_BLOCK, dtype="bf16", lr=2e-5, weight_decay=0.01,
                        workload=workload, label="plan", warmup_steps=1, timed_steps=4)
        records[engine] = run_in_subprocess(spec, out / f"{engine}.json")
        assert records[engine].status == "ok", records[engine].error
    shape = mp.ModelShape.from_workload(workload)
    base = mp.process_base_bytes(["ref-zenflow"], cuda=False)
    plan = {n.engine: n for n in mp.plan(list(records), shape, 2, False, DEEPSPEED_EXAMPLES_BLOCK, 16, 1, base)}
    return records, plan, shape


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["ref-offload", "ref-zenflow", "ref-zenflow-da"])
def test_host_state_estimate_within_10_percent(held, engine):
    records, _, shape = held
    zenflow = engine != "ref-offload"
    topk = DEEPSPEED_EXAMPLES_BLOCK["topk_ratio"] if zenflow else 0.0
    accumulate_on = "device" if engine == "ref-zenflow-da" else "host"
    pinned, pageable = mp.our_host_bytes(shape, topk, 2, zenflow, False, 0, accumulate_on)
    actual = records[engine].metrics["host_state_bytes"]
    assert abs(pinned + pageable - actual) <= 0.10 * actual, (pinned + pageable, actual)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["ref-offload", "ref-zenflow", "ref-zenflow-da", "no-offload"])
def test_peak_rss_estimate_within_10_percent(held, engine):
    records, plan, _ = held
    actual = records[engine].metrics["peak_rss_bytes"]
    assert abs(plan[engine].host - actual) <= 0.10 * actual, (plan[engine].host / mp.GiB, actual / mp.GiB)


@pytest.mark.slow
def test_a_child_does_not_inherit_its_parents_peak(tmp_path):
    """Negative control of the RSS figures above: ru_maxrss would report a large parent's peak in a fresh child
    (Linux keeps it across fork and exec); peak_rss_bytes (VmHWM) reports the child's own."""
    import subprocess
    import sys

    ballast = bytearray(1 << 30)  # this process: > 1 GiB resident
    ballast[::4096] = b"x" * len(ballast[::4096])
    code = ("import resource; from zenflow.harness.session import peak_rss_bytes; "
            "print(peak_rss_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)")
    own, inherited = map(int, subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                             check=True).stdout.split())
    assert inherited >= mp.GiB  # the measure the records used to take: the parent's peak
    assert own < 0.8 * mp.GiB  # the child's own: imports only
    del ballast


@pytest.mark.slow
def test_an_engine_that_does_not_fit_gets_a_skipped_record_in_seconds(tmp_path):
    """The preflight's negative control: a simulated 1 GiB host skips ref-zenflow without starting a child."""
    import subprocess
    import sys
    import time

    from zenflow.harness.records import read_records

    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "reproduce/llama7b.py", "--smoke", "--device", "cpu", "--engines",
                           "ref-zenflow", "--repeats", "1", "--no-overhead-check", "--host-memory-gib", "0.01",
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert time.perf_counter() - start < 60
    (record,) = read_records(tmp_path / "out")
    assert record.status == "skipped" and record.error.startswith("needs ~")
    assert "does not fit" in (tmp_path / "out" / "table.md").read_text()
