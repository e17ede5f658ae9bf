"""The experiment's constants, in one place: engine names (from registry.py), the ZenFlow block of every run, model
shapes.

Configs are code and named after what they are tuned for (torchtitan's habit): change the block here and every
reproduction, benchmark and check runs with it.
"""

from __future__ import annotations

from zenflow.harness.engines.registry import (  # noqa: F401  (the engines' own constants, re-exported: one place to import)
    DEVICE_FP32_BLOCK,
    OFFLOAD_BLOCK,
    engine_names,
)
from zenflow.harness.engines.zero import TWIN_FLOW_RATIO, TWIN_FLOW_SUB_GROUPS  # noqa: F401  (re-exported, as above)

# The engines, one row each in registry.py, in table order. ENGINES: all of them; CORE_ENGINES: the engines of
# docs/design.md §3 (GLUE and gpu-check run these); CONTROL_ENGINES: the same-update-frequency controls,
# ZeRO-Offload with gradient accumulation = the ZenFlow update interval, so its host optimizer runs as often as
# ZenFlow's; PEER_ENGINES: the peers a user would pick instead, DeepSpeed's ZeRO-Infinity and Twin-Flow,
# PyTorch's FSDP2 with CPUOffloadPolicy and torchao's CPUOffloadOptimizer (CUDA only: "not run here" on a CPU).
ENGINES = engine_names()
# What a run without --engines runs (reproduce/llama7b.py): every row but the opt-in ones (EngineSpec.opt_in:
# ds-zenflow-intended), so that adding such a row leaves the committed result sets as they are.
DEFAULT_ENGINES = engine_names(opt_in=False)
CORE_ENGINES = engine_names("core")
CONTROL_ENGINES = engine_names("control")
PEER_ENGINES = engine_names("peer")
BEYOND_ENGINES = engine_names("beyond")  # ours beyond the paper (ref-zenflow-da): gpu-check runs them with the core

# The engine subsets a script runs or a page shows, each in the order it uses them: named here, beside the groups,
# so that no script or report types a list of engines of its own (a test checks each names registered engines).
# The engine whose telemetry overhead is checked: llama7b runs it again without the optimizer observer, and the
# scenario's notes set the two side by side (reports/scenario.py).
OVERHEAD_ENGINE = "ref-zenflow"
# The paper's Figure 1 comparison, top to bottom (reports/headline_figure.py, panel 1): DeepSpeed's ZeRO-Offload and
# ZenFlow (and the intended-behaviour variant where it ran), ours, and the bound.
PAPER_ENGINES = ("ds-zero-offload", "ds-zenflow", "ds-zenflow-intended", "ref-offload", "ref-zenflow",
                 "ref-zenflow-da", "no-offload")
# llama7b --convergence: the engines whose step computes something different (every-step, every-U-steps, late,
# selected, exact-overlapped) and the bound.
CONVERGENCE_ENGINES = ("ds-zero-offload", "ds-zenflow", "ref-offload", "ref-offload-gas", "ref-zenflow",
                       "ref-zenflow-da", "ref-offload-overlap", "no-offload")
# The GPU window's scenario (reproduce/gpu_window.py): the paper's comparison first; no-offload before ds-zenflow,
# the one most likely to hang (its spawned worker).
GPU_WINDOW_ENGINES = ("ref-zenflow", "ref-offload", "ds-zero-offload", "no-offload", "ds-zenflow",
                      "ref-offload-gas", "ds-zero-offload-gas", "ref-zenflow-da", "ref-offload-overlap",
                      "no-offload-fp32")
# gpu-check --smoke: ours without and with ZenFlow, the shortest runs that exercise the path.
SMOKE_ENGINES = ("ref-offload", "ref-zenflow")
# The claims page (reports/claim_numbers.py): the timed step's speedups it quotes, the time-to-loss speedups (those
# that ran), and the GLUE time-to-accuracy speedups (those that ran).
CLAIM_TIMED_ENGINES = ("ref-zenflow", "ds-zenflow", "ref-offload", "ref-offload-gas", "ref-offload-overlap")
CLAIM_CONVERGENCE_ENGINES = (*CLAIM_TIMED_ENGINES, "ref-zenflow-da")
CLAIM_GLUE_ENGINES = ("ref-zenflow", "ds-zenflow", "ref-offload", "no-offload")

# DeepSpeedExamples' ZenFlow fine-tuning settings (the Llama-2-7B scenario, reproduce/llama7b.py, the benchmarks,
# gpu-check). GLUE reselects twice as often (its epochs are short): GLUE_BLOCK.
DEEPSPEED_EXAMPLES_BLOCK = {"topk_ratio": 0.1, "update_interval": 4, "full_warm_up_rounds": 0, "overlap_step": True,
                            "select_strategy": "step", "select_interval": 64}
GLUE_BLOCK = {**DEEPSPEED_EXAMPLES_BLOCK, "select_interval": 32}
# GLUE's default training subsets (data seed 0), sized so that five engines × three seeds fit ≈60 min on 2 cores
# (docs/glue.md has the measured per-run times); any other task: 2048.
GLUE_TRAIN_EXAMPLES = {"SST-2": 2048, "MRPC": 2560, "RTE": 1024}

# A tiny Llama (the smoke runs of reproduce scripts, bench's ZENFLOW_BENCH_SMALL, calibration smoke): 2 layers of 64.
TINY_LLAMA_SHAPE = {"hidden": 64, "layers": 2, "intermediate": 128, "heads": 4}

# Random-weight models at a published model's layer shapes (reproduce/llama7b.py --shape NAME --layers N; the
# workload's model is "<NAME>-shape"): per-layer compute and host work are the full model's, N layers of it.
SHAPES = {"llama2-7b": {"hidden": 4096, "intermediate": 11008, "heads": 32, "layers": 32}}
