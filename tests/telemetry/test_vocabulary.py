"""The observer vocabulary has one home (zenflow/hooks.py): Observers refuses a name outside it, every blocking section
it knows lands in the step's split as I/O or stall, and every name the library passes is one of it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from zenflow import hooks
from zenflow.hooks import BLOCKS, DECISIONS, DIRECTIONS, IO_BLOCKS, KINDS, STALL_BLOCKS, Observers
from zenflow.telemetry.timeline import HostClock, StepTimeline

ZENFLOW = Path(hooks.__file__).resolve().parent


class Recorder:
    """An observer that keeps every call (the decisions and device waits too)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def on_transfer(self, direction: str, kind: str, nbytes: int) -> None:
        self.calls.append(("transfer", direction, kind, nbytes))

    def on_block_start(self, what: str) -> None:
        self.calls.append(("start", what))

    def on_block_end(self, what: str) -> None:
        self.calls.append(("end", what))

    def on_decision(self, what: str) -> None:
        self.calls.append(("decision", what))

    def on_device_wait(self, what: str, before: object, after: object) -> None:
        self.calls.append(("device_wait", what))


def observed(attached: bool) -> tuple[Observers, Recorder]:
    observers, recorder = Observers(), Recorder()
    if attached:
        observers.add(recorder)
    return observers, recorder


@pytest.mark.parametrize("attached", [True, False], ids=["observed", "unobserved"])
def test_an_unknown_blocking_section_is_refused_naming_the_known_ones(attached):
    observers, recorder = observed(attached)
    with pytest.raises(ValueError, match=r"unknown blocking section 'copy_d2hh'; expected one of .*copy_d2h") as info:
        with observers.blocking("copy_d2hh"):
            pass
    assert "\n" not in str(info.value) and all(name in str(info.value) for name in BLOCKS)
    with pytest.raises(ValueError, match="unknown blocking section 'upload'"):
        with observers.device_wait("upload", object):
            pass
    assert recorder.calls == []
    with observers.blocking("host_wait"):  # the control: a known one passes
        pass
    assert recorder.calls == ([("start", "host_wait"), ("end", "host_wait")] if attached else [])


@pytest.mark.parametrize("direction, kind, refused", [("d2x", "grads", "direction 'd2x'"),
                                                      ("h2d", "gradients", "kind 'gradients'"),
                                                      ("net", "grad_sum", "kind 'grad_sum'")])
def test_an_unknown_transfer_direction_or_kind_is_refused_and_not_counted(direction, kind, refused):
    observers, recorder = observed(True)
    with pytest.raises(ValueError, match=f"unknown {refused}; expected one of "):
        observers.transfer(direction, kind, 8)
    assert not observers.bytes and recorder.calls == []
    observers.transfer("net", "grad_reduce", 8)  # the control: the data-parallel words are known
    observers.transfer("d2h", "grads", 4)
    assert observers.bytes == {("net", "grad_reduce"): 8, ("d2h", "grads"): 4}


def test_an_unknown_decision_is_refused():
    observers, recorder = observed(True)
    with pytest.raises(ValueError, match="unknown decision 'reselection'; expected one of host_update, selection"):
        observers.decided("reselection")
    observers.decided("selection")
    assert recorder.calls == [("decision", "selection")]


def test_the_vocabulary_is_one_split_of_the_blocks():
    assert not IO_BLOCKS & STALL_BLOCKS and BLOCKS == IO_BLOCKS | STALL_BLOCKS
    assert hooks.NET in DIRECTIONS and set(hooks.LINK_DIRECTIONS) < DIRECTIONS and hooks.NET_KINDS < KINDS


@pytest.mark.parametrize("what", sorted(BLOCKS))
def test_the_timeline_books_every_known_block_as_io_or_stall(what):
    now = [0.0]
    tl = StepTimeline(HostClock(now=lambda: now[0]))
    observers = Observers()
    observers.add(tl)
    step = tl.start_step(0)
    now[0] += 0.002
    with observers.blocking(what):
        now[0] += 0.004
    now[0] += 0.001
    tl.finish()
    assert step.blocks_ms == {what: pytest.approx(4)}
    assert (step.io_ms, step.stall_ms) == ((pytest.approx(4), 0.0) if what in IO_BLOCKS else (0.0, pytest.approx(4)))
    assert step.compute_ms == pytest.approx(3)


# ---- every name the library passes is one of the vocabulary (read from the source: CUDA-only paths too) -----------
# call name -> (position of the argument, the set it must belong to); distributed.Collectives names its collectives'
# kinds in `_count(kind, t)` and `sum_(t, kind)`, the link its copies' kinds in to_host/to_device/scatter_to_device.
CALLS = {"blocking": [(0, BLOCKS)], "device_wait": [(0, BLOCKS)], "decided": [(0, DECISIONS)],
         "transfer": [(0, DIRECTIONS), (1, KINDS)], "_count": [(0, KINDS)], "sum_": [(1, KINDS)],
         "to_host": [(2, KINDS)], "to_device": [(2, KINDS)], "scatter_to_device": [(3, KINDS)]}


def names_passed(tree: ast.AST) -> list[tuple[str, str, frozenset[str]]]:
    """(call, the literal string passed, the set it must be in) for every call of CALLS with a literal there."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in CALLS:
            for position, allowed in CALLS[node.func.attr]:
                if position < len(node.args) and isinstance(arg := node.args[position], ast.Constant) \
                        and isinstance(arg.value, str):
                    found.append((node.func.attr, arg.value, allowed))
    return found


def test_every_name_the_library_passes_to_the_observers_is_known():
    passed = [(path.name, *found) for path in sorted(ZENFLOW.glob("*.py"))
              for found in names_passed(ast.parse(path.read_text()))]
    assert len(passed) > 30  # the scan finds the calls (a control on the scan itself)
    unknown = [(file, call, name) for file, call, name, allowed in passed if name not in allowed]
    assert not unknown, f"names outside zenflow/hooks.py's vocabulary: {unknown}"
    assert {name for _, call, name, _ in passed if call in ("_count", "sum_")} == hooks.NET_KINDS
    assert {name for _, call, name, _ in passed if call == "blocking"} == BLOCKS


def test_the_scan_catches_a_misspelt_name():
    tree = ast.parse('obs.blocking("copy_dh2")\nlink.to_host(a, b, "grad")\nself._count("grad_reduce", t)')
    assert [(call, name) for call, name, allowed in names_passed(tree) if name not in allowed] == \
        [("blocking", "copy_dh2"), ("to_host", "grad")]
