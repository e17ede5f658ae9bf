"""The docs point at code that exists: every `path.py: name` reference resolves (the file, and the name in it), every
backticked source path and relative link exists, and every list of engines is the registry's (configs.ENGINES, or
the configs tuple the text names just before it). One engine table in the docs (docs/peers.md) has the registry's
rows, in order, and says "opt-in" in a row exactly when that engine is opt-in."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from zenflow.harness import configs
from zenflow.harness.engines.registry import ENGINE_SPECS

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
IDS = [str(p.relative_to(ROOT)) for p in DOCS]

# `path.py: name`, `path.py:name`, `path.py::test_name` (one backtick span), or `path.py`: `name`
NAMED = [re.compile(r"`([\w./-]+\.py)::?\s*([A-Za-z_]\w*)`"), re.compile(r"`([\w./-]+\.py)`:\s*`([A-Za-z_]\w*)`")]
SOURCE_PATH = re.compile(r"`((?:zenflow|tests|bench|reproduce|examples)/[\w./-]*\.py)")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def engine_pattern(names: tuple[str, ...]) -> str:
    """A backticked word that looks like an engine: a registered name's first word, a hyphen and more (so that a
    misspelt `ds-zenflw` is caught as "not an engine" rather than passed over), or a registered one-word name. Built
    from the registry, so an engine with a new first word is checked as soon as its row exists."""
    prefixes = "|".join(sorted({re.escape(n.split("-")[0]) for n in names if "-" in n}))
    words = "".join(f"|{re.escape(n)}" for n in sorted(names) if "-" not in n)
    return rf"(?:(?:{prefixes})-[a-z0-9.-]*[a-z0-9]{words})"


ENGINE = engine_pattern(configs.ENGINES)
ENGINE_LIST = re.compile(rf"`{ENGINE}`(?:,\s*(?:and\s+|or\s+)?`{ENGINE}`){{2,}}")  # three or more, comma-separated
ENGINE_TABLE = re.compile(rf"^\|\s*`({ENGINE})`\s*\|", re.M)  # a table whose rows start with an engine
ENGINE_ROW = re.compile(rf"^\|\s*`({ENGINE})`\s*\|.*$", re.M)
TABLE_DOC = ROOT / "docs" / "peers.md"  # the one engine table
SUBSETS = ("CORE_ENGINES", "CONTROL_ENGINES", "PEER_ENGINES", "BEYOND_ENGINES")


def _names(path: Path) -> set[str]:
    """Every function, class and assigned name defined anywhere in a Python file."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def _expected(before: str) -> tuple[str, tuple[str, ...]]:
    """The engine tuple a list must equal: the configs subset named just before it, else all of ENGINES."""
    named = [s for s in SUBSETS if s in before]
    return (named[-1], getattr(configs, named[-1])) if named else ("ENGINES", configs.ENGINES)


@pytest.mark.parametrize("doc", DOCS, ids=IDS)
def test_named_references_resolve(doc: Path) -> None:
    text = doc.read_text()
    for pattern in NAMED:
        for path, name in pattern.findall(text):
            assert (ROOT / path).is_file(), f"{doc.name}: `{path}: {name}`: no file {path}"
            assert name in _names(ROOT / path), f"{doc.name}: `{path}: {name}`: {path} defines no {name}"


@pytest.mark.parametrize("doc", DOCS, ids=IDS)
def test_source_paths_and_links_exist(doc: Path) -> None:
    text = doc.read_text()
    for path in SOURCE_PATH.findall(text):
        assert (ROOT / path).is_file(), f"{doc.name}: `{path}` does not exist"
    for link in LINK.findall(text):
        if re.match(r"[a-z]+:", link) or link.startswith("#"):
            continue  # a URL or an anchor
        assert (doc.parent / link.split("#")[0]).exists(), f"{doc.name}: link ({link}) points nowhere"


@pytest.mark.parametrize("doc", DOCS, ids=IDS)
def test_engine_lists_are_the_registry(doc: Path) -> None:
    text = doc.read_text()
    for token in re.findall(rf"`({ENGINE})`", text):
        assert token in configs.ENGINES, f"{doc.name}: `{token}` is not an engine (configs.ENGINES)"
    for match in ENGINE_LIST.finditer(text):
        listed = tuple(re.findall(r"`([^`]+)`", match.group(0)))
        name, expected = _expected(text[max(0, match.start() - 120):match.start()])
        assert listed == expected, f"{doc.name}: the engine list {listed} is not configs.{name} {expected}"
    rows = tuple(ENGINE_TABLE.findall(text))
    if rows:
        assert rows == configs.ENGINES, f"{doc.name}: the engine table's rows {rows} are not configs.ENGINES"
    for row in ENGINE_ROW.finditer(text):
        name, says = row.group(1), "opt-in" in row.group(0)
        assert says == ENGINE_SPECS[name].opt_in, (f"{doc.name}: the row of `{name}` says opt-in = {says}, its "
                                                   f"registry row opt_in = {ENGINE_SPECS[name].opt_in}")


def documented_engines(doc: Path = TABLE_DOC) -> tuple[str, ...]:
    """The rows of the docs' engine table, in order."""
    return tuple(ENGINE_TABLE.findall(doc.read_text()))


def test_the_docs_have_one_engine_table_and_it_is_the_registry() -> None:
    tables = [doc.name for doc in DOCS if ENGINE_TABLE.search(doc.read_text())]
    assert tables == [TABLE_DOC.name], f"engine tables in {tables}: expected one, in {TABLE_DOC.name}"
    assert documented_engines() == configs.ENGINES


def test_the_checks_have_something_to_check() -> None:
    text = "\n".join(doc.read_text() for doc in DOCS)
    for name in configs.ENGINES:  # the pattern built from the registry knows every engine, and no non-engine word
        assert re.fullmatch(ENGINE, name), name
    assert not any(re.fullmatch(ENGINE, w) for w in ("ds", "ref-", "no", "none-offload", "offload-ref"))
    assert sum(len(p.findall(text)) for p in NAMED) >= 4
    assert len(ENGINE_LIST.findall(text)) >= 3 and len(ENGINE_TABLE.findall(text)) >= 12  # subsets; full lists link
