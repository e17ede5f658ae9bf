"""What-if: predicted ZeRO-Offload vs ZenFlow step time for your hardware, from the cost model (PROJECTED, never a
measurement; docs/cost-model.md).

    python -m zenflow.costmodel.whatif --gpu h100 --model llama2-7b
    python -m zenflow.costmodel.whatif --calibration results/costmodel/<hardware-id>/calibration.json
"""

from __future__ import annotations

import argparse
import sys

from zenflow.costmodel import presets
from zenflow.costmodel.model import Block, CostModelError, best_block, predict_all


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m zenflow.costmodel.whatif",
        description="What-if: predicted ZeRO-Offload vs ZenFlow step time for your hardware (projected, not measured). "
        "Either a GPU preset (--gpu) with a model preset or your own numbers, or --calibration RECORD for this "
        "machine's cpu-scale workload.")
    ap.add_argument("--gpu", help=f"GPU preset: {', '.join(presets.GPUS)}")
    ap.add_argument("--model", default="llama2-7b", help=f"model preset: {', '.join(presets.MODELS)}")
    ap.add_argument("--calibration", help="a calibration record of THIS machine (results/costmodel/<id>/...)")
    ap.add_argument("--seq-len", type=int, help="tokens per sample (calibration: default 16; GPU: 512)")
    ap.add_argument("--micro-batch", type=int, help="samples per step per GPU (GPU default 8)")
    ap.add_argument("--params", type=float, help="column (2-D) params, e.g. 6.7e9 (overrides the model preset)")
    ap.add_argument("--tflops", type=float, help="device bf16 peak TFLOP/s (overrides the GPU preset)")
    ap.add_argument("--mfu", type=float, help=f"model FLOP utilisation (default {presets.MFU})")
    ap.add_argument("--hbm-gbps", type=float, help="device memory bandwidth, GB/s")
    ap.add_argument("--link-gbps", type=float, help="measured host<->device GB/s per direction")
    ap.add_argument("--host-cores", type=int, help="host cores for the optimizer, per GPU")
    ap.add_argument("--adamw-gelem-per-core", type=float, help="host AdamW G elements/s per core")
    ap.add_argument("--accum-gelem-per-core", type=float, help="host fp32 accumulation G elements/s per core")
    ap.add_argument("--world-size", type=int, help="GPUs, ZeRO-2 data parallel (default 4)")
    ap.add_argument("--gpu-mem-gb", type=float, help="device memory, GB: bounds topk_ratio")
    ap.add_argument("--topk-ratio", type=float, default=0.1)
    ap.add_argument("--update-interval", type=int, default=4)
    args = ap.parse_args(argv)
    try:
        if args.calibration:
            cal = presets.load_calibration(args.calibration)
            seq = 16 if args.seq_len is None else args.seq_len
            x = presets.cpu_scale_inputs(cal, seq_len=seq)
            what, mem_fraction = f"cpu-scale, {cal['hardware_id']}, seq {seq}", 1.0
        else:
            x, what, mem_fraction = presets.gpu_inputs_from_args(args)
        block = Block(args.topk_ratio, args.update_interval)
        preds = predict_all(x, block)
        best, best_pred = best_block(x, mem_fraction)
    except CostModelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    base = preds["zero-offload"].cycle_ms
    print(f"PROJECTED (cost model, not a measurement): {what}\n")
    print(f"{'engine':18} {'cycle ms':>10} {'accum ms':>9} {'update ms':>10} {'compute':>9} {'I/O':>8} "
          f"{'stall':>9} {'GB/step':>8} {'speedup':>8}")
    for p in preds.values():
        acc = "—" if p.accumulate_ms is None else f"{p.accumulate_ms:.1f}"
        print(f"{p.engine:18} {p.cycle_ms:10.1f} {acc:>9} {p.update_ms:10.1f} {p.compute_ms:9.1f} {p.io_ms:8.1f} "
              f"{p.stall_ms:9.1f} {p.bytes_per_step / 1e9:8.2f} {base / p.cycle_ms:7.2f}×")
    zen = preds["zenflow-overlap"]
    stall_cut = 1 - zen.stall_ms / preds["zero-offload"].stall_ms if preds["zero-offload"].stall_ms else 0.0
    print(f"\nZenFlow (topk {block.topk_ratio}, U {block.update_interval}, overlap) over ZeRO-Offload: "
          f"{base / zen.cycle_ms:.2f}× speedup, stall −{100 * stall_cut:.0f}%")
    print(f"best block by the model: topk_ratio {best.topk_ratio}, update_interval {best.update_interval} → "
          f"{best_pred.cycle_ms:.1f} ms/step, {base / best_pred.cycle_ms:.2f}× over ZeRO-Offload"
          + (f" (topk_ratio ≤ {mem_fraction:.2f} fits device memory)" if mem_fraction < 1 else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
