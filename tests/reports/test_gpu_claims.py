"""The GPU sets beside the claims table (zenflow/reports/gpu_claims.py): a set of the Llama-2-7B layer scenario
under a GPU's hardware id, never one under a cpu-scale id (cpu-scale numbers never stand as a GPU's)."""

from __future__ import annotations

from zenflow.reports.gpu_claims import gpu_sets


def test_a_set_under_a_cpu_scale_hardware_id_is_not_a_gpu_set(tmp_path):
    for hardware in ("cpu-scale-amd-epyc-2c", "nvidia-h100-80gb"):
        folder = tmp_path / "llama7b" / hardware / "llama2-7b-4L"
        folder.mkdir(parents=True)
        (folder / "table.csv").write_text("engine\n")
    assert gpu_sets(tmp_path) == [tmp_path / "llama7b" / "nvidia-h100-80gb" / "llama2-7b-4L"]
