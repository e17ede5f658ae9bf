"""The scaling report (zenflow/reports/scaling.py): rates per world size from records, and the bytes of one
selection
(counted and computed), checked against numbers worked out by hand."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from zenflow.costmodel.model import selection_exchange_bytes
from zenflow.costmodel.presets import model_columns, model_counts
from zenflow.harness.records import RunRecord
from zenflow.reports.scaling import scaling_report, scaling_rows, selection_rows
from zenflow.telemetry.environment import capture_environment


def record(engine: str, world: int, cycle_ms: float, host: int | None = None, net: float = 0.0,
           first_step_norms: int | None = None) -> RunRecord:
    metrics = {} if host is None else {"host_state_bytes": host}
    first = {"bytes": {"net_column_norms": first_step_norms}} if first_step_norms else {}
    return RunRecord(engine=engine, protocol={"world_size": world, "telemetry": True}, workload={"micro_batch": 2},
                     summary={"cycle_mean_ms": cycle_ms, "bytes_per_step": {"d2h_grads": 10.0, "h2d_params": 6.0,
                                                                            "net_grad_reduce": net}},
                     metrics=metrics, steps=[first], model={"column_parameters": 4e6, "model_bytes": 8e6})


def test_rates_per_world_size_compare_samples_per_second_and_host_state_per_rank() -> None:
    rows = scaling_rows([record("ref-zenflow", 1, 100.0, host=1000), record("ref-zenflow", 2, 150.0, host=500,
                                                                          net=40.0),
                         record("ref-zenflow", 2, 250.0, host=500, net=40.0), record("no-offload", 1, 50.0)])
    zen2 = next(r for r in rows if r["engine"] == "ref-zenflow" and r["world_size"] == 2)
    assert zen2["runs"] == 2 and zen2["cycle_mean_ms"] == 200.0  # median of 150 and 250
    assert zen2["samples_per_s"] == pytest.approx(1000 * 2 * 2 / 200.0)  # 2 ranks x micro-batch 2 per step
    assert zen2["throughput_vs_w1"] == pytest.approx(20.0 / 20.0)  # W=1: 1000 * 2 / 100 = 20 samples/s
    assert zen2["host_state_vs_w1"] == pytest.approx(0.5)
    assert zen2["link_bytes_per_step_per_rank"] == 16.0 and zen2["net_bytes_per_step_per_rank"] == 40.0
    assert [r["engine"] for r in rows] == ["ref-zenflow", "ref-zenflow", "no-offload"]  # table order, W ascending


def test_selection_bytes_counted_at_the_first_step_and_computed_for_llama() -> None:
    rows = selection_rows([record("ref-zenflow", 2, 100.0, first_step_norms=20_000)])
    counted = rows[0]
    assert counted["how"].startswith("counted") and counted["ratio"] == pytest.approx(8e6 / 20_000)
    llama = next(r for r in rows if r["model"] == "Llama-2-7B")
    # 32 layers x (6 x 4096 + 11008) columns + embedding and head (4096 each): 1,146,880 fp32 norms
    assert model_columns("llama2-7b") == 32 * (6 * 4096 + 11008) + 2 * 4096
    assert llama["norm_bytes"] == 4 * 1_146_880
    assert llama["gradient_bytes"] == 2 * model_counts("llama2-7b")["column"]
    assert llama["ratio"] == pytest.approx(selection_exchange_bytes(1_146_880, model_counts("llama2-7b")["column"])
                                           ["ratio"])
    assert 2900 < llama["ratio"] < 3000


def test_the_report_writes_a_table_and_a_figure(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    records = [record("ref-zenflow", 1, 100.0, host=1000), record("ref-zenflow", 2, 180.0, host=500, net=40.0,
                                                                 first_step_norms=20_000)]
    text = scaling_report(records, tmp_path, capture_environment())
    assert (tmp_path / "figure.png").stat().st_size > 0
    assert re.search(r"\|\s*ref-zenflow\s*\|\s*2\s*\|", (tmp_path / "table.md").read_text())
    assert "Llama-2-7B 2,938×" in text
