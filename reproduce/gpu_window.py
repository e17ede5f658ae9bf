"""GPU evidence in one command: the phases of PHASES (facts, gpu-check's checks, the host's ceiling, the
Llama-2-7B-layer scenario, ...) under one deadline, packed after every phase into <out>/gpu-evidence.tar.gz
(docs/gpu-window.md).

A borrowed GPU host gives one command of at most 10 minutes, no network, no make, no venv, and back only a folder
of at most 8 files. This command runs there with the host's own python, installs the wheels `make gpu-wheels` put
in .whl/ into a temporary site when DeepSpeed is not importable, and spends its budget in order of value: the rows
of PHASES, in order, each timed and recorded in phases.json (docs/gpu-window.md says what each does).

    ZENFLOW_GIT_COMMIT=<sha> python3 reproduce/gpu_window.py --out $OUT            # on the GPU host (590 s command)
    python reproduce/gpu_window.py --publish gpu-evidence.tar.gz                   # here: into results/, claims
    python reproduce/gpu_window.py --rehearsal --out build/rehearsal --budget-s 90 # the CPU dress rehearsal

Exit status: 0 every phase ran; 1 a phase failed; CUT_EXIT (3) none failed, one was cut for time; 143 SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a bare script with the host's python

from zenflow.harness import cli  # noqa: E402
from zenflow.harness.checks.gpu import CHECKS as GPU_CHECKS  # noqa: E402
from zenflow.harness.configs import GPU_WINDOW_ENGINES  # noqa: E402
from zenflow.harness.engines.registry import is_deepspeed  # noqa: E402
from zenflow.harness.preflight import stale_build_locks, torch_extensions_dir  # noqa: E402
from zenflow.harness.window import CUT, Phase, Window, WindowClosed  # noqa: E402
from zenflow.telemetry.environment import git_commit  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / ".whl"
# One site for the set, in the git-ignored build/ a warm machine keeps: a --resume finds it and DeepSpeed's op build
# (whose build line holds the site's paths) is not redone
SITE = ROOT / "build" / "site"
# A 590 s command: the phases end by 540 s; a child still running then gets SIGTERM and 20 s to write its records,
# and the last pack takes seconds.
BUDGET_S = 540
# 4 layers by default: the core five engines take an estimated 3.2-5.6 min at 4 layers on one H100, beside ~2 min of
# checks, op build and ceiling (estimated on 2026-11-27: docs/history.md, "The GPU window in one command"); 8 layers
# cost ~1.5x per run and would leave the core five cut.
LAYERS = 4
ENGINES = list(GPU_WINDOW_ENGINES)  # in its order (configs.py says why)
CHECKS = ",".join(c.name for c in GPU_CHECKS if c.window)  # gpu-check's, as its rows say
PROBE_DS = "import deepspeed, hjson, pydantic"  # the real imports: a half-installed package passes find_spec
PROBE = PROBE_DS + ", mistral_common"  # all the set brings: the Llama tokenizer's file too (else: UTF-8 bytes)
NEWER_IS_FINE = ("typing-extensions",)  # a backport: a newer one serves everything an older one does
OP_BUILD = ("from deepspeed.accelerator import get_accelerator; "
            "get_accelerator().create_op_builder('CPUAdamBuilder').load(); print('CPU Adam op ready', flush=True)")
SCENARIO_RESERVE_S = 15  # the scenario's table and figure after its last run, within the deadline
CHECKS_MAX_S = 240  # the checks take 50-100 s on an H100 (estimated): a hung one must not eat the scenario
BUILD_WAIT_S = 90  # after the checks, the op build may hold the scenario this much longer (it started before them)
CUT_EXIT = 3  # the window's exit status when a phase was cut for time and none failed
# The lent host's stated memory (128 GiB) less 10%: a microVM's RAM starts small and grows as it is used, so the
# memory plan must not read MemAvailable at the start (the device documentation)
HOST_MEMORY_GIB = 115.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=cli.out_folder, help="the folder that comes back: gpu-evidence.tar.gz and run.log")
    ap.add_argument("--budget-s", type=cli.int_at_least(30), default=BUDGET_S,
                    help=f"seconds every phase must end within (default {BUDGET_S}, for a 590 s command)")
    ap.add_argument("--layers", type=cli.int_at_least(1), default=LAYERS,
                    help=f"Llama-2-7B layers (default {LAYERS}: the core five fit beside the checks on one H100)")
    ap.add_argument("--host-memory-gib", type=cli.float_at_least(0, strict=True), default=None,
                    help=f"the memory the scenario's plan may use (default {HOST_MEMORY_GIB:g}: the lent host's "
                    "stated 128 GiB less 10%%; the rehearsal: what this host has available)")
    ap.add_argument("--resume", action="store_true",
                    help="a second command on the same warm machine: keep the finished runs, run what was cut")
    ap.add_argument("--rehearsal", action="store_true",
                    help="the CPU dress rehearsal: the same phases at a tiny shape (make test runs it)")
    ap.add_argument("--publish", type=cli.existing_file, metavar="TARBALL",
                    help="here, after the window: check the archive, put its sets into results/ and remake the claims")
    ap.add_argument("--into", type=cli.out_folder, default=None,
                    help="with --publish: this folder instead of results/ (a cpu-scale set is refused only there)")
    ap.add_argument("--replace", action="store_true",
                    help="with --publish: clear a set already published for this hardware first (never merged)")
    ap.add_argument("--work", type=cli.out_folder, default=ROOT / "build" / "gpu-window",
                    help="where the phases write before packing (default build/gpu-window; --resume reuses it)")
    args = ap.parse_args(argv)
    if args.publish is None and args.out is None:
        ap.error("argument --out: required (expected the folder that comes back), or --publish TARBALL")
    if (args.into or args.replace) and not args.publish:
        ap.error(f"argument {'--into' if args.into else '--replace'}: only with --publish")
    if args.host_memory_gib is None and not args.rehearsal:
        args.host_memory_gib = HOST_MEMORY_GIB
    return args


# ---- what the phases do -------------------------------------------------------------------------------------------
def child_env(site: Path | None) -> dict[str, str]:
    """The children's environment: this checkout (and the wheels' site) first on the path, output unbuffered, no
    hub, DeepSpeed's op cache in the checkout."""
    path = [str(site)] if site else []
    path += [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    # this interpreter's folder first: its `ninja` (DeepSpeed's op build) even when python3 was called by its path
    tools = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
            "TORCH_EXTENSIONS_DIR": str(torch_extensions_dir()), "PATH": tools}


def probe(env: dict[str, str], imports: str = PROBE) -> str | None:
    """None when `imports` (DeepSpeed and the tokenizer's package) run in a child with `env`; else the error's last
    line."""
    try:
        done = subprocess.run([sys.executable, "-c", imports], env=env, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:  # an answer, not the end of the window
        return "the import probe took over 120 s"
    return None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["?"])[-1]


def install_wheels(w: Window) -> tuple[Path | None, bool]:
    """The .whl/ set in a temporary site when the probe fails (and a set is here); the site, or None, and whether
    the probe passed (DeepSpeed imports: its op build may start at once, with no probe of its own)."""
    began, missing = time.monotonic(), probe(child_env(None))
    if missing is None:
        w.record("wheels", time.monotonic() - began, "ok", installed=False, note="DeepSpeed imports as installed")
        return None, True
    if not (WHEELS / "requirements.txt").is_file():
        w.record("wheels", time.monotonic() - began, "failed", installed=False,
                 note=f"{missing}; no {WHEELS.name}/ set here (make gpu-wheels): ds engines dropped")
        return None, False
    site = SITE
    if site.is_dir() and probe(child_env(site)) is None:  # a warm machine's --resume: same paths, same op build
        w.record("wheels", time.monotonic() - began, "ok", installed=False, before=missing,
                 note=f"the set's site of an earlier window imports: reused ({site})")
        return site, True
    shutil.rmtree(site, ignore_errors=True)
    site.mkdir(parents=True)
    lines = (WHEELS / "requirements.txt").read_text().splitlines()
    wanted = site / "requirements.txt"  # in the site's folder: pip installs packages, not this file, there
    wanted.write_text("\n".join(requirements_here(lines, installed_version)) + "\n")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--find-links",
           str(WHEELS), "--target", str(site), "-r", str(wanted)]
    code = w.run(cmd, timeout_s=max(w.left(), 1))
    still = probe(child_env(site)) if code == 0 else f"pip exit {code}"
    w.record("wheels", time.monotonic() - began, "ok" if still is None else "failed", installed=code == 0,
             before=missing, after=still or "imports")
    return site, still is None


def requirements_here(lines: list[str], installed: Callable[[str], str | None]) -> list[str]:
    """The set's requirement lines, less a backport (NEWER_IS_FINE) the image already has at the set's version or
    newer: the set's site comes first on every child's path and would shadow the image's newer one.
    Every other package is installed at the set's version, what the tests here ran."""
    from packaging.version import Version

    kept = []
    for line in lines:
        name, _, version = line.partition("==")
        have = installed(name.strip()) if name.strip().lower().replace("_", "-") in NEWER_IS_FINE else None
        if have and version and Version(have) >= Version(version.strip()):
            continue
        kept.append(line)
    return kept


def installed_version(package: str) -> str | None:
    """The version this interpreter's image has of `package`, or None."""
    import importlib.metadata

    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def facts(w: Window, env: dict[str, str]) -> str:
    """facts/: nvidia-smi -q, pip list, environment.json, facts.json; the hardware id."""
    began, folder = time.monotonic(), w.work / "facts"
    folder.mkdir(exist_ok=True)
    smi = shutil.which("nvidia-smi")
    if smi:
        (folder / "nvidia-smi.txt").write_text(_output([smi, "-q"]))
    (folder / "pip-list.txt").write_text(_output([sys.executable, "-m", "pip", "list"], env))
    capture = ("import json, sys; from zenflow.telemetry.environment import capture_environment; "  # DeepSpeed
               "env = capture_environment(); f = open(sys.argv[1], 'w'); json.dump(env, f, indent=1, default=str)")
    (folder / "environment.log").write_text(  # logs to stdout: the record goes to its own file
        _output([sys.executable, "-c", capture, str(folder / "environment.json")], env))
    try:
        hardware = json.loads((folder / "environment.json").read_text())["hardware_id"]
    except (OSError, ValueError, KeyError):  # the capture child died before writing it: the checks still run
        hardware = None
    shm, tmp = (shutil.disk_usage(p) if os.path.isdir(p) else None for p in ("/dev/shm", tempfile.gettempdir()))
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
    found = {"hardware_id": hardware, "day": time.strftime("%Y-%m-%d", time.gmtime()),
             "utc_start": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - w.elapsed())),
             "commit": w.info["commit"], "layers": w.info["layers"], "python": platform.python_version(),
             "cores": os.cpu_count(), "cores_usable": len(os.sched_getaffinity(0)),
             "mem_total": meminfo.get("MemTotal", "").strip(), "mem_available": meminfo.get("MemAvailable", "").strip(),
             "shm_gib": shm and round(shm.total / 2**30, 1), "shm_free_gib": shm and round(shm.free / 2**30, 1),
             "tmp_free_gib": tmp and round(tmp.free / 2**30, 1), "make": shutil.which("make"), "nvidia_smi": smi,
             "budget_s": round(w.end - w.began), "argv": sys.argv[1:]}
    (folder / "facts.json").write_text(json.dumps(found, indent=1) + "\n")
    w.info["hardware_id"] = hardware
    w.record("facts", time.monotonic() - began, "ok" if hardware else "failed", hardware_id=hardware)
    return hardware


def _output(cmd: list[str], env: dict[str, str] | None = None) -> str:
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{cmd[0]}: {exc}\n"
    return done.stdout + (f"\n(exit {done.returncode}) {done.stderr[-2000:]}" if done.returncode else "")


def two_cores() -> None:
    """The op build's cores: the last two this process may use, so the checks keep the rest."""
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, cores[-2:])


def checks_cmd(args: argparse.Namespace, w: Window) -> list[str]:
    return [sys.executable, str(ROOT / "reproduce" / "gpu_check.py"), "--checks", CHECKS,
            "--out", str(w.work / "gpu-check"), *(["--smoke"] if args.rehearsal else [])]


def ceiling_cmd(args: argparse.Namespace, scenario: Path) -> list[str]:
    return [sys.executable, "-m", "zenflow.costmodel.host_ceiling", "--out", str(scenario),
            *(["--numel", str(2**20)] if args.rehearsal else [])]


def scenario_cmd(args: argparse.Namespace, scenario: Path, engines: list[str], deadline_s: float) -> list[str]:
    shape = ["--smoke", "--device", "cpu", "--repeats", "1"] if args.rehearsal else [
        "--shape", "llama2-7b", "--layers", str(args.layers)]
    return [sys.executable, str(ROOT / "reproduce" / "llama7b.py"), *shape, "--engines", *engines,
            "--out", str(scenario), "--deadline-s", f"{max(deadline_s, 1):.0f}",  # llama7b refuses "0"
            *(["--host-memory-gib", f"{args.host_memory_gib:g}"] if args.host_memory_gib else []),
            *(["--resume"] if args.resume else [])]


def scenario_name(args: argparse.Namespace) -> str:
    return "smoke" if args.rehearsal else f"llama2-7b-{args.layers}L"


# ---- the table of phases ------------------------------------------------------------------------------------------
@dataclass
class State:
    """What the phases share and set as they go: the children's environment, whether DeepSpeed is usable, the op
    build running in the background, and the engines left for the scenario."""

    args: argparse.Namespace
    w: Window
    scenario: Path
    commit: str | None
    env: dict[str, str] = field(default_factory=dict)
    ds_ok: bool = False
    build: subprocess.Popen | None = None
    build_began: float = 0.0
    engines: list[str] = field(default_factory=lambda: list(ENGINES))


def wheels(s: State) -> None:
    """The wheels' site when DeepSpeed does not import, the children's environment, and DeepSpeed's op build started
    at once in the background, beside the facts and the checks."""
    site, imports = install_wheels(s.w)
    s.env = {**child_env(site), **({"ZENFLOW_GIT_COMMIT": s.commit} if s.commit else {})}
    s.ds_ok = imports or probe(s.env, PROBE_DS) is None  # the wheels' probe said so: no third import
    s.build = s.w.start([sys.executable, "-c", OP_BUILD], s.w.work / "op-build.log", {**s.env, "MAX_JOBS": "2"},
                        two_cores) if s.ds_ok else None
    s.build_began = time.monotonic()


def op_build(s: State) -> None:
    """The op build's end (wait_for_build); without it the ds engines leave the scenario's list."""
    s.ds_ok = s.ds_ok and wait_for_build(s.w, s.build, s.build_began)
    if not s.ds_ok:
        s.w.say("DeepSpeed unusable here (see phases.json): its engines dropped: "
                + " ".join(e for e in s.engines if is_deepspeed(e)))
        s.engines = [e for e in s.engines if not is_deepspeed(e)]


PHASES = (
    # a failed install drops the ds engines (op_build says so): the window goes on, and does not fail for it
    Phase("wheels", step=wheels, fails_window=False),
    Phase("facts", step=lambda s: facts(s.w, s.env)),
    Phase("checks", command=lambda s: checks_cmd(s.args, s.w), cap_s=CHECKS_MAX_S, ok=(0, 1),  # 1: a check failed
          done=lambda s: _complete(s.w.work / "gpu-check" / "gpu-check.json"),
          facts=lambda s, code: {"note": "exit 1: a check failed (see gpu-check/table.md)" if code == 1 else None}),
    Phase("op-build", step=op_build),
    Phase("ceiling", command=lambda s: ceiling_cmd(s.args, s.scenario), cap_s=60,
          done=lambda s: (s.scenario / "host" / "rates.json").is_file()),
    # no `done`: llama7b.py's own --resume keeps the finished runs
    Phase("scenario", command=lambda s: scenario_cmd(s.args, s.scenario, s.engines, s.w.left() - SCENARIO_RESERVE_S),
          watch=lambda s: s.scenario, facts=lambda s, code: {"engines": s.engines, **fixed_seconds(s.scenario)}),
)


def window(args: argparse.Namespace) -> int:
    """Every phase under one deadline; 0 when every phase ran (runs cut for time are not a failure), CUT_EXIT
    when a phase was cut for time and none failed, 1 when one failed."""
    work = args.work
    if not args.resume and work.exists():
        shutil.rmtree(work)  # a fresh window: nothing of an earlier one in the archive
    commit = git_commit()
    scenario = work / scenario_name(args)
    w = Window(work, args.out, args.budget_s, {"commit": commit, "scenario": scenario.name,
                                               "rehearsal": args.rehearsal, "layers": args.layers})
    status = "ok"
    try:
        state = State(args, w, scenario, commit)
        for phase in PHASES:
            w.run_phase(phase, state, state.env, args.resume)
    except (WindowClosed, KeyboardInterrupt) as exc:  # SIGTERM (the device's limit), Ctrl-C
        status = f"stopped ({exc or 'Ctrl-C'})"
        return_code = 143 if isinstance(exc, WindowClosed) else 130
    except Exception:  # a bug of ours must not cost the evidence already gathered: say it, pack, exit 1
        w.say("window failed:\n" + traceback.format_exc())
        status, return_code = "failed (traceback in run.log)", 1
    else:
        counted = {p.name for p in PHASES if p.fails_window}
        return_code = exit_status([p["status"] for p in w.phases if p["phase"] in counted])
    w.close(status)
    print(f"evidence: {args.out / 'gpu-evidence.tar.gz'} (+ run.log); publish it here with: python "
          f"reproduce/gpu_window.py --publish gpu-evidence.tar.gz", flush=True)
    return return_code


def fixed_seconds(scenario: Path) -> dict[str, Any]:
    """What the scenario's run children cost besides their steps (process start, imports, model build, set-up:
    records' `fixed_seconds`), per run and in all: the time a window spends on anything but training."""
    from zenflow.harness.records import RecordError, RunRecord

    found = {}
    for folder in (scenario, scenario / ".partial"):  # a staged record is the newer one of its name
        for path in sorted(folder.glob("*.json")):
            try:
                found[path.name] = RunRecord.read(path).metrics.get("fixed_seconds")
            except RecordError:
                continue
    fixed = {name.removesuffix(".json"): round(s, 1) for name, s in found.items() if isinstance(s, (int, float))}
    return {"fixed_s_per_run": fixed, "fixed_s": round(sum(fixed.values()), 1)} if fixed else {}


def exit_status(statuses: list[str]) -> int:
    """The window's exit status: 1 when a phase failed, CUT_EXIT when none failed but one was cut for time (the
    budget, not the code: a cold op build cannot finish in a 60 s budget), else 0."""
    if any(s not in ("ok", CUT) for s in statuses):
        return 1
    return CUT_EXIT if CUT in statuses else 0


def wait_for_build(w: Window, build: subprocess.Popen | None, began: float) -> bool:
    """Wait for the op build (it usually ended during the checks), at most BUILD_WAIT_S more and never past the
    deadline; its time (from its start, so it overlaps the checks' in phases.json) and outcome. A build still
    running then is stopped, its lock removed (the next window would wait on it), and the phase is "cut": the ds
    engines are dropped, the ref engines keep the scenario's time. True when DeepSpeed's CPU Adam is built."""
    if build is None:
        return False
    try:
        build.wait(timeout=max(min(BUILD_WAIT_S, w.left()), 0))
        seconds = _ended(w.work / "op-build.log", began)
    except subprocess.TimeoutExpired:
        build.kill()
        build.wait()
        seconds = time.monotonic() - began
        removed = remove_build_locks()
        w.record("op-build", seconds, CUT, exit=build.returncode, log="op-build.log",
                 note=f"op build not done in {seconds:.0f} s: stopped, ds engines dropped"
                 + (f"; removed {', '.join(removed)}" if removed else ""))
        return False
    ok = build.returncode == 0
    w.record("op-build", seconds, "ok" if ok else "failed", exit=build.returncode, log="op-build.log",
             note="in the background, beside the facts and the checks")
    return ok


def remove_build_locks() -> list[str]:
    """The lock files a stopped op build leaves in the extensions folder (torch's FileBaton): removed, so that the
    next build (a --resume, a run child) does not wait on them forever."""
    removed = []
    for lock, _ in stale_build_locks(older_than_s=-1):  # nothing builds now: every lock is stale
        lock.unlink(missing_ok=True)
        removed.append(str(lock))
    return removed


def _ended(log: Path, began: float) -> float:
    """Seconds from `began` (monotonic) to the last write of the build's log: when the build ended, even if the
    window only looked after the checks."""
    return log.stat().st_mtime - (time.time() - (time.monotonic() - began))


def _complete(record: Path) -> bool:
    try:
        return json.loads(record.read_text()).get("complete") is True
    except (OSError, ValueError):
        return False


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except SystemExit as exc:
        return exc.code
    if args.publish:
        from zenflow.reports.publish import PublishError, publish_window

        try:
            for line in publish_window(args.publish, args.into, args.replace):
                print(line)
        except PublishError as exc:
            return cli.refuse(str(exc))
        if args.into is None:  # the claims page quotes the GPU sets of results/ (zenflow/reports/gpu_claims.py)
            from zenflow.reports import claims

            return claims.main([])
        return 0
    return window(args)


if __name__ == "__main__":
    sys.exit(main())
