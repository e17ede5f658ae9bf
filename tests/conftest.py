"""Shared fixtures. tests/support/ (helpers, ds_helpers, the data-parallel rank scripts) is put on sys.path, so tests
import those modules by name (`from helpers import Interleaved`) from any folder.

The factories are stateless and session-scoped, so Hypothesis tests and module-scoped fixtures can use them too;
module-level helper functions (not tests) import the same functions from tests/support/helpers.py."""

from __future__ import annotations

import os
import sys

import pytest

pytest_plugins = ["pytester"]  # tests/project/test_spawn_guard.py runs a suite through this conftest
SUPPORT = os.path.join(os.path.dirname(__file__), "support")
sys.path.insert(0, SUPPORT)

from helpers import feed as _feed  # noqa: E402
from helpers import zenflow as _zenflow  # noqa: E402

# The tiny cpu-scale Llama most harness tests run: one layer of width 32, 8 tokens a step.
TINY_WORKLOAD = {"model": "cpu-scale", "dtype": "fp32", "seq_len": 8, "hidden": 32, "layers": 1, "intermediate": 64,
                 "heads": 2}
# The ZenFlow block a run_spec gets unless the test names its own.
TINY_BLOCK = {"topk_ratio": 0.1, "update_interval": 2}


@pytest.fixture
def tiny_workload() -> dict:
    """The tiny cpu-scale workload, a fresh dict for each test (tests add keys: data, device, ...)."""
    return dict(TINY_WORKLOAD)


@pytest.fixture(scope="session")
def run_spec():
    """Factory: `run_spec(engine, **over)` is the RunSpec of one run of `engine`, its DeepSpeed config built as the
    harness builds it (`deepspeed_config`, micro-batch 1, cuda=False), progress off.

    block, dtype, lr, weight_decay, clipping: deepspeed_config's (defaults TINY_BLOCK, fp32, 1e-3, 0.0, 1.0);
    workload: the whole workload dict (default: a copy of TINY_WORKLOAD); label: the spec's label ("test");
    every other keyword is a RunSpec field (warmup_steps, timed_steps, threads, num_gpus, telemetry, ...)."""
    from zenflow.harness.engines.build import deepspeed_config
    from zenflow.harness.session import RunSpec

    def make(engine: str, *, block: dict | None = None, dtype: str = "fp32", lr: float = 1e-3,
             weight_decay: float = 0.0, clipping: float = 1.0, workload: dict | None = None, label: str = "test",
             **fields) -> RunSpec:
        cfg = deepspeed_config(engine, TINY_BLOCK if block is None else block, dtype, 1, lr=lr,
                               weight_decay=weight_decay, clipping=clipping, cuda=False)
        fields.setdefault("progress", False)
        return RunSpec(engine=engine, label=label, workload=dict(TINY_WORKLOAD) if workload is None else workload,
                       ds_config=cfg, **fields)

    return make


@pytest.fixture(scope="session")
def zenflow_opt():
    """Factory: `zenflow_opt(model, **block)` is ZenFlowAdamW over `model`'s parameters (tests/support/helpers.py:
    `zenflow`): lr 1e-2, weight decay 0.1 and select_interval 10 000 unless given; betas, eps, gradient_clipping and
    skip_nonfinite go to the optimizer, every other keyword to the zenflow block."""
    return _zenflow


@pytest.fixture(scope="session")
def feed():
    """The step loop: `feed(model, opt, grads)` sets each step's gradients (one list per step) on `model`'s
    parameters, steps `opt` and zeroes the gradients (zero_grad=False: not); record=True returns the parameters
    after every step (tests/support/helpers.py: `feed`)."""
    return _feed


# ---- the cores every test starts on --------------------------------------------------------------------------------
# An in-process optimizer whose worker started (overlap_step) pins pytest's own thread to its compute cores until it
# is closed, and a test that never closes one leaves the next tests on one core: a split placement then has nothing
# to split (CI 2026-11-29: three placement tests refused "1 core(s)" after 1400 tests had run; the leak was
# test_hf_trainer.py's interrupted Trainer, whose exception skips on_train_end and so the close). So each test starts
# on the cores and threads the session started with, whatever the tests before it left.
_START_CORES = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None


@pytest.fixture(autouse=True)
def _cores_as_the_session_started():
    if _START_CORES is not None and os.sched_getaffinity(0) != _START_CORES:
        from zenflow.worker import pin_thread

        pin_thread(_START_CORES)
    yield


# ---- cost tiers -------------------------------------------------------------------------------------------------
# A marker stands for what a test costs (pyproject.toml lists them; tests/README.md says which to run when). `make
# test-fast` deselects `slow`; CI runs everything. Markers come from the fixtures a test uses, so nobody has to
# remember them, and the spawn guard below fails a test that starts an interpreter without `slow` some other way.
IMPLIES_SLOW = ("ranks", "deepspeed", "script")
MARKER_OF_FIXTURE = {"torchrun": "ranks"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for fixture, marker in MARKER_OF_FIXTURE.items():
            if fixture in item.fixturenames:  # the closure: a fixture that uses `torchrun` marks its tests too
                item.add_marker(marker)
        if any(item.get_closest_marker(m) for m in IMPLIES_SLOW):
            item.add_marker("slow")


@pytest.fixture(scope="session")
def torchrun():
    """`torchrun(script, config, out, *extra)`: two ranks of `script` under torch.distributed.run, the test failed
    with their stderr unless both exit 0 (tests/support/launch.py). Marks the test `ranks`."""
    import launch

    return launch.torchrun


# ---- the spawn guard --------------------------------------------------------------------------------------------
from spawn_guard import SpawnGuard  # noqa: E402

_guard = SpawnGuard()


@pytest.fixture
def spawn_guard() -> SpawnGuard:
    """The session's guard, for the tests that provoke it."""
    return _guard


def pytest_configure(config: pytest.Config) -> None:
    _guard.install()


def pytest_unconfigure(config: pytest.Config) -> None:
    _guard.uninstall()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    # Setup, call and teardown, module-scoped fixtures included, run inside: a launch is charged to the test that
    # caused it.
    with _guard.running(item, allowed=item.get_closest_marker("slow") is not None):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    # Code under test may swallow the guard's exception (a harness records a failed launch and goes on): the test
    # fails anyway, at the first phase that passed after it.
    refused = _guard.take_refusal(item)
    if refused and report.passed:
        report.outcome = "failed"
        report.longrepr = refused
    return report
