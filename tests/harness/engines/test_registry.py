"""The engine registry (zenflow/harness/engines/registry.py): one row per engine, and everything reads it. Adding an
engine is one class plus one row (and its line in the docs' engine table): a dummy engine registered here runs through
the same path as the real ones (config, class, cycle, session, record, table order, memory plan), with no other file
changed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from zenflow.costmodel.model import ENGINES as MODELLED_ENGINES
from zenflow.costmodel.validate import VALIDATED
from zenflow.harness import configs, memory_plan
from zenflow.harness.engines import registry
from zenflow.harness.engines.build import TorchEngine, deepspeed_config, make_engine
from zenflow.harness.engines.registry import (
    ENGINE_SPECS,
    EngineSpec,
    engine_spec,
    is_deepspeed,
    not_deepspeed,
    unavailable,
)
from zenflow.harness.records import RunRecord
from zenflow.harness.session import RunSpec, Session
from zenflow.reports.glue import FAMILIES
from zenflow.reports.scenario import engine_rank, engine_rows
from zenflow.telemetry.timeline import StepTimeline

ROOT = Path(__file__).resolve().parents[3]
BLOCK = {"topk_ratio": 0.5, "update_interval": 2}


class SGDEngine(TorchEngine):
    """The dummy engine: torch SGD in our torch loop (a new engine's whole class)."""

    def build_optimizer(self, distributed: bool) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=self.ds_config["optimizer"]["params"]["lr"])


@pytest.fixture
def dummy(monkeypatch: pytest.MonkeyPatch) -> dict[str, EngineSpec]:
    """Two rows (one updating every step, one accumulating the update interval), added for this test only."""
    rows = {"sgd": EngineSpec("sgd", SGDEngine, "pytorch", "extra", zero=not_deepspeed),
            "sgd-gas": EngineSpec("sgd-gas", SGDEngine, "pytorch", "extra", zero=not_deepspeed,
                                  cycle_rule="accumulation")}
    for name, spec in rows.items():
        monkeypatch.setitem(ENGINE_SPECS, name, spec)
    return rows


def config(engine: str) -> dict:
    return deepspeed_config(engine, BLOCK, "fp32", 1, lr=1e-2, weight_decay=0.0, clipping=1.0, cuda=False)


def test_a_registered_engine_runs_through_the_one_path(dummy, run_spec, tiny_workload):
    assert config("sgd")["zero_optimization"] == {"stage": 0} and config("sgd")["gradient_accumulation_steps"] == 1
    assert config("sgd-gas")["gradient_accumulation_steps"] == 2  # the run's update interval U
    for name, cycle in (("sgd", 1), ("sgd-gas", 2)):
        spec = run_spec(name, block=BLOCK, lr=1e-2, label="registry", warmup_steps=2, timed_steps=4, threads=1,
                        workload={**tiny_workload, "device": "cpu", "data": "synthetic"})  # ds_config: config(name)
        assert spec.cycle == cycle
        record = Session(spec).run()
        assert record.status == "ok" and record.engine == name, record.error
        assert record.protocol["cycle"] == cycle and record.protocol["timed_steps"] == 4  # whole cycles
        assert record.protocol["stall_includes_io"] is False
        kinds = [s["kind"] for s in record.steps[2:]]
        assert kinds == (["update"] * 4 if cycle == 1 else ["accumulate", "update"] * 2)
    # The parent's side: availability, launcher family, table order, the memory plan.
    assert unavailable("sgd", "cpu") is None and not is_deepspeed("sgd")
    assert engine_rank("sgd") == (len(configs.ENGINES), "sgd") and engine_rank("zzz")[0] > engine_rank("sgd-gas")[0]
    shape = memory_plan.ModelShape(128, 32, 64, 1, 2, 2)
    need = memory_plan.estimate("sgd", shape, 4, False, BLOCK, 8, 1, 0)
    assert need.pinned == 0 and need.device == 0 and need.pageable >= 4 * shape.all_params


def test_make_engine_builds_the_rows_class_and_refuses_a_name_not_registered(dummy):
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"engine = 'nope' is not allowed: expected one of \("):
        make_engine("nope", model, config("sgd"), StepTimeline(), device="cpu")
    engine = make_engine("sgd-gas", model, config("sgd-gas"), StepTimeline(), device="cpu")
    assert isinstance(engine, SGDEngine) and isinstance(engine.optimizer, torch.optim.SGD) and engine.cycle == 2


# The engines as this test was written, in table order. The whole list, and a new engine's place in it, is pinned by
# the docs' one engine table (its rows must be configs.ENGINES, in order): adding an engine is its class, its row and
# its line in that table, and the pins here hold for the engines below whatever is added.
KNOWN = ("ds-zero-offload", "ds-zero-offload-gas", "ds-zenflow", "ds-zenflow-intended", "ds-zero-infinity",
         "ds-twin-flow", "ref-offload", "ref-offload-gas", "ref-zenflow", "ref-zenflow-da", "ref-zenflow-fsdp2",
         "ref-offload-overlap", "fsdp2-offload", "torchao-offload", "megatron-hybrid-0.1", "megatron-hybrid-0.5",
         "megatron-hybrid-1.0", "torchao-adamw8bit", "bnb-adamw8bit", "no-offload", "no-offload-fp32")


def documented_engines() -> tuple[str, ...]:
    """The rows of the docs' one engine table, in order (tests/project/test_docs_references.py checks that it is the
    only one and that every backticked engine name in the docs is registered)."""
    return tuple(re.findall(r"^\| `([^`]+)` \|", (ROOT / "docs" / "peers.md").read_text(), re.M))


def known(engines: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(e for e in engines if e in KNOWN)


def test_the_rows_are_the_engine_lists_in_table_order():
    assert configs.ENGINES == tuple(spec.name for spec in registry.ROWS) == registry.engine_names()
    assert configs.ENGINES == documented_engines()  # the docs' engine table: every row, in order
    assert known(configs.ENGINES) == KNOWN
    # a run without --engines: every row but the opt-in ones (what the committed result sets ran)
    assert configs.DEFAULT_ENGINES == tuple(e for e in configs.ENGINES if not engine_spec(e).opt_in)
    assert known(configs.DEFAULT_ENGINES) == tuple(e for e in KNOWN
                                                   if e not in ("ds-zenflow-intended", "ref-zenflow-fsdp2"))
    assert known(configs.CORE_ENGINES) == ("ds-zero-offload", "ds-zenflow", "ref-offload", "ref-zenflow", "no-offload")
    assert known(configs.CONTROL_ENGINES) == ("ds-zero-offload-gas", "ref-offload-gas")
    assert known(configs.PEER_ENGINES) == ("ds-zero-infinity", "ds-twin-flow", "ref-offload-overlap", "fsdp2-offload",
                                           "torchao-offload", "megatron-hybrid-0.1", "megatron-hybrid-0.5",
                                           "megatron-hybrid-1.0", "torchao-adamw8bit", "bnb-adamw8bit")
    assert (configs.CORE_ENGINES, configs.CONTROL_ENGINES) == (known(configs.CORE_ENGINES),
                                                               known(configs.CONTROL_ENGINES))  # nothing added
    assert [e for e in configs.ENGINES if is_deepspeed(e)] == [e for e in configs.ENGINES if e.startswith("ds-")]


def test_every_named_engine_subset_names_registered_engines():
    """The subsets a script runs or a page shows are named once, in configs.py, from the registry's names."""
    subsets = {name: getattr(configs, name) for name in ("PAPER_ENGINES", "CONVERGENCE_ENGINES", "GPU_WINDOW_ENGINES",
                                                         "SMOKE_ENGINES", "CLAIM_TIMED_ENGINES",
                                                         "CLAIM_CONVERGENCE_ENGINES", "CLAIM_GLUE_ENGINES")}
    for name, engines in subsets.items():
        assert engines and set(engines) <= set(ENGINE_SPECS) and len(set(engines)) == len(engines), name
    assert configs.OVERHEAD_ENGINE in ENGINE_SPECS and engine_spec(configs.OVERHEAD_ENGINE).zenflow_block == "asked"


def test_every_name_a_row_points_at_is_a_row():
    for spec in registry.ROWS:
        for other in (spec.stall_baseline, spec.control):
            assert other is None or (other in ENGINE_SPECS and ENGINE_SPECS[other].family == spec.family), spec.name
    assert {s.name: (s.stall_baseline, s.control) for s in registry.zenflow_engines()} == {
        "ref-zenflow": ("ref-offload", "ref-offload-gas"), "ref-zenflow-da": ("ref-offload", "ref-offload-gas"),
        "ref-zenflow-fsdp2": ("ref-offload", "ref-offload-gas"),
        "ds-zenflow": ("ds-zero-offload", "ds-zero-offload-gas"),
        "ds-zenflow-intended": ("ds-zero-offload", "ds-zero-offload-gas")}
    assert FAMILIES == {"DeepSpeed": ("ds-zenflow", "ds-zero-offload"), "ours": ("ref-zenflow", "ref-offload")}
    assert set(VALIDATED) <= set(ENGINE_SPECS)  # the cost model validates registry names
    # the cost model's engine for each engine it predicts: EngineSpec.modelled_as, one of the cost model's engines
    modelled = {s.name: s.modelled_as for s in registry.ROWS if s.modelled_as}
    assert modelled == {"ref-offload": "zero-offload", "ref-offload-gas": "zero-offload-gas",
                        "ref-zenflow": "zenflow-overlap", "ref-zenflow-da": "zenflow-da-overlap",
                        "no-offload": "no-offload"}
    assert set(modelled.values()) <= set(MODELLED_ENGINES)


@pytest.mark.parametrize("engine", configs.ENGINES)
def test_one_cycle_rule_for_the_run_and_the_engine(engine):
    """What a cycle is, derived once (EngineSpec.cycle): U for the ZenFlow engines and the -gas controls, else 1;
    an "auto" interval has no fixed cycle."""
    expected = 4 if engine in ("ds-zenflow", "ds-zenflow-intended", "ref-zenflow", "ref-zenflow-da",
                               "ref-zenflow-fsdp2", "ds-zero-offload-gas", "ref-offload-gas") else 1
    for block, cycle in (({"update_interval": 4}, expected), ({"update_interval": "auto"}, 1)):
        cfg = deepspeed_config(engine, block, "bf16", 1, lr=1e-3, weight_decay=0.0, clipping=1.0, cuda=False)
        assert RunSpec(engine=engine, label="t", workload={}, ds_config=cfg).cycle == cycle
        assert engine_spec(engine).cycle(cfg) == cycle


def test_stall_includes_io_is_the_classes_and_the_table_reads_the_stall_baseline():
    assert [s.name for s in registry.ROWS if s.stall_includes_io and s.name in KNOWN] == [
        "ds-zero-offload", "ds-zero-offload-gas", "ds-zenflow", "ds-zenflow-intended", "ds-zero-infinity",
        "ds-twin-flow", "fsdp2-offload", "torchao-offload", "megatron-hybrid-0.1", "megatron-hybrid-0.5",
        "megatron-hybrid-1.0"]

    def record(engine: str, stall: float) -> RunRecord:
        return RunRecord(engine=engine, status="ok", summary={"step_ms": {"median": 10.0}, "cycle_mean_ms": 10.0,
                                                              "stall_ms": stall})

    rows = {r["engine"]: r for r in engine_rows([record("ref-offload", 8.0), record("ref-zenflow", 2.0),
                                                 record("ds-zenflow", 1.0)])}
    assert rows["ref-zenflow"]["stall_reduction"] == pytest.approx(0.75)
    assert rows["ds-zenflow"]["stall_reduction"] is None  # its baseline (ds-zero-offload) has no row here
    assert rows["ref-offload"]["stall_reduction"] is None


def test_a_row_with_an_unknown_family_is_refused():
    with pytest.raises(ValueError, match="family = 'mine' is not allowed"):
        EngineSpec("x", SGDEngine, "mine", "extra")
    with pytest.raises(ValueError, match="cycle_rule = 'often' is not allowed"):
        EngineSpec("x", SGDEngine, "ours", "extra", cycle_rule="often")
    with pytest.raises(ValueError, match="repair_weight_view = True is not allowed for family 'ours': expected "
                                         "family 'deepspeed'"):
        EngineSpec("x", SGDEngine, "ours", "extra", repair_weight_view=True)


def test_no_engine_name_prefix_or_suffix_is_interpreted_outside_the_registry():
    """`startswith("ds-")` and `endswith("-gas")` used to decide an engine's traits in 12 places: the registry says."""
    pattern = re.compile(r"""\.(startswith|endswith)\(["'](ds-|ref-|no-offload|-gas|offload)""")
    files = [*(ROOT / "zenflow" / "harness").rglob("*.py"), *(ROOT / "reproduce").glob("*.py"),
             *(ROOT / "bench").glob("*.py")]
    found = [f"{p.relative_to(ROOT)}:{i}" for p in files for i, line in enumerate(p.read_text().splitlines(), 1)
             if pattern.search(line)]
    assert len(files) > 20 and found == []
