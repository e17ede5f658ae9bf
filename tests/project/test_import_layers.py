"""The import structure of zenflow/, read from the source with `ast` (nothing is imported).

Four rules, each a function below, each with a negative control that builds a small package in tmp_path and shows
the rule fires:
  cycles   no import cycle between modules; imports anywhere in a file count (module top, functions, TYPE_CHECKING).
  layers   a module imports modules of its own layer or lower ones only. Lowest first: 0 the library
           (zenflow/*.py, zenflow/__init__.py), 1 zenflow/telemetry/, 2 zenflow/harness/, 3 zenflow/costmodel/,
           4 zenflow/reports/ (tables and figures from records: the top, imported by nobody in zenflow/).
           zenflow/bench_compare.py is standalone: it imports no project module and none imports it.
  private  no name with a leading underscore is imported from (or read off) another project module.
  late     project modules are imported at module top (under `if`/`try` there and `if TYPE_CHECKING:` are fine), not
           inside a function or class body, so that a module's dependencies are where a reader looks; LATE_ALLOWED
           lists the exceptions and why. Third-party imports inside functions stay allowed: that is how the
           torch-only install works (deepspeed, transformers, matplotlib, ... are optional).
`from pkg import name` is an edge to the module `pkg.name` when that is a module (`from zenflow import checkpoint`
imports zenflow/checkpoint.py, not zenflow/__init__.py), otherwise to `pkg`.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())  # wherever tests/ puts it
LAYERS = {"zenflow.telemetry": 1, "zenflow.harness": 2, "zenflow.costmodel": 3, "zenflow.reports": 4}
LAYER_NAMES = ["library", "telemetry", "harness", "costmodel", "reports"]
STANDALONE = "zenflow.bench_compare"  # the zenflow-bench-compare command (needs scipy; `import zenflow` must not)
# (file, imported module) -> why the import stays inside a function.
LATE_ALLOWED = {
    ("zenflow/harness/preflight.py", "zenflow.telemetry.nvml"):
        "preflight.py runs as a plain script under a bare interpreter (`make ... VENV=`) to list what is missing, so "
        "its module level is stdlib only; telemetry.nvml imports pynvml at its top",
}


@dataclass(frozen=True)
class Edge:
    file: str  # relative to the folder holding the package, e.g. zenflow/harness/session.py
    line: int
    src: str  # the importing module
    dst: str  # the imported project module
    name: str | None  # the name taken from dst (`from dst import name`); None when dst itself is imported
    bound: str | None  # the local name bound to the module dst (`import a.b as m`, `from a import b`), if any
    where: str  # "top", "TYPE_CHECKING", "function" or "class"


def module_name(path: Path, base: Path) -> str:
    parts = path.relative_to(base).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_type_checking(test: ast.expr) -> bool:
    return getattr(test, "id", getattr(test, "attr", None)) == "TYPE_CHECKING"  # TYPE_CHECKING, typing.TYPE_CHECKING


def imports_in(body: list[ast.stmt], where: str = "top"):
    """(import statement, where) for every import in `body`: "top" until inside a function (a method too: "function")
    or a class body ("class"); `if TYPE_CHECKING:` at module top is "TYPE_CHECKING" (its `else:` is "top")."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, where
        elif where == "top" and isinstance(node, ast.If) and is_type_checking(node.test):
            yield from imports_in(node.body, "TYPE_CHECKING")
            yield from imports_in(node.orelse, where)
        else:
            inner = where
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):  # a method too
                inner = "function"
            elif where == "top" and isinstance(node, ast.ClassDef):
                inner = "class"
            yield from imports_in([n for n in ast.iter_child_nodes(node) if isinstance(n, ast.stmt)], inner)


def from_module(src: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module of `from ... import`; a relative one is resolved against `src`'s package."""
    if not node.level:
        return node.module or ""
    parts = src.split(".") if is_package else src.split(".")[:-1]
    return ".".join([*parts[: len(parts) - node.level + 1], *([node.module] if node.module else [])])


def edges_of(package: Path) -> tuple[list[Edge], dict[str, ast.Module]]:
    """Every import of a project module in `package` (a folder named after the package) and the parsed files."""
    files = {module_name(p, package.parent): p for p in sorted(package.rglob("*.py"))}
    trees = {mod: ast.parse(p.read_text(), str(p)) for mod, p in files.items()}
    edges = []
    for src, tree in trees.items():
        for node, where in imports_in(tree.body):
            if isinstance(node, ast.Import):  # `import a.b` binds `a`: only `as` binds the module itself
                targets = [(a.name, None, a.asname) for a in node.names]
            else:
                pkg = from_module(src, files[src].name == "__init__.py", node)
                targets = [(f"{pkg}.{a.name}", None, a.asname or a.name) if f"{pkg}.{a.name}" in files
                           else (pkg, a.name, None) for a in node.names]
            edges += [Edge(str(files[src].relative_to(package.parent)), node.lineno, src, dst, name, bound, where)
                      for dst, name, bound in targets if dst.split(".")[0] == package.name]
    return edges, trees


def layer(module: str) -> int:
    return next((n for prefix, n in LAYERS.items() if module == prefix or module.startswith(prefix + ".")), 0)


def cycles(edges: list[Edge]) -> list[str]:
    """One cycle through each group of mutually importing modules (the back edges of a depth-first search)."""
    graph: dict[str, dict[str, Edge]] = {}
    for e in edges:
        graph.setdefault(e.src, {}).setdefault(e.dst, e)
    found, done, path = [], set(), []

    def visit(node: str) -> None:
        if node in path:
            loop = [*path[path.index(node):], node]
            how = "; ".join(f"{graph[a][b].file}:{graph[a][b].line} imports {b}" for a, b in zip(loop, loop[1:]))
            found.append(f"import cycle {' -> '.join(loop)} ({how}): move the function to the module it belongs to")
        elif node not in done:
            path.append(node)
            for dst in graph.get(node, {}):
                visit(dst)
            path.pop()
            done.add(node)

    for node in sorted(graph):
        visit(node)
    return found


def layer_violations(edges: list[Edge]) -> list[str]:
    found = []
    for e in edges:
        if STANDALONE in (e.src, e.dst) and e.src != e.dst:
            found.append(f"{e.file}:{e.line}: {e.src} imports {e.dst}: {STANDALONE} is standalone (it imports no "
                         "project module and none imports it)")
        elif layer(e.dst) > layer(e.src):
            found.append(f"{e.file}:{e.line}: {e.src} (layer {LAYER_NAMES[layer(e.src)]}) imports {e.dst} (layer "
                         f"{LAYER_NAMES[layer(e.dst)]}): a module imports its own layer or lower ones only")
    return list(dict.fromkeys(found))  # once per statement


def private(name: str | None) -> bool:
    return bool(name) and name.startswith("_") and not name.startswith("__")


def private_imports(edges: list[Edge], trees: dict[str, ast.Module]) -> list[str]:
    """`from mod import _name`, and `m._name` where `m` is a project module bound by an import."""
    found = [f"{e.file}:{e.line}: {e.src} imports the private name {e.name} from {e.dst}: make it public (rename "
             "it where it is used) or move it to the module that uses it"
             for e in edges if private(e.name) and e.src != e.dst]
    for src, tree in trees.items():
        modules = {e.bound: e for e in edges if e.src == src and e.bound and e.dst != src}
        found += [f"{modules[a.value.id].file}:{a.lineno}: {src} reads the private name {a.attr} of "
                  f"{modules[a.value.id].dst}: make it public (rename it where it is used) or move it"
                  for a in ast.walk(tree) if isinstance(a, ast.Attribute) and private(a.attr)
                  and isinstance(a.value, ast.Name) and a.value.id in modules]
    return found


def late_imports(edges: list[Edge]) -> list[str]:
    late = {(e.file, e.line, e.src, e.dst, e.where): None for e in edges  # once per statement and module
            if e.where in ("function", "class") and (e.file, e.dst) not in LATE_ALLOWED}
    return [f"{file}:{line}: {src} imports {dst} inside a {where} body: import project modules at module top (or "
            "list the exception, with its reason, in LATE_ALLOWED)" for file, line, src, dst, where in late]


@pytest.fixture(scope="module")
def zenflow():
    return edges_of(ROOT / "zenflow")


def test_no_import_cycles(zenflow):
    problems = cycles(zenflow[0])
    assert not problems, "\n".join(problems)


def test_layers(zenflow):
    problems = layer_violations(zenflow[0])
    assert not problems, "\n".join(problems)


def test_no_private_names_across_modules(zenflow):
    problems = private_imports(*zenflow)
    assert not problems, "\n".join(problems)


def test_project_imports_at_module_top(zenflow):
    problems = late_imports(zenflow[0])
    assert not problems, "\n".join(problems)


def test_the_allowed_late_imports_exist(zenflow):
    """An exception whose import went away is removed from LATE_ALLOWED rather than kept as a silent permit."""
    late = {(e.file, e.dst) for e in zenflow[0] if e.where in ("function", "class")}
    assert set(LATE_ALLOWED) <= late, set(LATE_ALLOWED) - late


# Negative controls: a small package named zenflow in tmp_path, so the layer names apply to it.

def package(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / "zenflow" / rel
        for folder in [path.parent, *path.parent.parents][: len(Path(rel).parts)]:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "__init__.py").touch()
        path.write_text(text)
    return tmp_path / "zenflow"


def test_a_cycle_through_a_function_level_import_is_reported(tmp_path):
    edges, _ = edges_of(package(tmp_path, {"a.py": "from zenflow import b\n",
                                           "b.py": "def f():\n    from zenflow.a import x\n"}))
    (problem,) = cycles(edges)
    assert "zenflow.a -> zenflow.b -> zenflow.a" in problem and "zenflow/b.py:2 imports zenflow.a" in problem


def test_from_package_import_module_is_an_edge_to_the_module_not_the_package(tmp_path):
    # zenflow/__init__ imports optimizer, which takes `checkpoint` from the package: no cycle (the real library).
    edges, _ = edges_of(package(tmp_path, {"__init__.py": "from zenflow.optimizer import Opt\n",
                                           "optimizer.py": "from zenflow import checkpoint\n",
                                           "checkpoint.py": ""}))
    assert {(e.src, e.dst) for e in edges} == {("zenflow", "zenflow.optimizer"),
                                               ("zenflow.optimizer", "zenflow.checkpoint")}
    assert not cycles(edges)
    edges, _ = edges_of(package(tmp_path, {"checkpoint.py": "from zenflow import Opt\n"}))  # a name: the package
    assert cycles(edges)


def test_a_layer_violation_is_reported(tmp_path):
    edges, _ = edges_of(package(tmp_path, {
        "telemetry/t.py": "from zenflow.harness import h\n",  # telemetry (1) imports harness (2): upwards
        "harness/h.py": "import zenflow.telemetry.t\nimport zenflow.config\n",  # down: fine
        "costmodel/c.py": "def f():\n    from zenflow.reports.r import table\n",  # the top layer, from a function
        "reports/r.py": "from zenflow.costmodel import c\n",
        "config.py": "", "bench_compare.py": "from zenflow import config\n"}))
    problems = layer_violations(edges)
    assert len(problems) == 3, problems
    assert any("zenflow/telemetry/t.py:1: zenflow.telemetry.t (layer telemetry) imports zenflow.harness.h (layer "
               "harness)" in p for p in problems)
    assert any("zenflow/costmodel/c.py:2" in p and "(layer reports)" in p for p in problems)
    assert any("zenflow/bench_compare.py:1" in p and "standalone" in p for p in problems)


def test_a_private_import_is_reported(tmp_path):
    edges, trees = edges_of(package(tmp_path, {
        "telemetry/t.py": "_SECRET = 1\ndef _helper():\n    return _SECRET\n",
        "harness/h.py": "from zenflow.telemetry.t import _helper\n",
        "harness/g.py": "from zenflow.telemetry import t\n\nX = t._SECRET\nY = t.__name__\n",
        "harness/k.py": "import zenflow.telemetry.t as tt\n\nZ = tt._helper()\n"}))
    problems = private_imports(edges, trees)
    assert len(problems) == 3, problems
    assert any("zenflow/harness/h.py:1" in p and "_helper" in p for p in problems)
    assert any("zenflow/harness/g.py:3" in p and "_SECRET" in p for p in problems)
    assert any("zenflow/harness/k.py:3" in p and "_helper" in p for p in problems)


def test_an_in_function_project_import_is_reported(tmp_path):
    edges, _ = edges_of(package(tmp_path, {
        "telemetry/t.py": "",
        "harness/h.py": ("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from zenflow.telemetry import t\n"
                         "\n\ndef f():\n    import deepspeed\n    from zenflow.telemetry.t import x\n    return x\n"
                         "\n\nclass C:\n    import zenflow.telemetry.t\n")}))
    problems = late_imports(edges)
    assert len(problems) == 2, problems
    assert "zenflow/harness/h.py:9: zenflow.harness.h imports zenflow.telemetry.t inside a function" in problems[0]
    assert "zenflow/harness/h.py:14:" in problems[1] and "class body" in problems[1]
    assert {e.where for e in edges} == {"TYPE_CHECKING", "function", "class"}
