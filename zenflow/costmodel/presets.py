"""Inputs of the cost model: from a calibration record (cpu-scale, measured) or from stated hardware facts (GPU,
projected). Every GPU / model number below carries its source; docs/cost-model.md repeats them."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from zenflow.costmodel.model import CostModelError, Inputs
from zenflow.telemetry.environment import capture_environment

MFU = 0.40  # assumed model FLOP utilisation of forward+backward (dense bf16 fine-tuning); an assumption, not fitted
HBM_EFFICIENCY = 0.7  # assumed fraction of datasheet HBM bandwidth reached by the memory-bound optimizer kernels
BYTES_DEVICE_COL = 40.0  # per selected element: gather grad (2 r + 4 w), fp32 AdamW (master, m, v r+w: 24; grad 4)
#                          scatter (4 r + 2 w) -> 40 bytes
BYTES_DEVICE_ADAMW = 32.0  # no-offload, per param: bf16 param r+w 4, grad 2 (+2 norm), fp32 master/m/v r+w 24
BYTES_HOST_ADAMW = 30.0  # host AdamW per element: fp32 master/m/v r+w 24, fp32 grad 4, bf16 upload cast 2
BYTES_HOST_ACCUM = 10.0  # host accumulation per element: bf16 staging 2, fp32 accumulator r+w 8
BYTES_DEVICE_ACCUM = 14.0  # device accumulation per element: gather bf16 r+w 4, then fp32 += bf16: 2 + 4 r, 4 w

# name: (label, bf16 dense TFLOP/s, HBM GB/s, host link GB/s per direction, device GB, host cores per GPU,
#        host memory GB/s per GPU, sources)
GPUS: dict[str, dict[str, Any]] = {
    "a100": dict(label="A100 80GB SXM, PCIe 4.0 x16", tflops=312.0, hbm_gbps=2039.0, link_gbps=25.0, mem_gb=80.0,
                 host_cores=16, host_mem_gbps=51.2,
                 sources="NVIDIA A100 datasheet (312 TFLOP/s bf16 dense, 2039 GB/s HBM2e); ~25 GB/s measured pinned "
                         "host-to-device on PCIe 4.0 x16 (public bandwidthTest results, issue 6); DGX A100: 2x AMD "
                         "EPYC 7742 (128 cores, 8x DDR4-3200 per socket = 204.8 GB/s) for 8 GPUs -> 16 cores and "
                         "51.2 GB/s per GPU"),
    "h100": dict(label="H100 80GB SXM5, PCIe 5.0 x16", tflops=989.0, hbm_gbps=3350.0, link_gbps=55.0, mem_gb=80.0,
                 host_cores=14, host_mem_gbps=76.8,
                 sources="NVIDIA H100 datasheet (989 TFLOP/s bf16 dense, 3.35 TB/s HBM3); ~55 GB/s measured pinned "
                         "host-to-device on PCIe 5.0 x16 (issue 6); DGX H100: 2x Xeon Platinum 8480C (112 cores, "
                         "8x DDR5-4800 per socket = 307.2 GB/s) for 8 GPUs -> 14 cores and 76.8 GB/s per GPU"),
}
# Hugging Face config.json of each model: vocab, hidden, intermediate, layers, heads, kv heads, tied, qkv bias.
MODELS: dict[str, dict[str, Any]] = {
    "llama2-7b": dict(label="Llama-2-7B", vocab=32000, hidden=4096, inter=11008, layers=32, heads=32, kv=32,
                      tied=False, qkv_bias=False),
    "llama2-13b": dict(label="Llama-2-13B", vocab=32000, hidden=5120, inter=13824, layers=40, heads=40, kv=40,
                       tied=False, qkv_bias=False),
    "qwen2.5-1.5b": dict(label="Qwen2.5-1.5B", vocab=151936, hidden=1536, inter=8960, layers=28, heads=12, kv=2,
                         tied=True, qkv_bias=True),
    "qwen2.5-3b": dict(label="Qwen2.5-3B", vocab=151936, hidden=2048, inter=11008, layers=36, heads=16, kv=2,
                       tied=True, qkv_bias=True),
}
GPU_SEQ, GPU_MICRO_BATCH = 512, 8  # docs/design.md §5 (seq 512); DeepSpeedExamples ZenFlow Llama-2 script: batch 8
GPU_WORLD = 4  # DeepSpeed's ZenFlow blog: Llama 2-7B on 4x A100 (ZeRO-2: each rank offloads N / 4)


def model_counts(name: str) -> dict[str, float]:
    """Column params (2-D weights), dense params (norms, biases) and matmul params (no input embedding)."""
    if name not in MODELS:
        raise CostModelError(f"model = {name!r}: unknown preset, expected one of {list(MODELS)}")
    m = MODELS[name]
    h, kv_dim = m["hidden"], m["hidden"] // m["heads"] * m["kv"]
    per_layer = h * h * 2 + 2 * h * kv_dim + 3 * h * m["inter"]  # q, o; k, v; gate, up, down
    embed = m["vocab"] * h
    column = m["layers"] * per_layer + embed * (1 if m["tied"] else 2)
    dense = m["layers"] * 2 * h + h + (m["layers"] * (h + 2 * kv_dim) if m["qkv_bias"] else 0)
    return {"column": float(column), "dense": float(dense), "matmul": float(m["layers"] * per_layer + embed)}


def model_columns(name: str) -> int:
    """Columns of every column param (the sum of their input widths): what a selection exchanges one norm for."""
    model_counts(name)  # refuses an unknown preset
    m = MODELS[name]
    h = m["hidden"]
    return m["layers"] * (6 * h + m["inter"]) + h * (1 if m["tied"] else 2)  # q k v o gate up: h; down: inter


def load_calibration(path: str | Path, expect_hardware_id: str | None = "this machine") -> dict[str, Any]:
    """A calibration record; refused when it was measured on another hardware id than this machine's."""
    path = Path(path)
    if not path.exists():
        raise CostModelError(f"calibration record {str(path)!r} not found "
                             "(make it: python -m zenflow.costmodel.calibrate)")
    try:
        cal = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CostModelError(f"{path}: not a JSON calibration record ({exc})") from None
    if cal.get("schema") != "costmodel-calibration/1":
        raise CostModelError(f"{path}: schema = {cal.get('schema')!r}, expected 'costmodel-calibration/1'")
    if expect_hardware_id == "this machine":
        expect_hardware_id = capture_environment()["hardware_id"]
    if expect_hardware_id is not None and cal.get("hardware_id") != expect_hardware_id:
        raise CostModelError(f"{path}: calibration record of hardware id {cal.get('hardware_id')!r}, but this is "
                             f"{expect_hardware_id!r}; calibrate here: python -m zenflow.costmodel.calibrate")
    return cal


def fb_ms(cal: dict[str, Any], loop: str, tokens: float) -> float:
    """Forward+backward: piecewise linear through the calibrated sequence lengths, extended beyond them by the
    nearest segment (fixed + per-token time; attention makes the per-token time grow with the sequence)."""
    points = sorted((int(s), ms) for s, ms in cal["loops"][loop]["forward_backward_ms"].items())
    segment = next((i for i in range(1, len(points) - 1) if tokens <= points[i][0]), len(points) - 1)
    (s0, t0), (s1, t1) = points[segment - 1], points[segment]
    return max(1e-3, t0 + (t1 - t0) / (s1 - s0) * (tokens - s0))


def cpu_scale_inputs(cal: dict[str, Any], seq_len: int, micro_batch: int = 1) -> Inputs:
    """The cpu-scale machine: device and host are the same 2 cores. Sync engines use both cores for everything;
    overlap engines give the device one core and the worker the other, and both share memory bandwidth."""
    if seq_len < 1 or micro_batch < 1:
        raise CostModelError(f"seq_len = {seq_len!r}, micro_batch = {micro_batch!r}: expected ints >= 1")
    n, b = float(cal["column_elements"]), float(cal["element_bytes"])
    loops = cal["loops"]
    off, zen, zen0 = (loops[k]["step_parts_ms"] for k in ("offload_2t", "zenflow_r0.1_1t", "zenflow_r0_1t"))
    host_n = 0.9 * n
    tokens = seq_len * micro_batch
    return Inputs(
        column_params=n, dense_params=float(cal["model"]["dense_parameters"]), tokens=tokens, dtype_bytes=b,
        fb_ms=fb_ms(cal, "offload_2t", tokens), fb_ms_overlap=fb_ms(cal, "zenflow_r0.1_1t", tokens),
        fb_ms_no_offload=fb_ms(cal, "no_offload_2t", tokens),
        device_opt_ms=loops["no_offload_2t"]["step_parts_ms"]["total"], device_base_ms=off["device"],
        device_base_ms_overlap=zen0["device"], device_col_ns=max(0.0, zen["device"] - zen0["device"]) / (0.1 * n) * 1e6,
        d2h_gbps=n * b / off["copy_d2h"] / 1e6, h2d_gbps=n * b / off["copy_h2d"] / 1e6,
        gather_gbps=host_n * b / zen["copy_d2h"] / 1e6, scatter_gbps=host_n * b / zen["copy_h2d"] / 1e6,
        accum_gelem_s=n / off["host_accumulate"] / 1e6, adamw_gelem_s=n / off["host_update"] / 1e6,
        accum_gelem_s_worker=host_n / zen["host_accumulate"] / 1e6,
        adamw_gelem_s_worker=host_n / zen["host_update"] / 1e6,
        compute_slowdown=cal["contention"]["compute_slowdown"], host_slowdown=cal["contention"]["host_slowdown"],
        # device accumulation: the "device" is these cores, so its gather + add run at the host's copy and
        # accumulation rates of the layout (sync: 2 threads, plain-copy rate; overlap: the device's 1 core)
        device_accum_gelem_s=1 / (b / (n * b / off["copy_d2h"] / 1e6) + off["host_accumulate"] * 1e6 / n),
        device_accum_gelem_s_overlap=1 / (b / (host_n * b / zen["copy_d2h"] / 1e6)
                                          + zen["host_accumulate"] * 1e6 / host_n))


def split_inputs(cal: dict[str, Any], seq_len: int, micro_batch: int = 1) -> Inputs:
    """The split placement, the GPU analog (docs/design.md §3): the device's work on one core, the host's on the
    other, for every engine. The overlap engines already run so at the shared placement (their inputs are
    `cpu_scale_inputs`', but for the plain copies: device accumulation's shipped sum crosses on one core too); a
    sync engine's device phases now run on one thread and its host phases on the other core, one thread, one after
    the other: the 1-thread loops' rates (no-offload's own 1-thread loop for no-offload)."""
    if "no_offload_1t" not in cal["loops"]:
        raise CostModelError("the calibration has no no_offload_1t loop (made before the split placement): "
                             "calibrate again: python -m zenflow.costmodel.calibrate")
    x = cpu_scale_inputs(cal, seq_len, micro_batch)
    n, b = float(cal["column_elements"]), float(cal["element_bytes"])
    one = cal["loops"]["zenflow_r0_1t"]["step_parts_ms"]
    return replace(
        x, fb_ms=fb_ms(cal, "zenflow_r0_1t", x.tokens), fb_ms_no_offload=fb_ms(cal, "no_offload_1t", x.tokens),
        device_opt_ms=cal["loops"]["no_offload_1t"]["step_parts_ms"]["total"], device_base_ms=one["device"],
        d2h_gbps=n * b / one["copy_d2h"] / 1e6, h2d_gbps=n * b / one["copy_h2d"] / 1e6,
        accum_gelem_s=n / one["host_accumulate"] / 1e6, adamw_gelem_s=n / one["host_update"] / 1e6,
        device_accum_gelem_s=x.device_accum_gelem_s_overlap)  # the device's one core, as in the overlap layout


INPUTS = {"shared": cpu_scale_inputs, "split": split_inputs}  # the cost model's inputs at each placement


def host_rates_per_core(cal: dict[str, Any]) -> tuple[float, float]:
    """Host AdamW and accumulation, G elements/s on one core of the calibrated machine (the worker's rates)."""
    x = cpu_scale_inputs(cal, 16)
    return x.adamw_gelem_s_worker, x.accum_gelem_s_worker


def gpu_inputs(model: str, gpu: str, adamw_per_core: float, accum_per_core: float, seq_len: int = GPU_SEQ,
               micro_batch: int = GPU_MICRO_BATCH, mfu: float = MFU, world_size: int = GPU_WORLD,
               **override: float) -> Inputs:
    """One GPU of a DGX-class server (projected): forward+backward from FLOPs at an assumed MFU, device optimizer
    kernels from HBM bandwidth, transfers at the measured PCIe rate, host work at per-core rates x cores, capped by
    the GPU's share of host memory bandwidth."""
    if gpu not in GPUS:
        raise CostModelError(f"gpu = {gpu!r}: unknown GPU preset, expected one of {list(GPUS)}")
    if seq_len < 1 or micro_batch < 1 or world_size < 1:
        raise CostModelError(f"seq_len = {seq_len!r}, micro_batch = {micro_batch!r}, world_size = {world_size!r}: "
                             "expected ints >= 1")
    g = {**GPUS[gpu], **{k: v for k, v in override.items() if v is not None}}
    for key in ("tflops", "hbm_gbps", "link_gbps", "host_cores", "host_mem_gbps"):
        if not g[key] or g[key] <= 0:
            raise CostModelError(f"{key} = {g[key]!r}: must be > 0")
    if not 0 < mfu <= 1 or adamw_per_core <= 0 or accum_per_core <= 0:
        raise CostModelError(f"mfu = {mfu!r}, adamw/accum per core = {adamw_per_core!r}/{accum_per_core!r}: "
                             "expected 0 < mfu <= 1 and rates > 0")
    c = override.get("counts") or model_counts(model)
    m = MODELS.get(model, MODELS["llama2-7b"])
    tokens = seq_len * micro_batch
    flops = 6 * c["matmul"] * tokens + 12 * m["layers"] * m["hidden"] * seq_len * tokens  # PaLM's 6N + 12·L·h·s
    fb = flops / (g["tflops"] * 1e12 * mfu) * 1e3
    hbm = g["hbm_gbps"] * HBM_EFFICIENCY * 1e6  # bytes per ms
    n, dense = c["column"] / world_size, c["dense"] / world_size  # ZeRO-2: each rank owns 1/world of the state
    adamw = min(g["host_cores"] * adamw_per_core, g["host_mem_gbps"] / BYTES_HOST_ADAMW)
    accum = min(g["host_cores"] * accum_per_core, g["host_mem_gbps"] / BYTES_HOST_ACCUM)
    return Inputs(column_params=n, dense_params=dense, tokens=tokens, dtype_bytes=2.0, fb_ms=fb, fb_ms_overlap=fb,
                  device_opt_ms=(n + dense) * BYTES_DEVICE_ADAMW / hbm, device_base_ms=n * 2 / hbm,
                  device_base_ms_overlap=n * 2 / hbm, device_col_ns=BYTES_DEVICE_COL / hbm * 1e6,
                  d2h_gbps=g["link_gbps"], h2d_gbps=g["link_gbps"], gather_gbps=g["link_gbps"],
                  scatter_gbps=g["link_gbps"], accum_gelem_s=accum, adamw_gelem_s=adamw,
                  accum_gelem_s_worker=accum, adamw_gelem_s_worker=adamw, grad_copy_hidden=True,
                  device_accum_gelem_s=hbm / BYTES_DEVICE_ACCUM / 1e6,
                  device_accum_gelem_s_overlap=hbm / BYTES_DEVICE_ACCUM / 1e6)


def default_calibration() -> Path:
    return Path(__file__).resolve().parents[2] / "results" / "costmodel" / capture_environment()["hardware_id"] \
        / "calibration.json"


def gpu_inputs_from_args(args: Any) -> tuple[Inputs, str, float]:
    """The what-if CLI: a GPU preset and a model preset, each number overridable; host per-core rates from the
    flags or from this machine's calibration record."""
    if not args.gpu:
        raise CostModelError("--gpu is required (a100, h100) unless --calibration is given")
    if args.gpu not in GPUS:
        raise CostModelError(f"--gpu = {args.gpu!r}: unknown GPU preset, expected one of {list(GPUS)}")
    if args.model not in MODELS and args.params is None:
        raise CostModelError(f"--model = {args.model!r}: unknown preset, expected one of {list(MODELS)} "
                             "(or give --params)")
    adamw, accum = args.adamw_gelem_per_core, args.accum_gelem_per_core
    if adamw is None or accum is None:
        cal_adamw, cal_accum = host_rates_per_core(load_calibration(default_calibration()))
        adamw, accum = _given(adamw, cal_adamw), _given(accum, cal_accum)
    counts = None
    if args.params is not None:
        if args.params <= 0:
            raise CostModelError(f"--params = {args.params!r}: must be > 0")
        counts = {"column": args.params, "dense": 0.0, "matmul": args.params}
    x = gpu_inputs(args.model, args.gpu, adamw, accum, seq_len=_given(args.seq_len, GPU_SEQ),
                   micro_batch=_given(args.micro_batch, GPU_MICRO_BATCH), mfu=_given(args.mfu, MFU), tflops=args.tflops,
                   world_size=_given(args.world_size, GPU_WORLD), hbm_gbps=args.hbm_gbps, link_gbps=args.link_gbps,
                   host_cores=args.host_cores, counts=counts)
    mem = args.gpu_mem_gb or GPUS[args.gpu]["mem_gb"]
    # device memory: bf16 params + grads (4 B) + fp32 master/m/v of the selected columns (12 B·r); activations not
    # counted. The largest r that fits:
    full = x.column_params * _given(args.world_size, GPU_WORLD)
    free = mem * 1e9 - 4 * full - 4 * x.dense_params  # bf16 params (whole model) + grads
    fraction = max(0.0, min(1.0, free / (12 * x.column_params)))
    label = f"{MODELS.get(args.model, {}).get('label', args.model)} on {GPUS[args.gpu]['label']}"
    return x, f"{label}, {x.tokens:.0f} tokens/step", fraction


def _given(value: Any, default: Any) -> Any:
    return default if value is None else value
