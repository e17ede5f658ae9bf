"""Promises kept pinned: a curated list of one-line mutants of the core promises, from the mutation audits
(docs/mutation-audits.md; docs/history.md, "Promises pinned by mutation"), each applied to a copy of the package and run
against the tests that pin it. Every mutant must be killed: a later change that stops a test from noticing one of them
(a test weakened, deleted or no longer reaching the code) fails here at once, naming the promise.

A small hand-written runner rather than a mutation-testing package (mutmut, cosmic-ray): those generate and run
hundreds of mutants over whole files, minutes to hours; this keeps about twenty chosen ones within about a minute of
`make test`. Each mutant runs in a scratch tree (tmp_path: zenflow/ and tests/ copied, everything else linked), never
in the checkout, so a crash or an interrupted run cannot leave mutated code behind. The control first: the same
tests pass on the unmutated copy (else a "kill" would only be a broken test).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COPIED = ("zenflow", "tests", "reproduce")  # mutated or collected: copies (a test's ROOT is the scratch tree, and a
# mutant of a linked file would be written into the checkout)


@dataclass(frozen=True)
class Mutant:
    id: str  # the audit's id
    path: str  # the file, from the repository root
    old: str  # an exact substring, found exactly once
    new: str
    tests: tuple[str, ...]  # the node ids that pin the promise
    promise: str


HA, OO, ML = "tests/core/test_host_accumulate.py", "tests/core/test_overlapped_offload.py", \
    "tests/telemetry/test_machine_load.py"
DL = "tests/harness/test_deadline.py"
MUTANTS = (  # about twenty of the core promises, each with the fast test that pins it (the audits' ids)
    Mutant("H2", "zenflow/host.py", "for start in range(0, acc.shape[0], rows):",
           "for start in range(0, acc.shape[0] - 1, rows):",
           (f"{HA}::test_clipped_accumulation_rounds_each_element_once",),
           "accumulate_into_ adds clip·src into every element, a block of rows at a time (a 1-row tail too)"),
    Mutant("H3", "zenflow/host.py", "_scratches = threading.local()", '_scratches = type("Shared", (), {})()',
           (f"{HA}::test_the_scratch_is_one_buffer_per_thread",),
           "the rounding scratch is kept per thread (the worker and the trainer accumulate at once)"),
    Mutant("OO1", "zenflow/overlapped_offload.py", "p.grad = None  # the device gradient",
           "pass  # the device gradient", (f"{OO}::test_each_device_gradient_is_dropped_as_it_lands",),
           "the overlapped offload drops each device gradient as soon as its copy lands"),
    Mutant("OO2", "zenflow/overlapped_offload.py",
           "total = torch.linalg.vector_norm(torch.stack([self.host[p].norm for p in self.landed]))",
           "total = torch.stack([self.host[p].norm for p in self.landed]).sum()",
           (f"{OO}::test_equals_torch_adamw_in_fp32",), "clipping uses torch's clip_grad_norm_ coefficient"),
    Mutant("DA6", "zenflow/device_accumulation.py", "acc.add_(block, alpha=scale)", "acc.add_(block)",
           ("tests/harness/checks/test_cuda_differential.py::"
            "test_the_cuda_add_of_device_accumulation_is_the_hosts_accumulation",),
           "device accumulation's CUDA add scales by the clipping coefficient, as the host does"),
    Mutant("ML4", "zenflow/telemetry/machine_load.py", "steal = values[7] if len(values) > 7 else 0",
           "steal = values[8] if len(values) > 7 else 0",
           (f"{ML}::test_outside_and_steal_shares_are_ticks_over_the_machines_ticks",),
           "the hypervisor's steal is /proc/stat's 8th value, and a run is BUSY on it"),
    Mutant("ML5", "zenflow/telemetry/machine_load.py", "BUSY_BOUND = 0.10", "BUSY_BOUND = 0.15",
           (f"{ML}::test_busy_means_over_a_tenth_of_the_machine_elsewhere",),
           "a run with over 10% of the machine used elsewhere is named BUSY"),
    Mutant("IV3", "zenflow/reports/intervals.py", "self.low <= 1.0 <= self.high", "self.low <= 1.0",
           ("tests/reports/test_intervals.py::"
            "test_an_interval_wholly_below_or_above_one_is_a_difference_and_only_one_across_one_is_not",),
           "only an interval that includes 1 reads 'no difference'"),
    Mutant("GC1", "zenflow/reports/glue_curve.py", 'targets = {seed: points[-1]["score"] for',
           'targets = {seed: max(p["score"] for p in points) for',
           ("tests/reports/test_glue_curve.py::test_the_target_is_the_baselines_final_score_not_its_best",),
           "time to accuracy aims at the baseline's final score, not its best"),
    Mutant("MP3", "zenflow/harness/memory_plan.py", "if all(fits(n, host, DEFAULT_MARGIN) is None for n in needs):",
           "if all(fits(n, host) is None for n in needs):",
           ("tests/harness/test_memory_plan.py::test_default_layers_leave_the_margin_and_fit",),
           "the default layer count leaves a quarter of host and device free"),
    Mutant("MC2", "zenflow/harness/checks/memory.py", 'control("overlap without backpressure", control_extra > bound,',
           'control("overlap without backpressure", control_extra > 0,',
           ("tests/harness/checks/test_memory_check.py::"
            "test_a_control_barely_above_sync_cannot_vouch_for_the_bounded_run",),
           "the memory check's control must exceed the bound, or the check cannot vouch"),
    Mutant("DF2", "zenflow/harness/checks/differential.py", 'exact = all(r["max_abs"] == 0.0 for r in rows)',
           'exact = all(r["ok"] for r in rows)',
           ("tests/harness/checks/test_differential_check.py::"
            "test_the_self_check_fails_on_cpu_runs_that_differ_even_within_the_tolerance",),
           "the CPU self-check of the differential passes only when bit-identical"),
    Mutant("D1", "zenflow/harness/deadline.py", "if need <= left:", "if True or need <= left:",
           ("tests/harness/test_deadline.py::test_estimates_are_corrected_by_the_runs_done",),
           "a run starts only when its corrected estimate fits the time left"),
    # round 4 of the mutation audits: survivors of the whole suite, each now pinned by a direct test
    Mutant("DL1", "zenflow/harness/deadline.py",
           "return sum(m for _, m in pairs) / sum(e for e, _ in pairs) if pairs else 1.0",
           "return sum(m / e for e, m in pairs) / len(pairs) if pairs else 1.0",
           (f"{DL}::test_the_correction_is_total_measured_over_total_estimated_seconds",),
           "the deadline's correction is total measured over total estimated seconds, not a mean of ratios"),
    Mutant("EV3", "zenflow/harness/evidence.py", 'tar.extractall(into, filter="data")', "tar.extractall(into)",
           (f"{DL}::test_an_archive_member_outside_the_destination_is_refused_and_not_written",),
           "unpacking a GPU window's archive writes nothing outside its destination"),
    Mutant("CK3", "zenflow/sharded_checkpoint.py",
           'if len(counts) != sum(1 for key in saved if key.startswith("accumulator")):',
           'if False and len(counts) != sum(1 for key in saved if key.startswith("accumulator")):',
           ("tests/core/test_fsdp.py::"
            "test_a_checkpoint_whose_accumulators_do_not_match_its_slots_is_refused_in_one_line",),
           "a DCP checkpoint whose accumulators do not match its slots is refused in one line"),
    Mutant("FS8", "zenflow/fsdp.py", ".requires_grad_(p.requires_grad)", ".requires_grad_(True)",
           ("tests/core/test_fsdp_refusals.py::test_a_frozen_fsdp2_layer_stays_frozen_and_the_rest_trains",),
           "a frozen layer under FSDP2 stays frozen while the others train"),
    Mutant("PB1", "zenflow/reports/publish.py",
           'kept = {name: pr for name, pr in found.items() if not (pr[1].error or "").startswith(INTERRUPTED)}',
           "kept = dict(found)",
           ("tests/reports/test_publish.py::test_interrupted_records_are_left_out_of_what_is_published",),
           "publish leaves out the records of runs interrupted mid-way"),
    Mutant("PB3", "zenflow/reports/gpu_claims.py", 'if not p.parent.parent.name.startswith("cpu-scale"))', "if True)",
           ("tests/reports/test_gpu_claims.py::test_a_set_under_a_cpu_scale_hardware_id_is_not_a_gpu_set",),
           "the claims page's GPU rows never read a cpu-scale set"),
    Mutant("CL1", "zenflow/reports/claim_list.py",
           "return HOLDS if low > 1 else DOES_NOT_HOLD if high < 1 else NO_DIFFERENCE",
           "return HOLDS if low >= 1 else DOES_NOT_HOLD if high <= 1 else NO_DIFFERENCE",
           ("tests/reports/test_claims.py::test_a_speedup_is_judged_by_its_interval",),
           "a claimed speedup whose interval touches 1 is 'no difference'"),
    Mutant("KN5", "reproduce/knobs.py", 'if same and (old.status == "ok" or failed_too):',
           'if (old.status == "ok" or failed_too):',
           ("tests/reproduce/test_knobs.py::"
            "test_a_record_of_another_setting_under_the_runs_name_is_not_this_runs_record",),
           "the knobs study's resume skips a run only for a record of that very run"),
    Mutant("WN1", "reproduce/gpu_window.py", "watch=lambda s: s.scenario,", "watch=None,",
           ("tests/reproduce/test_gpu_window.py::"
            "test_the_scenario_phase_watches_its_folder_and_ends_its_runs_before_the_window",),
           "the GPU window packs its archive as each run record appears (a SIGKILL keeps every run that ended)"),
)


# plugins no pinning test uses, left out of the ~25 pytest starts (hypothesis' alone is ~1.5 s of each on 2 cores);
# a pinning test that needs one fails the control, which names it
UNUSED_PLUGINS = ("-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-p", "no:benchmark", "-p", "no:anyio")


def scratch_tree(tmp: Path) -> Path:
    """A tree that imports and tests like the checkout: zenflow/ and tests/ copied, every other entry linked."""
    tree = tmp / "tree"
    tree.mkdir(parents=True)
    for entry in ROOT.iterdir():
        if entry.name in COPIED:
            shutil.copytree(entry, tree / entry.name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif entry.name not in (".git", ".venv", "build", ".pytest_cache", ".hypothesis", ".ruff_cache"):
            (tree / entry.name).symlink_to(entry)
    return tree


def apply(tree: Path, mutant: Mutant) -> None:
    path = tree / mutant.path
    text = path.read_text()
    assert text.count(mutant.old) == 1, (f"{mutant.id}: {mutant.old!r} occurs {text.count(mutant.old)} times in "
                                         f"{mutant.path}: the code moved; update the mutant (docs/mutation-audits.md)")
    path.write_text(text.replace(mutant.old, mutant.new))


def pytest_in(tree: Path, tests: tuple[str, ...]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": str(tree)}  # the copy before the checkout
    return subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", *UNUSED_PLUGINS, *tests],
                          cwd=tree, env=env, capture_output=True, text=True, timeout=600)


def killed(tmp: Path, mutant: Mutant) -> tuple[Mutant, bool, str]:
    tree = scratch_tree(tmp / mutant.id)
    apply(tree, mutant)
    done = pytest_in(tree, mutant.tests)
    return mutant, done.returncode != 0, (done.stdout + done.stderr)[-1500:]


@pytest.mark.slow
def test_the_scratch_tree_runs_the_copy_not_the_checkout(tmp_path: Path) -> None:
    """The runner's own negative control: a copy whose zenflow/__init__.py raises must fail to import there."""
    tree = scratch_tree(tmp_path)
    (tree / "zenflow" / "__init__.py").write_text("raise ImportError('the scratch copy')\n")
    done = subprocess.run([sys.executable, "-c", "import zenflow"], cwd=tree, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(tree)}, timeout=120)
    assert done.returncode != 0 and "the scratch copy" in done.stderr


@pytest.mark.slow
def test_every_curated_mutant_is_killed_by_the_tests_that_pin_its_promise(tmp_path: Path) -> None:
    pinning = tuple(sorted({t for m in MUTANTS for t in m.tests}))
    with ThreadPoolExecutor(max_workers=2) as pool:  # 2 cores: two at a time, the control first among them
        control = pool.submit(pytest_in, scratch_tree(tmp_path / "control"), pinning)
        results = list(pool.map(lambda m: killed(tmp_path, m), MUTANTS))
    control = control.result()
    assert control.returncode == 0, "the pinning tests fail on unmutated code:\n" + control.stdout[-3000:]
    survivors = [f"{m.id} ({m.path}: {m.old!r} -> {m.new!r}) survived {', '.join(m.tests)}: {m.promise}"
                 for m, dead, _ in results if not dead]
    assert not survivors, "mutants no test notices any more:\n" + "\n".join(survivors)


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.id)
def test_each_mutant_is_still_where_its_promise_is(mutant: Mutant) -> None:
    """Fast and specific: a mutant whose text moved says so here, before the slow run above."""
    assert (ROOT / mutant.path).read_text().count(mutant.old) == 1, f"{mutant.id}: update its text"
    assert all((ROOT / t.split("::")[0]).is_file() for t in mutant.tests)
