"""Bad input to the reproduce scripts is refused before any run: exit status 2, one line on stderr naming the
argument, the value and what is allowed, no traceback, no DeepSpeed or transformers import while parsing, and
nothing written to the output folder. A plan that fails leaves its output folder as it was (records staged in
<out>/.partial/, which only --resume continues).

Every case runs the script as `python reproduce/<script>.py ARGS` would, in a process of its own: a helper
interpreter imports torch and the scripts' modules once, then forks one child per case that runs the script file
as __main__ (runpy) with its own argv, environment and stderr. That keeps ~40 cases to seconds on 2 cores; the
make target and a plain `python reproduce/glue.py` run are tested as separate commands too.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from zenflow.harness.cli import folder_problem
from zenflow.harness.records import RunRecord
from zenflow.harness.result_sets import MARKER, PARTIAL, StagedPlan, same_run

ROOT = Path(__file__).resolve().parents[2]
LLAMA, GLUE, PROJECT, GPU_CHECK = (str(ROOT / "reproduce" / f"{n}.py") for n in ("llama7b", "glue", "project",
                                                                                  "gpu_check"))

# The helper: stdin a JSON list of {"argv": [script, *args], "env": {...}}; stdout a JSON list of {"code",
# "stderr", "imported"} (imported: whether deepspeed / transformers were imported in the child by its exit).
FORK_RUNNER = r"""
import importlib.util, json, os, runpy, sys, tempfile, time, traceback
cases = json.load(sys.stdin)
for i, script in enumerate(sorted({c["argv"][0] for c in cases})):  # import each script's dependencies once
    spec = importlib.util.spec_from_file_location(f"_warm{i}", script)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
heavy = ("deepspeed", "transformers")
assert not any(m in sys.modules for m in heavy), "a script imports deepspeed/transformers at import time"
results = []
for case in cases:
    err, seen = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    pid = os.fork()
    if pid == 0:  # the child: `python script args`, as the interpreter would run it
        code = 1
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
            os.dup2(err.fileno(), 2)
            sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", closefd=False)
            os.environ.update(case["env"])
            sys.argv = list(case["argv"])
            try:
                runpy.run_path(sys.argv[0], run_name="__main__")
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
                if isinstance(exc.code, str):
                    print(exc.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
        finally:
            os.write(seen.fileno(), json.dumps({m: m in sys.modules for m in heavy}).encode())
            sys.stderr.flush()
            os._exit(code)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    if done[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        results.append({"code": "timeout", "stderr": "", "imported": {}})
        continue
    err.seek(0), seen.seek(0)
    results.append({"code": os.waitstatus_to_exitcode(done[1]), "stderr": err.read().decode(),
                    "imported": json.loads(seen.read() or b"{}")})
json.dump(results, sys.stdout)
"""


def fixtures(tmp: Path) -> dict[str, str]:
    """Files the cases point at; each case gets its own output folder {out} (absent before the run)."""
    (tmp / "a-folder").mkdir()
    (tmp / "a-file").write_text("not a folder\n")
    (tmp / "not-alpaca.json").write_text(json.dumps({"instruction": "a dict, not a list"}))
    (tmp / "broken.json").write_text('[{"instruction": ')
    (tmp / "empty.txt").write_text("")
    (tmp / "no-config").mkdir()
    (tmp / "no-config" / "tokenizer.json").write_text("{}")
    (tmp / "glue-empty").mkdir()
    (tmp / "unfinished" / PARTIAL).mkdir(parents=True)
    (tmp / "unfinished" / PARTIAL / MARKER).write_text("UNFINISHED\n")
    (tmp / "no-records").mkdir()
    return {"tmp": str(tmp)}


# (script, args, env, argument named, fragments of the line: the value and what is allowed)
CASES = [
    # -- reproduce/llama7b.py (and `make reproduce-llama7b MODEL= ARGS=`): each input, refused before any run
    pytest.param(LLAMA, ["--seq-len", "0"], {}, "--seq-len", ["'0'", "integer >= 1"], id="llama7b-seq-len-0"),
    pytest.param(LLAMA, ["--micro-batch", "0"], {}, "--micro-batch", ["'0'", "integer >= 1"],
                 id="llama7b-micro-batch-0"),
    pytest.param(LLAMA, ["--data", "{tmp}/missing.json"], {}, "--data",
                 ["missing.json", "file not found", "'auto', 'synthetic'"], id="llama7b-data-missing"),
    pytest.param(LLAMA, ["--model", "{tmp}/no-such-model"], {}, "--model", ["no-such-model", "no such local path",
                                                                            "hub id"], id="llama7b-model-missing-path"),
    pytest.param(LLAMA, ["--repeats", "-1"], {}, "--repeats", ["'-1'", "integer >= 1"], id="llama7b-repeats-negative"),
    # -- the rest of llama7b's arguments
    pytest.param(LLAMA, ["--repeats", "0"], {}, "--repeats", ["'0'", "integer >= 1"], id="llama7b-repeats-0"),
    pytest.param(LLAMA, ["--seq-len", "16.5"], {}, "--seq-len", ["'16.5'", "integer >= 1"], id="llama7b-seq-len-float"),
    pytest.param(LLAMA, ["--timed-steps", "0"], {}, "--timed-steps", ["'0'", "integer >= 1"], id="llama7b-timed-0"),
    pytest.param(LLAMA, ["--warmup-steps", "-1"], {}, "--warmup-steps", ["'-1'", "integer >= 0"],
                 id="llama7b-warmup-negative"),
    pytest.param(LLAMA, ["--data", "{tmp}/a-folder"], {}, "--data", ["a-folder", "a folder, not a file"],
                 id="llama7b-data-folder"),
    pytest.param(LLAMA, ["--data", "{tmp}/not-alpaca.json"], {}, "--data", ["not-alpaca.json", "Alpaca JSON list"],
                 id="llama7b-data-not-alpaca"),
    pytest.param(LLAMA, ["--data", "{tmp}/broken.json"], {}, "--data", ["broken.json", "cannot be read"],
                 id="llama7b-data-broken-json"),
    pytest.param(LLAMA, ["--data", "{tmp}/empty.txt"], {}, "--data", ["empty.txt", "holds no text"],
                 id="llama7b-data-empty"),
    pytest.param(LLAMA, ["--model", "{tmp}/no-config"], {}, "--model", ["no-config", "without config.json"],
                 id="llama7b-model-folder-without-config"),
    pytest.param(LLAMA, [], {"MODEL": "{tmp}/no-such-model"}, "--model", ["no-such-model", "hub id"],
                 id="llama7b-MODEL-env-missing-path"),
    pytest.param(LLAMA, ["--model", "not a/hub id"], {}, "--model", ["'not a/hub id'", "hub id"],
                 id="llama7b-model-not-a-hub-id"),
    pytest.param(LLAMA, ["--engines", "zenflow"], {}, "--engines", ["'zenflow'", "'ref-zenflow'"],
                 id="llama7b-engine-unknown"),
    pytest.param(LLAMA, ["--engines", "ref-zenflow", "no-offload", "ref-zenflow"], {}, "--engines",
                 ["ref-zenflow given more than once", "each value once"], id="llama7b-engine-twice"),
    pytest.param(LLAMA, ["--dtype", "fp8"], {}, "--dtype", ["'fp8'", "'bf16'"], id="llama7b-dtype-unknown"),
    pytest.param(LLAMA, ["--placement", "gpu"], {}, "--placement", ["'gpu'", "'shared'", "'split'"],
                 id="llama7b-placement-unknown"),
    pytest.param(LLAMA, ["--placement", "split", "--cores-ablation"], {}, "--placement",
                 ["'split' is not allowed with --cores-ablation"], id="llama7b-placement-split-with-cores-ablation"),
    pytest.param(LLAMA, ["--nproc", "0"], {}, "--nproc/--num-gpus", ["'0'", "integer >= 1"], id="llama7b-nproc-0"),
    pytest.param(LLAMA, ["--num-gpus", "0"], {}, "--nproc/--num-gpus", ["'0'", "integer >= 1"],
                 id="llama7b-num-gpus-alias-0"),
    pytest.param(LLAMA, ["--nproc", "64", "--engines", "ds-zenflow"], {}, "--nproc",
                 ["64 is not allowed", "cores this process may use" if not torch.cuda.is_available()
                  else "CUDA GPU(s) torch can use"], id="llama7b-nproc-more-than-here"),
    pytest.param(LLAMA, ["--out", "{tmp}/a-file"], {}, "--out", ["a-file", "is not a folder", "writable folder"],
                 id="llama7b-out-is-a-file"),
    pytest.param(LLAMA, ["--out", "{tmp}/a-file/below"], {}, "--out", ["a-file/below", "cannot be created"],
                 id="llama7b-out-below-a-file"),
    pytest.param(LLAMA, ["--out", "{tmp}/unfinished"], {}, "--out", ["unfinished", "--resume"],
                 id="llama7b-fresh-start-over-an-unfinished-plan"),
    pytest.param(LLAMA, ["--report-only", "--out", "{tmp}/no-records"], {}, "--report-only",
                 ["no-records", "no run records"], id="llama7b-report-only-without-records"),
    pytest.param(LLAMA, ["--cores-ablation", "1.5"], {}, "--cores-ablation", ["'1.5'", "a number in [0, 1]"],
                 id="llama7b-cores-fraction-above-1"),
    pytest.param(LLAMA, ["--cores-ablation", "nan"], {}, "--cores-ablation", ["'nan'", "a number in [0, 1]"],
                 id="llama7b-cores-fraction-nan"),
    pytest.param(LLAMA, ["--cores-ablation", "0.5", "0.5"], {}, "--cores-ablation",
                 ["0.5 given more than once", "each value once"], id="llama7b-cores-fraction-twice"),
    pytest.param(LLAMA, ["--cores-ablation", "--engines", "ref-offload"], {}, "--engines",
                 ["ref-offload not allowed with --cores-ablation", "split the cores", "ref-zenflow"],
                 id="llama7b-cores-engine-without-a-split"),
    pytest.param(LLAMA, ["--cores-ablation", "--convergence"], {}, "--cores-ablation",
                 ["not allowed with --convergence", "one study per run"], id="llama7b-cores-with-convergence"),
    # -- reproduce/glue.py
    pytest.param(GLUE, ["--train-examples", "0"], {}, "--train-examples", ["'0'", "integer >= 1"],
                 id="glue-train-examples-0"),
    pytest.param(GLUE, ["--eval-examples", "-5"], {}, "--eval-examples", ["'-5'", "integer >= 1"],
                 id="glue-eval-examples-negative"),
    pytest.param(GLUE, ["--epochs", "0"], {}, "--epochs", ["'0'", "integer >= 1"], id="glue-epochs-0"),
    pytest.param(GLUE, ["--seq-len", "0"], {}, "--seq-len", ["'0'", "integer >= 1"], id="glue-seq-len-0"),
    pytest.param(GLUE, ["--micro-batch", "0"], {}, "--micro-batch", ["'0'", "integer >= 1"], id="glue-micro-batch-0"),
    pytest.param(GLUE, ["--warmup-steps", "-1"], {}, "--warmup-steps", ["'-1'", "integer >= 0"],
                 id="glue-warmup-negative"),
    pytest.param(GLUE, ["--lr", "-0.1"], {}, "--lr", ["'-0.1'", "finite number >= 0"], id="glue-lr-negative"),
    pytest.param(GLUE, ["--lr", "inf"], {}, "--lr", ["'inf'", "finite number >= 0"], id="glue-lr-inf"),
    pytest.param(GLUE, ["--seeds", "0", "-1"], {}, "--seeds", ["'-1'", "integer >= 0"], id="glue-seed-negative"),
    pytest.param(GLUE, ["--seeds", "1", "1"], {}, "--seeds", ["1 given more than once"], id="glue-seed-twice"),
    pytest.param(GLUE, ["--tasks", "SST-2", "sst2"], {}, "--tasks", ["SST-2 given more than once"],
                 id="glue-task-twice-in-two-spellings"),
    pytest.param(GLUE, ["--full", "--train-examples", "64"], {}, "--train-examples", ["64 with --full"],
                 id="glue-train-examples-with-full"),
    pytest.param(GLUE, ["--engines", "deepspeed"], {}, "--engines", ["'deepspeed'", "'ds-zenflow'"],
                 id="glue-engine-unknown"),
    pytest.param(GLUE, ["--glue-dir", "{tmp}/a-file"], {}, "--glue-dir", ["a-file", "is not a folder",
                                                                          "existing folder"], id="glue-dir-a-file"),
    pytest.param(GLUE, ["--glue-dir", "{tmp}/glue-empty", "--tasks", "RTE"], {}, "--glue-dir",
                 ["glue-empty", "no RTE/ folder"], id="glue-dir-without-the-task"),
    pytest.param(GLUE, [], {"MODEL": "{tmp}/no-such-model"}, "--model", ["no-such-model", "does not load"],
                 id="glue-MODEL-env-missing-path"),
    pytest.param(GLUE, ["--model", "{tmp}/no-config"], {}, "--model", ["no-config", "without config.json"],
                 id="glue-model-folder-without-config"),
    pytest.param(GLUE, ["--out", "{tmp}/a-file"], {}, "--out", ["a-file", "is not a folder"], id="glue-out-is-a-file"),
    pytest.param(GLUE, ["--out", "{tmp}/unfinished"], {}, "--out", ["unfinished", "--resume"],
                 id="glue-fresh-start-over-an-unfinished-plan"),
    # -- reproduce/project.py, reproduce/gpu_check.py
    pytest.param(PROJECT, ["--repeats", "0"], {}, "--repeats", ["'0'", "integer >= 1"], id="project-repeats-0"),
    pytest.param(PROJECT, ["--seqs", "16", "0"], {}, "--seqs", ["'0'", "integer >= 1"], id="project-seq-0"),
    pytest.param(PROJECT, ["--engines", "ref-zenflow", "zero"], {}, "--engines", ["'zero'", "'ref-offload'"],
                 id="project-engine-unknown"),
    pytest.param(PROJECT, ["--hardware-id", "no-such-machine"], {}, "--hardware-id",
                 ["no-such-machine", "calibration.json"], id="project-hardware-id-unknown"),
    pytest.param(GPU_CHECK, ["--out", "{tmp}/a-file"], {}, "--out", ["a-file", "is not a folder"],
                 id="gpu-check-out-is-a-file"),
]
SKIP_ON_CUDA = {"llama7b-num-gpus-more-than-here"}  # a 64-GPU host is not expected


def _argv(case: tuple, tmp: Path, out: Path) -> list[str]:
    script, args = case[0], case[1]
    argv = [script, *(a.format(tmp=tmp) for a in args)]
    if "--out" not in args and script != PROJECT:  # project.py writes only under results/costmodel/<id>/
        argv += ["--out", str(out)]
    return argv


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Every case of CASES run in its own forked process (FORK_RUNNER); by case id."""
    tmp = tmp_path_factory.mktemp("bad-input")
    fixtures(tmp)
    runs = []
    for p in CASES:
        out = tmp / f"out-{p.id}"
        env = {k: v.format(tmp=tmp) for k, v in p.values[2].items()}
        runs.append({"argv": _argv(p.values, tmp, out), "env": {"HF_HUB_OFFLINE": "1", **env}})
    before = {p: p.read_bytes() if p.is_file() else None for p in tmp.rglob("*")}
    proc = subprocess.run([sys.executable, "-c", FORK_RUNNER], input=json.dumps(runs), capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    after = {p: p.read_bytes() if p.is_file() else None for p in tmp.rglob("*")}
    results = dict(zip([p.id for p in CASES], json.loads(proc.stdout), strict=True))
    results["_files_unchanged"] = {"ok": before == after, "diff": sorted(map(str, set(before) ^ set(after)))}
    results["_tmp"] = {"path": tmp}
    return results


@pytest.mark.script
@pytest.mark.parametrize(("script", "args", "env", "argument", "fragments"), CASES)
def test_bad_input_exits_2_with_one_line_naming_argument_value_and_rule(outcomes, request, script, args, env,
                                                                        argument, fragments):
    case = request.node.callspec.id
    if case in SKIP_ON_CUDA and torch.cuda.is_available():
        pytest.skip("depends on the number of GPUs here")
    result, tmp = outcomes[case], outcomes["_tmp"]["path"]
    lines = result["stderr"].splitlines()
    assert result["code"] == 2, result
    assert "Traceback" not in result["stderr"]
    assert len(lines) == 1, result["stderr"]
    assert f"error: argument {argument}:" in lines[0]
    for fragment in fragments:
        assert fragment.format(tmp=tmp) in lines[0], lines[0]
    assert not (tmp / f"out-{case}").exists(), "a refused run created its output folder"


@pytest.mark.script
@pytest.mark.parametrize("case", [p.id for p in CASES if p.values[0] != PROJECT and "--out" not in p.values[1]
                                  and "--report-only" not in p.values[1] and "glue-dir" not in p.id])
def test_parsing_imports_neither_deepspeed_nor_transformers(outcomes, case):
    """Refused while parsing: before DeepSpeed (capture_environment imports it) and before any model code."""
    assert outcomes[case]["imported"] == {"deepspeed": False, "transformers": False}


@pytest.mark.script
def test_refused_runs_leave_every_given_file_and_folder_as_it_was(outcomes):
    assert outcomes["_files_unchanged"]["ok"], outcomes["_files_unchanged"]["diff"]
    assert not (outcomes["_tmp"]["path"] / "a-folder" / PARTIAL).exists()


# ---- the commands themselves: the make target (MODEL=, ARGS=) and a plain interpreter ----------------------------
@pytest.mark.script
def test_make_target_refuses_a_missing_model_path_before_any_run(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(["make", "-s", "reproduce-llama7b", "VENV=", f"PYTHON={sys.executable}",
                           f"MODEL={tmp_path / 'no-such-model'}", f"ARGS=--out {out}"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    ours = [line for line in proc.stderr.splitlines() if "error:" in line]  # beside make's and `install`'s lines
    assert proc.returncode == 2, proc.stderr
    assert len(ours) == 1 and "llama7b.py: error: argument --model:" in ours[0] and "no-such-model" in ours[0]
    assert "Traceback" not in proc.stderr and not out.exists()


@pytest.mark.script
def test_plain_python_command_refuses_train_examples_0(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, GLUE, "--train-examples", "0", "--out", str(out)], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        "glue.py: error: argument --train-examples: '0' is not allowed: expected an integer >= 1 (see --help)"]
    assert not out.exists()


# ---- a failed plan leaves the folder as it was ----------------------------------------------------------------
@pytest.mark.script
def test_a_failed_plan_leaves_the_folder_as_it_was_until_resume_completes_it(tmp_path):
    """The run fails inside its child (3 tokens of data: too few for one batch, found only by the tokenizer)."""
    out, data = tmp_path / "out", tmp_path / "tiny.txt"
    out.mkdir()
    (out / "no-offload-r0.json").write_text('{"earlier": "complete set"}')
    (out / "table.md").write_text("earlier table\n")
    data.write_text("hi")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    proc = subprocess.run([sys.executable, LLAMA, "--smoke", "--engines", "no-offload", "--repeats", "1", "--data",
                           str(data), "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.name != PARTIAL} == before
    staged = out / PARTIAL
    assert RunRecord.read(staged / "no-offload-r0.json").status == "failed"
    marker = (staged / MARKER).read_text()
    assert "Failed (1): no-offload-r0.json" in marker and "--resume" in marker
    assert "FAILED runs" in (staged / "table.md").read_text()
    # --resume (here with the data fixed; a fresh start is refused: the *-fresh-start-over-an-unfinished-plan cases)
    proc = subprocess.run([sys.executable, LLAMA, "--smoke", "--engines", "no-offload", "--repeats", "1", "--data",
                           "synthetic", "--out", str(out), "--resume"], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not staged.exists() and RunRecord.read(out / "no-offload-r0.json").status == "ok"
    assert (out / "table.md").read_text() != "earlier table\n"


@pytest.mark.script
def test_an_interrupted_plan_leaves_the_folder_as_it_was_and_says_so(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "table.md").write_text("earlier table\n")
    proc = subprocess.Popen([sys.executable, LLAMA, "--smoke", "--engines", "no-offload", "--repeats", "1", "--data",
                             "synthetic", "--out", str(out)], stderr=subprocess.PIPE, text=True, cwd=ROOT)
    lines = []
    for line in proc.stderr:  # the plan has started (its SIGTERM handler is set) once it prints its first run
        lines.append(line)
        if line.startswith("[1/1]"):
            proc.send_signal(signal.SIGTERM)
            break
    lines += proc.stderr.readlines()
    assert proc.wait(timeout=120) == 130, "".join(lines)[-3000:]
    assert sorted(p.name for p in out.iterdir()) == [PARTIAL, "table.md"]
    assert (out / "table.md").read_text() == "earlier table\n"
    assert (out / PARTIAL / MARKER).read_text().startswith("UNFINISHED (interrupted): 0 of 1")
    assert any(line.startswith("interrupted:") and "--resume" in line for line in lines)


# ---- StagedPlan, in-process -----------------------------------------------------------------------------------
def spec(engine: str = "ref-zenflow", seq_len: int = 16) -> SimpleNamespace:
    """What same_run reads of a RunSpec."""
    return SimpleNamespace(engine=engine, workload={"model": "cpu-scale", "seq_len": seq_len},
                           ds_config={"zero_optimization": {"zenflow": {"update_interval": 4}}})


def record(s: SimpleNamespace, status: str = "ok", repeat: int = 0) -> RunRecord:
    return RunRecord(engine=s.engine, status=status, config=s.ds_config, workload={**s.workload, "seed": 1},
                     protocol={"repeat": repeat})


def test_a_complete_plan_moves_its_records_into_the_folder_and_removes_the_stage(tmp_path):
    (tmp_path / "other.txt").write_text("kept")
    plan = StagedPlan(tmp_path, ["a.json", "b.json"])
    assert plan.path("a.json").parent == tmp_path / PARTIAL and (tmp_path / PARTIAL / MARKER).exists()
    for name, status in (("a.json", "ok"), ("b.json", "skipped")):
        record(spec(), status).write(plan.path(name))
        plan.done(name, record(spec(), status))
    assert plan.finish()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.json", "other.txt"]


def test_a_failed_or_interrupted_plan_keeps_the_last_complete_set(tmp_path):
    record(spec()).write(tmp_path / "a.json")
    good = (tmp_path / "a.json").read_bytes()
    plan = StagedPlan(tmp_path, ["a.json", "b.json", "c.json"])
    record(spec(), "failed").write(plan.path("a.json"))
    plan.done("a.json", record(spec(), "failed"))
    record(spec()).write(plan.path("b.json"))
    plan.done("b.json", record(spec()))
    plan.stop()
    assert not plan.finish()
    assert (tmp_path / "a.json").read_bytes() == good and not (tmp_path / "b.json").exists()
    marker = (tmp_path / PARTIAL / MARKER).read_text()
    assert marker.startswith("UNFINISHED (interrupted): 1 of 3")
    assert "Failed (1): a.json" in marker and "Not run (1): c.json" in marker


def test_resume_keeps_ok_records_of_the_same_run_only(tmp_path):
    plan = StagedPlan(tmp_path, ["staged.json", "placed.json", "other.json", "failed.json"])
    record(spec()).write(plan.path("staged.json"))
    record(spec()).write(tmp_path / "placed.json")
    record(spec(), "failed").write(plan.path("placed.json"))  # a stale staged copy beside a good placed one
    record(spec(seq_len=32)).write(plan.path("other.json"))
    record(spec(), "failed").write(plan.path("failed.json"))
    assert plan.reuse("staged.json", spec()) is not None
    assert plan.reuse("placed.json", spec()) is not None and not plan.path("placed.json").exists()
    assert plan.reuse("other.json", spec()) is None  # another sequence length: run again
    assert plan.reuse("failed.json", spec()) is None
    assert plan.reuse("staged.json", spec(engine="no-offload")) is None
    assert plan.missing() == ["other.json", "failed.json"]
    assert same_run(record(spec(), repeat=1), spec(), {"repeat": 1})
    assert not same_run(record(spec(), repeat=1), spec(), {"repeat": 0})


def test_abandoning_the_only_run_removes_what_the_plan_created(tmp_path):
    out = tmp_path / "new" / "out"
    plan = StagedPlan(out, ["a.json"])
    record(spec(), "failed").write(plan.path("a.json"))
    plan.abandon("a.json")
    assert not out.exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    plan = StagedPlan(kept, ["a.json"])
    plan.abandon("a.json")
    assert kept.is_dir() and list(kept.iterdir()) == []


def test_an_output_folder_is_checked_and_never_created(tmp_path):
    (tmp_path / "f").write_text("x")
    assert folder_problem(tmp_path / "f") == "exists and is not a folder"
    assert folder_problem(tmp_path / "f" / "g" / "h") == f"cannot be created: {str(tmp_path / 'f')!r} is not a folder"
    assert folder_problem(tmp_path / "new" / "deeper") is None and not (tmp_path / "new").exists()
    assert folder_problem(tmp_path) is None
