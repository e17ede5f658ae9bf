"""The findings of a fourth reading of the one-command GPU window, each with its CPU twin (docs/history.md, "The GPU
window's hardening (2026-11)"): what the window trusts on a lent host that the CPU rehearsal never meets (a microVM's
growing RAM, a small /dev/shm, a stuck run, a case that raises, a build that never ends, a facts child that dies)."""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from zenflow.harness import memory_plan as mp
from zenflow.harness import plans
from zenflow.harness.configs import DEEPSPEED_EXAMPLES_BLOCK, SHAPES
from zenflow.harness.deadline import OUT_OF_TIME, RUN_FLOOR_S, RUN_SLACK, Deadline
from zenflow.harness.records import RunRecord, read_records
from zenflow.harness.session import RunSpec
from zenflow.harness.window import CUT, Window, memory_now, outcome

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "reproduce"))
import gpu_window  # noqa: E402

CORE = ["ref-zenflow", "ref-offload", "ds-zero-offload", "ds-zenflow", "no-offload"]
H200 = 141 * mp.GiB
LLAMA2_7B_4L = mp.ModelShape(32000, SHAPES["llama2-7b"]["hidden"], SHAPES["llama2-7b"]["intermediate"], 4, 32, 32)


def _window_needs() -> dict[str, mp.Need]:
    return {n.engine: n for n in mp.plan(CORE, LLAMA2_7B_4L, 2, True, DEEPSPEED_EXAMPLES_BLOCK, 512, 1, 2 * mp.GiB)}


def _h200_at_start(monkeypatch: pytest.MonkeyPatch, available_gib: float, shm_gib: float) -> mp.Host:
    """The lent host as it may look at the start: little of its RAM given yet, a /dev/shm sized at boot."""
    monkeypatch.setattr(mp, "_meminfo", lambda key: int(available_gib * mp.GiB))
    monkeypatch.setattr(mp, "_cgroup_room", lambda: None)
    monkeypatch.setattr(mp, "shm_free", lambda path="/dev/shm": int(shm_gib * mp.GiB))
    measured = mp.Host.measure(False)
    return replace(measured, device_total=H200)


# ---- the memory plan on a microVM whose RAM grows as it is used --------------------------------------------------

def test_the_window_plans_from_the_hosts_stated_memory_not_memavailable_at_the_start():
    args = gpu_window.parse_args(["--out", "/tmp/out"])
    assert args.host_memory_gib == gpu_window.HOST_MEMORY_GIB == 115
    command = gpu_window.scenario_cmd(args, Path("/tmp/s"), CORE, 300)
    assert command[command.index("--host-memory-gib") + 1] == "115"
    rehearsal = gpu_window.parse_args(["--out", "/tmp/out", "--rehearsal"])  # the CPU VM: what it has
    assert "--host-memory-gib" not in gpu_window.scenario_cmd(rehearsal, Path("/tmp/s"), CORE, 30)


def test_with_16_gib_available_at_the_start_the_stated_host_still_fits_the_core_five(monkeypatch):
    at_start = _h200_at_start(monkeypatch, available_gib=16, shm_gib=64)
    needs = _window_needs()
    # the negative control: planned from MemAvailable, the comparison is gone before any run
    assert [e for e in CORE if mp.fits(needs[e], at_start)] == ["ref-zenflow", "ref-offload", "ds-zero-offload",
                                                                 "ds-zenflow"]
    stated = mp.Host.stated(gpu_window.HOST_MEMORY_GIB, at_start)
    assert {e: mp.fits(needs[e], stated) for e in CORE} == {e: None for e in CORE}
    assert stated.device_total == H200 and stated.source.startswith("stated host: 115 GiB (MemAvailable 16.0")


def test_deepspeeds_zenflow_is_skipped_when_dev_shm_cannot_hold_its_shared_buffers(monkeypatch):
    stated = mp.Host.stated(gpu_window.HOST_MEMORY_GIB, _h200_at_start(monkeypatch, available_gib=115, shm_gib=4))
    needs = _window_needs()
    shared = 16 * LLAMA2_7B_4L.params  # share_memory_(): fp32 partition, stale copy, two gradient buffers
    assert needs["ds-zenflow"].shm == shared and needs["ds-zenflow"].shm <= needs["ds-zenflow"].pageable
    assert mp.fits(needs["ds-zenflow"], stated) == (f"needs ~{shared / mp.GiB:.1f} GiB in /dev/shm, 4.0 free "
                                                    "there")
    assert all(needs[e].shm == 0 and mp.fits(needs[e], stated) is None for e in CORE if e != "ds-zenflow")
    roomy = mp.Host.stated(115, _h200_at_start(monkeypatch, available_gib=115, shm_gib=64))
    assert mp.fits(needs["ds-zenflow"], roomy) is None


def test_every_phase_says_the_hosts_memory_when_it_ended(tmp_path: Path):
    w = Window(tmp_path / "work", tmp_path / "out", 60, {"commit": None})
    try:
        w.record("facts", 0.1, "ok")
    finally:
        w.close("ok")
    memory = w.phases[0]["memory"]
    assert set(memory) == {"total_gib", "available_gib", "shm_free_gib"}
    assert memory["total_gib"] > 0 and 0 < memory["available_gib"] <= memory["total_gib"]
    assert memory_now()["total_gib"] == memory["total_gib"]


# ---- a stuck run costs its own time only -------------------------------------------------------------------------

def test_a_started_run_may_take_three_times_its_expected_time_at_least_a_minute_never_past_the_deadline():
    d = Deadline(time.time() + 1000, {"short": 10.0, "long": 100.0, "huge": 400.0})
    assert d.run_limit("short") == RUN_FLOOR_S == 60
    assert d.run_limit("long") == pytest.approx(RUN_SLACK * 100) == pytest.approx(300)
    assert d.run_limit("huge") == pytest.approx(1000, abs=2)  # 1200 would pass the deadline
    d.observe("short", 30.0)  # 3x slower than planned: the limits follow the correction
    assert d.run_limit("long") == pytest.approx(3 * 300, abs=2)


def test_a_stuck_run_under_a_deadline_is_stopped_and_the_next_run_starts(tmp_path, monkeypatch):
    """The first run hangs (as DeepSpeed's ZenFlow does for 600 s when its worker dies): stopped at its limit with
    the runner's timeout record, the second runs. Without the limit the hang would last to the window's SIGTERM."""
    limits = {}

    def stuck_then_fine(spec: RunSpec, out: Path, timeout_s: float = 3600) -> RunRecord:
        limits[spec.engine] = timeout_s
        if spec.engine == "ds-zenflow" and timeout_s >= 600:  # the hang outlasts the limit: the window's SIGTERM
            record = RunRecord(engine=spec.engine, status="failed", error="interrupted (KeyboardInterrupt)")
        elif spec.engine == "ds-zenflow":  # what run_in_subprocess writes on its timeout (tests/harness)
            record = RunRecord(engine=spec.engine, status="failed",
                               error=f"timeout after {timeout_s:.0f} s: stopped (SIGTERM, then SIGKILL)")
        else:
            record = RunRecord(engine=spec.engine, status="ok", steps=[{"kind": "update", "period_ms": 100.0}],
                               summary={"cycle_mean_ms": 100.0}, protocol={"telemetry": True})
        record.write(out)
        return record

    monkeypatch.setattr(plans, "run_in_subprocess", stuck_then_fine)
    plan = [plans.PlannedRun(f"{e}.json", RunSpec(engine=e, label="t", workload={}, ds_config={}), estimate_s=20.0)
            for e in ("ds-zenflow", "no-offload")]
    plans.execute(tmp_path / "limited", plan, "cmd", lambda records, out: None, until=time.time() + 500)
    assert limits == {"ds-zenflow": 60.0, "no-offload": pytest.approx(60.0)}
    records = {r.engine: r for r in read_records(tmp_path / "limited" / ".partial")}  # a failed run: staged
    assert records["ds-zenflow"].error.startswith("timeout after 60 s") and records["no-offload"].status == "ok"
    plans.execute(tmp_path / "unlimited", plan, "cmd", lambda records, out: None)  # the control: no deadline
    assert limits["ds-zenflow"] == 3600
    # the deadline's limit, not the run's own: cut for time, an out-of-time skip like a run not started, and the
    # plan is complete (the window's scenario phase is not a failure)
    assert plans.execute(tmp_path / "cut", plan[:1], "cmd", lambda records, out: None, until=time.time() + 30) == 0
    (cut,) = read_records(tmp_path / "cut")
    assert cut.status == "skipped" and cut.error.startswith(f"{OUT_OF_TIME}: stopped at the deadline after 30 s")


def test_the_window_runs_no_offload_before_deepspeeds_zenflow():
    order = gpu_window.ENGINES
    assert order[:3] == ["ref-zenflow", "ref-offload", "ds-zero-offload"]
    assert order.index("no-offload") < order.index("ds-zenflow") < len(CORE)


# ---- one case that raises costs its row, not the check -------------------------------------------------------------

def _raising_on_device_accumulation(real):
    """train_run raising where device accumulation's add and ship run: code no CPU run reaches on CUDA."""
    def train_run(device, block, *args, **kwargs):
        if kwargs.get("accumulate_on") == "device":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real(device, block, *args, **kwargs)
    return train_run


def test_a_case_that_raises_fails_its_own_row_and_the_others_keep_theirs(monkeypatch):
    from zenflow.harness.checks import differential as d

    monkeypatch.setattr(d, "train_run", _raising_on_device_accumulation(d.train_run))
    check, rows = d.differential_check(cuda=False, steps=4)
    assert [r["case"] for r in rows] == [*d.CASES, d.STRESS]  # every case has its row
    crashed = {r["case"]: r for r in rows if "raised" in r}
    assert list(crashed) == ["ref-zenflow-da-overlap"] and not crashed["ref-zenflow-da-overlap"]["ok"]
    assert "illegal memory access" in crashed["ref-zenflow-da-overlap"]["traceback"]
    assert all(r["max_abs"] == 0.0 for r in rows if "raised" not in r)  # the rest compared, exactly equal on CPU
    assert check["status"] == "fail" and check["reason"] == (
        "ref-zenflow-da-overlap: raised RuntimeError: CUDA error: an illegal memory access was encountered")


def test_on_the_gpu_path_a_raising_control_is_a_problem_and_the_other_control_still_runs(monkeypatch):
    from zenflow.harness.checks import differential as d
    from zenflow.link import Link

    real, broken = d.train_run, d.broken_link
    calls = []

    def on_cpu(device, *args, **kwargs):
        calls.append(device)
        if device == "cuda" and len(calls) == 2 * len(d.CASES) + 2 + 1:  # the first control's run
            raise RuntimeError("cudaHostRegister failed")
        return real("cpu", *args[:3], widths=d.SMALL_WIDTHS, accumulate_on=kwargs.get("accumulate_on", "host"))

    monkeypatch.setattr(d, "train_run", on_cpu)
    monkeypatch.setattr(d, "broken_link", lambda method, variant: broken(method, getattr(Link, method)))
    check, rows = d.differential_check(cuda=True, steps=4)
    first, second = d.CONTROLS
    assert [c["outcome"] for c in check["controls"]] == ["not run", "passed"]  # the second still ran
    assert f"negative control {first}: raised RuntimeError: cudaHostRegister failed" in check["reason"]
    assert [r["case"] for r in check["control_rows"]] == [f"control: {first}", f"control: {second}"]
    assert "raised" in check["control_rows"][0] and check["status"] == "fail"


def test_the_differential_figure_marks_a_raised_row(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from zenflow.harness.checks import differential as d
    from zenflow.harness.checks.render import differential_panel

    raised = d.crashed_row("ref-zenflow-da-overlap", ("cuda", "cpu"), 4, RuntimeError("boom"))
    ok = {"case": "ref-offload", "ok": True, "max_ratio": 0.5, "by_kind": {"column": {"max_ratio": 0.5}}, "steps": 4,
          "devices": "cuda vs cpu"}
    fig, ax = plt.subplots()
    differential_panel(ax, [ok, raised])
    assert "raised" in [t.get_text() for t in ax.texts] and "0 (exactly equal)" not in [t.get_text() for t in ax.texts]
    plt.close(fig)


def test_close_gives_the_staging_arenas_page_locking_back_and_a_later_step_takes_it_again(monkeypatch):
    """CPU twin of the CUDA arena: a fake registration records cudaHostRegister/Unregister. Before, the buffer
    stayed page-locked until the optimizer was collected."""
    import torch

    from zenflow import ZenFlowAdamW
    from zenflow import link as link_module

    registered: list[int] = []

    class FakeRegistration:
        def __init__(self, buffer: torch.Tensor) -> None:
            self.ptr = buffer.data_ptr()
            registered.append(self.ptr)

    def fake_release(pinned: list, strict: bool = True) -> None:
        while pinned:
            registered.remove(pinned.pop().ptr)

    monkeypatch.setattr(link_module, "_Registration", FakeRegistration)
    monkeypatch.setattr(link_module, "_release", fake_release)
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8, bias=False)
    opt = ZenFlowAdamW(model.parameters(), lr=1e-3, zenflow={"topk_ratio": 0.25, "update_interval": 2,
                                                            "overlap_step": False})
    opt.arena.link = SimpleNamespace(cuda=True)  # the arena pins as on CUDA; the copies stay the CPU's

    def train(steps: int) -> None:
        for _ in range(steps):
            model(torch.randn(4, 16)).sum().backward()
            opt.step()
            opt.zero_grad()

    train(3)
    assert registered == [opt.arena.buffer.data_ptr()]  # one registration, the arena's buffer
    opt.close()
    assert registered == []  # given back at close, the buffer kept
    train(2)
    assert registered == [opt.arena.buffer.data_ptr()]  # a later step pins it again
    opt.close()
    assert registered == []


# ---- the op build holds the scenario at most BUILD_WAIT_S; a stopped build leaves no lock ------------------------

@pytest.mark.script
def test_a_build_still_running_after_its_wait_is_stopped_its_lock_removed_and_the_phase_cut(tmp_path, monkeypatch):
    extensions = tmp_path / "torch_extensions"
    lock = extensions / "py311_cpu" / "cpu_adam" / "lock"
    lock.parent.mkdir(parents=True)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(extensions))
    monkeypatch.setattr(gpu_window, "BUILD_WAIT_S", 1)
    w = Window(tmp_path / "work", tmp_path / "out", 600, {"commit": None})
    try:
        began = time.monotonic()
        build = w.start([sys.executable, "-c", f"open({str(lock)!r}, 'w'); import time; time.sleep(600)"],
                        w.work / "op-build.log")
        while not lock.exists():  # the build holds torch's lock, as a real one does while it compiles
            time.sleep(0.05)
        assert gpu_window.wait_for_build(w, build, began) is False
        assert time.monotonic() - began < 30 and build.poll() is not None  # stopped, not waited for 600 s
    finally:
        w.close("ok")
    phase = w.phases[0]
    assert phase["phase"] == "op-build" and phase["status"] == CUT
    assert phase["note"].startswith("op build not done in") and "ds engines dropped" in phase["note"]
    assert not lock.exists()  # the next window's build does not wait on it


def test_a_phase_cut_for_time_is_not_a_failure_and_has_its_own_exit_status():
    assert [outcome(c) for c in (0, 1, 124)] == ["ok", "failed", "cut"]
    assert outcome(1, ok=(0, 1)) == "ok"  # the checks: exit 1 is a check that failed, reported
    assert {p.name: p.ok for p in gpu_window.PHASES}["checks"] == (0, 1)  # the checks' row says so
    assert gpu_window.exit_status(["ok", "ok"]) == 0
    assert gpu_window.exit_status(["ok", "cut", "ok"]) == gpu_window.CUT_EXIT == 3
    assert gpu_window.exit_status(["cut", "failed"]) == 1


# ---- a facts child that dies costs the hardware id's first source, not the window ----------------------------------

def test_a_facts_child_that_writes_no_environment_record_does_not_end_the_window(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_window, "_output", lambda cmd, env=None: "(exit 1) CUDA init raised\n")
    w = Window(tmp_path / "work", tmp_path / "out", 60, {"commit": None, "layers": 4})
    try:
        assert gpu_window.facts(w, {}) is None  # before: FileNotFoundError, and the window packed and exited 1
    finally:
        w.close("ok")
    assert w.phases[0]["phase"] == "facts" and w.phases[0]["status"] == "failed"


def test_publish_files_a_window_without_facts_under_the_checks_or_a_runs_hardware_id(tmp_path):
    import json

    from zenflow.reports.publish import hardware_fallback

    work = tmp_path / "work"
    (work / "smoke" / ".partial").mkdir(parents=True)
    assert hardware_fallback(work, "smoke") is None  # nothing names one: publish refuses, in one line
    RunRecord(engine="ref-zenflow", status="ok", environment={"hardware_id": "nvidia-h200-141gb"}).write(
        work / "smoke" / ".partial" / "ref-zenflow-r0.json")
    assert hardware_fallback(work, "smoke") == "nvidia-h200-141gb"
    (work / "gpu-check").mkdir()
    (work / "gpu-check" / "gpu-check.json").write_text(json.dumps({"environment": {"hardware_id": "from-checks"}}))
    assert hardware_fallback(work, "smoke") == "from-checks"  # the checks' record first


def test_a_probe_that_times_out_is_an_answer_and_a_tiny_deadline_is_never_zero(monkeypatch):
    import subprocess

    def slow(*args, **kwargs):
        raise subprocess.TimeoutExpired(args[0], 120)

    monkeypatch.setattr(gpu_window.subprocess, "run", slow)
    assert gpu_window.probe({}) == "the import probe took over 120 s"
    args = gpu_window.parse_args(["--out", "/tmp/out"])
    command = gpu_window.scenario_cmd(args, Path("/tmp/s"), CORE, 0.3)
    assert command[command.index("--deadline-s") + 1] == "1"  # llama7b refuses "0" (exit 2): "failed", not "cut"


# ---- P1-P3: publishing on the CPU side ----------------------------------------------------------------------------

H100_CHECKS = ROOT / "results" / "gpu-check" / "nvidia-h100-80gb-hbm3x1-pcie5" / "gpu-check.json"


def _window_archive(tmp_path: Path, name: str, table: str = "as the host wrote it\n") -> Path:
    """An archive of a window whose checks ran (the committed H100 record) and whose scenario did not."""
    import shutil

    from zenflow.harness.evidence import pack

    work = tmp_path / name / "work"
    (work / "gpu-check").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(H100_CHECKS, work / "gpu-check" / "gpu-check.json")
    (work / "gpu-check" / "table.md").write_text(table)
    archive = tmp_path / name / "gpu-evidence.tar.gz"
    pack(work, archive, {"hardware_id": "nvidia-h200-141gb", "scenario": "llama2-7b-4L", "folder": "work"})
    return archive


def test_a_second_window_is_refused_unless_replace_clears_the_first(tmp_path):
    from zenflow.reports.publish import PublishError, publish_window

    into = tmp_path / "results"
    publish_window(_window_archive(tmp_path, "first"), into)
    (into / "gpu-check" / "nvidia-h200-141gb" / "from-the-first.txt").write_text("x")
    with pytest.raises(PublishError, match="already holds a set .* --replace clears it first"):
        publish_window(_window_archive(tmp_path, "second"), into)
    assert (into / "gpu-check" / "nvidia-h200-141gb" / "from-the-first.txt").exists()  # refused: nothing changed
    publish_window(_window_archive(tmp_path, "second"), into, replace=True)
    assert not (into / "gpu-check" / "nvidia-h200-141gb" / "from-the-first.txt").exists()  # cleared, not merged


def test_the_checks_table_is_made_here_not_copied(tmp_path):
    import json

    from zenflow.harness.checks import gpu
    from zenflow.reports.publish import publish_window

    into = tmp_path / "results"
    publish_window(_window_archive(tmp_path, "w", table="| made | by another tabulate |\n"), into)
    table = (into / "gpu-check" / "nvidia-h200-141gb" / "table.md").read_text()
    assert table == gpu.markdown(json.loads(H100_CHECKS.read_text())) and "another tabulate" not in table


def test_a_set_of_skipped_runs_publishes_with_the_windows_hardware_label(tmp_path):
    from zenflow.harness.memory_plan import NEEDS
    from zenflow.reports.publish import _scenario

    scenario = tmp_path / "llama2-7b-4L"
    scenario.mkdir()
    for engine in ("ref-zenflow", "ref-offload"):
        RunRecord(engine=engine, status="skipped", error=f"{NEEDS}200.0 GiB host").write(scenario / f"{engine}.json")
    facts = {"cpu": {"model": "AMD EPYC 9654", "allowed_cores": 16}, "gpus": []}
    line = _scenario(scenario, tmp_path / "out", facts)  # before: KeyError 'cpu' from the label
    assert "0 ok, 2 skipped or failed of 2 records" in line
    assert "16-core AMD EPYC 9654" in (tmp_path / "out" / "table.md").read_text()
    _scenario(scenario, tmp_path / "bare", {})  # no facts either: said, not a traceback
    assert "unknown CPU" in (tmp_path / "bare" / "table.md").read_text()


# ---- a run child of a ref engine does not import DeepSpeed ----------------------------------------------------------

@pytest.mark.script
def test_a_run_child_of_a_ref_engine_does_not_import_deepspeed(run_spec):
    """2-5 s per run child on the GPU host (estimated): the record still names DeepSpeed's version, from its
    installed metadata. The control: the window's facts capture (the default) does import it."""
    import json
    import os
    import subprocess
    from dataclasses import asdict

    def child(code: str, *args: str) -> dict:
        done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                              cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    spec = json.dumps(asdict(run_spec("ref-offload")))
    session = child("import json, sys; from zenflow.harness.session import RunSpec, Session; "
                    "s = Session(RunSpec(**json.loads(sys.argv[1]))); print(json.dumps({'imported': 'deepspeed' in "
                    "sys.modules, 'ds': s.record.environment['deepspeed']}))", spec)
    assert session["imported"] is False and session["ds"]["version"] == "0.19.8"
    facts = child("import json, sys; from zenflow.telemetry.environment import capture_environment; "
                  "env = capture_environment(); print(json.dumps({'imported': 'deepspeed' in sys.modules, "
                  "'ds': env['deepspeed']}))")
    assert facts["imported"] is True and facts["ds"]["version"] == "0.19.8" and facts["ds"]["accelerator"] == "cpu"


# ---- the set's typing_extensions never shadows a newer one on the image -------------------------------------------

@pytest.mark.parametrize("on_image,installed", [("4.17.0", False), ("4.16.0", False), ("4.15.0", True), (None, True)])
def test_typing_extensions_is_installed_only_where_the_image_has_an_older_one(on_image, installed):
    lines = ["# header", "deepspeed==0.19.8", "typing-extensions==4.16.0", "pydantic==2.14.4"]
    versions = {"typing-extensions": on_image, "deepspeed": "0.20.0", "pydantic": "2.15.0"}
    kept = gpu_window.requirements_here(lines, versions.get)
    assert ("typing-extensions==4.16.0" in kept) is installed
    assert [x for x in kept if "typing" not in x] == ["# header", "deepspeed==0.19.8", "pydantic==2.14.4"]  # pinned


# ---- a --resume on a warm machine reuses the set's site -------------------------------------------------------------

def test_the_sets_site_is_one_folder_and_a_second_window_reuses_it(tmp_path, monkeypatch):
    wheels = tmp_path / ".whl"
    wheels.mkdir()
    (wheels / "requirements.txt").write_text("# header\ndeepspeed==0.19.8\n")
    monkeypatch.setattr(gpu_window, "WHEELS", wheels)
    monkeypatch.setattr(gpu_window, "SITE", tmp_path / "build" / "site")
    installs = []

    def fake_pip(self, cmd, timeout_s, env=None, watch=None, preexec=None):  # pip "installs" deepspeed
        installs.append(cmd)
        (Path(cmd[cmd.index("--target") + 1]) / "deepspeed").mkdir()
        return 0

    monkeypatch.setattr(Window, "run", fake_pip)
    monkeypatch.setattr(gpu_window, "probe", lambda env, imports=gpu_window.PROBE: (
        None if env["PYTHONPATH"].startswith(str(tmp_path / "build" / "site")) and
        (tmp_path / "build" / "site" / "deepspeed").is_dir() else "ModuleNotFoundError: deepspeed"))
    sites = []
    for window in ("first", "resumed"):
        w = Window(tmp_path / window, tmp_path / f"{window}-out", 60, {"commit": None})
        try:
            sites.append(gpu_window.install_wheels(w))
        finally:
            w.close("ok")
    assert sites[0] == sites[1] == (tmp_path / "build" / "site", True)  # before: a new temporary folder each time
    assert len(installs) == 1  # the resumed window found it importing: no pip, and the op build's paths unchanged


# ---- §6: ShardedState's host state stays on the host under a CUDA mesh ----------------------------------------------

def test_sharded_states_dtensors_are_made_on_a_cpu_mesh_over_the_same_ranks(monkeypatch):
    """CPU twin of FSDP2 on CUDA: DTensor.from_local moves its local tensor to its mesh's device type, so the
    assembled host state must be wrapped on a CPU (gloo) mesh of the same ranks, made once. Before: p's CUDA mesh."""
    import torch

    from zenflow import sharded_checkpoint as sc

    groups, wrapped = [], []
    cpu_mesh = SimpleNamespace(device_type="cpu")
    monkeypatch.setattr(sc, "_HOST_MESHES", {})
    monkeypatch.setattr(sc.dist, "new_group", lambda ranks, backend: groups.append((tuple(ranks), backend)) or "pg")
    monkeypatch.setattr(sc.DeviceMesh, "from_group",
                        staticmethod(lambda group, device_type: cpu_mesh if (group, device_type) == ("pg", "cpu")
                                     else pytest.fail(f"{group}, {device_type}")))

    class FakeDTensor:  # FSDP2's parameter on an nccl mesh of two GPUs
        device_mesh = SimpleNamespace(device_type="cuda", mesh=torch.tensor([0, 1]))

        @staticmethod
        def from_local(local, mesh, placements, **kwargs):
            wrapped.append((local.device.type, mesh.device_type))
            return local

    monkeypatch.setattr(sc, "DTensor", FakeDTensor)
    for _ in range(3):
        sc._rows(torch.zeros(2, 4), FakeDTensor(), (4, 4))
    assert wrapped == [("cpu", "cpu")] * 3  # host tensors on a host mesh: nothing copied to the GPU
    assert groups == [((0, 1), "gloo")]  # one gloo group, made once for these ranks
    plain_cpu = SimpleNamespace(device_type="cpu")
    assert sc.host_mesh(plain_cpu) is plain_cpu  # FSDP2 on the CPU (gloo): its own mesh, no new group


# ---- the time a window spends on anything but training ----------------------------------------------------------

def test_the_scenario_phase_says_its_run_childrens_fixed_seconds_and_the_window_each_phases(tmp_path):
    scenario = tmp_path / "smoke"
    (scenario / ".partial").mkdir(parents=True)
    RunRecord(engine="ref-zenflow", metrics={"fixed_seconds": 4.04}).write(scenario / "ref-zenflow-r0.json")
    RunRecord(engine="ref-offload", metrics={"fixed_seconds": 9.0}).write(scenario / "ref-offload-r0.json")
    RunRecord(engine="ref-offload", metrics={"fixed_seconds": 3.0}).write(scenario / ".partial" / "ref-offload-r0.json")
    RunRecord(engine="ds-zenflow", status="skipped").write(scenario / ".partial" / "ds-zenflow-r0.json")
    assert gpu_window.fixed_seconds(scenario) == {"fixed_s_per_run": {"ref-offload-r0": 3.0, "ref-zenflow-r0": 4.0},
                                                  "fixed_s": 7.0}  # the staged record is the newer one
    assert gpu_window.fixed_seconds(tmp_path / "none") == {}
    w = Window(tmp_path / "work", tmp_path / "out", 60, {"commit": None})
    try:
        w.record("facts", 2.96, "ok")
        w.record("op-build", 95.0, "cut")
        assert w.seconds_by_phase() == "facts 3 s, op-build 95 s (cut)"
    finally:
        w.close("ok")


def test_a_memory_run_or_a_pcie_window_that_raises_costs_its_own_verdict(monkeypatch):
    """One case that raises costs its row, for the other two checks: the control's run raising keeps the two peaks and
    fails the check by name; a PCIe window that raises is a failed window with its reason (each window its own), and the
    table still renders."""
    import torch

    from zenflow.harness.checks import memory, pcie, render

    def peak(block, widths, steps, backpressure=True):
        if not backpressure:
            raise RuntimeError("CUDA error: out of memory")
        return 100 * 2**20 if block["overlap_step"] else 90 * 2**20

    monkeypatch.setattr(memory, "window_peak", peak)
    m = memory.memory_check(True, widths=(64,) * 3, steps=4)
    assert m["status"] == "fail" and m["sync_peak_bytes"] == 90 * 2**20 and m["extra_bytes"] == 10 * 2**20
    assert m["reason"].endswith("negative control overlap without backpressure: raised RuntimeError: CUDA error: "
                                "out of memory") and m["controls"][0]["outcome"] == "not run"

    first, second = pcie.WINDOWS
    monkeypatch.setattr(pcie, "torch_pci_bus_ids", lambda: ["0000:01:00.0"])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(pcie, "link_overhead", lambda bus: {"d2h": {}, "h2d": {}})

    def measure(spec, bus, widths, steps):
        raise RuntimeError("NVML read failed mid-window")

    monkeypatch.setattr(pcie, "measure_window", measure)
    p = pcie.pcie_check(True, widths=(64,), steps=2)
    assert set(p["windows"]) == {first, second} and p["status"] == "fail"
    assert p["windows"][first]["reason"] == "raised RuntimeError: NVML read failed mid-window"
    assert p["windows"][second]["reason"] == p["windows"][first]["reason"]  # each window measured on its own
    table = "\n".join(render.pcie_table(p))
    assert first in table and second in table


def test_the_childrens_path_starts_with_this_interpreters_folder(monkeypatch):
    """`ninja` of the interpreter's environment is found by DeepSpeed's op build even when python3
    was called by its absolute path, with that folder nowhere on PATH."""
    import os

    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    path = gpu_window.child_env(None)["PATH"].split(os.pathsep)
    assert path[0] == os.path.dirname(sys.executable) and path[1:] == ["/usr/bin", "/bin"]
