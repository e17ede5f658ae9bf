"""The experiment's constants, in one place: engine names, the ZenFlow block of every run, model shapes.

Configs are code and named after what they are tuned for (torchtitan's habit): change the block here and every
reproduction, benchmark and check runs with it.
"""

from __future__ import annotations

# The engines of DESIGN §3 (GLUE and gpu-check run these), and the same-update-frequency controls (issue 14):
# ZeRO-Offload with gradient accumulation = the ZenFlow update interval, so its host optimizer runs as often as
# ZenFlow's. ENGINES: all of them, in table order.
# The peers a user would pick instead (issue 14): DeepSpeed's ZeRO-Infinity (ZeRO-3, parameters and optimizer on the
# host) and Twin-Flow (ZeRO-3, a share of the optimizer on the host), PyTorch's FSDP2 with CPUOffloadPolicy and
# torchao's CPUOffloadOptimizer (CUDA only: "not run here" on a CPU machine).
CORE_ENGINES = ("ds-zero-offload", "ds-zenflow", "ref-offload", "ref-zenflow", "no-offload")
CONTROL_ENGINES = ("ds-zero-offload-gas", "ref-offload-gas")
PEER_ENGINES = ("ds-zero-infinity", "ds-twin-flow", "fsdp2-offload", "torchao-offload")
ENGINES = ("ds-zero-offload", "ds-zero-offload-gas", "ds-zenflow", "ds-zero-infinity", "ds-twin-flow", "ref-offload",
           "ref-offload-gas", "ref-zenflow", "fsdp2-offload", "torchao-offload", "no-offload", "no-offload-fp32")

# Twin-Flow: the share of the optimizer's sub-groups DeepSpeed keeps on the host (offload_optimizer.ratio), and how
# many sub-groups the model is cut into for it (DeepSpeed splits by whole sub-groups; its default sub_group_size of
# 1e9 elements makes one group of any model under 1B parameters, and then the ratio has nothing to split).
TWIN_FLOW_RATIO = 0.5
TWIN_FLOW_SUB_GROUPS = 16

# ZeRO-Offload expressed as a ZenFlow block: nothing selected, every step a synchronous host update.
OFFLOAD_BLOCK = {"topk_ratio": 0.0, "update_interval": 1, "select_interval": 1, "overlap_step": False}
# no-offload-fp32, the comparable no-offload baseline: every column selected, so AdamW runs on the device every step
# from an fp32 master and fp32 moments (torch.optim.AdamW's numbers on an fp32 copy: DESIGN's topk_ratio=1 oracle),
# where no-offload is torch AdamW on the bf16 parameters themselves (small updates round away in bf16).
DEVICE_FP32_BLOCK = {"topk_ratio": 1.0, "update_interval": 1, "select_interval": 10**9, "overlap_step": False}

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
