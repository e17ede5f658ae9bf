"""Does the importable DeepSpeed's ZenFlow have PR #8277's weight-view regression? (docs/design.md §7, row G)

    python reproduce/ds_zenflow_regression.py                    # the installed DeepSpeed: ~15 s on 2 CPU cores
    python reproduce/ds_zenflow_regression.py --json found.json  # the findings as JSON too
    PYTHONPATH=/tmp/ds0196 TORCH_EXTENSIONS_DIR=/tmp/ds0196-ext python reproduce/ds_zenflow_regression.py
                                                                 # a release installed with pip install --target
                                                                 # (its first run builds its CPU Adam: minutes)

For users choosing a DeepSpeed release. On DeepSpeed's CPU accelerator (gloo, one process), a bias-free MLP with
rectangular weights (Linear(16, 32), Linear(32, 8)), ZeRO stage 2 and 1 with `offload_optimizer: cpu` and a zenflow
block, fp32:
(a) right after `deepspeed.initialize`, is each weight the model's ("equal"), W.T's memory read as [out, in]
    ("transposed") or "neither"? ZeRO-Offload without the zenflow block is the control.
(b) what that does to training: the full-data MSE after N steps of ZenFlow as shipped, of ZenFlow with the intended
    view (zenflow/harness/engines/ds_divergences.py, what the engine ds-zenflow-intended runs) and of
    torch.optim.AdamW on the same batches; and the loss right after `deepspeed.initialize` of a model first fitted
    with torch ("pretrained"), which initialisation must leave as it is.
(c) one verdict line that names the DeepSpeed version, and PR #8277 when the regression is there.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.metadata
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from zenflow.harness import cli, tables

ROOT = Path(__file__).resolve().parents[1]
STAGES = (2, 1)
WIDTHS = (16, 32, 8)  # two rectangular weights: a square one would only be transposed, not scrambled
SAMPLES, MICRO_BATCH, LR, SEED = 512, 16, 1e-3, 1234
PRETRAIN_STEPS, PRETRAIN_LR = 400, 1e-2  # the "pretrained" model: full-batch torch AdamW until it fits well
# The block of the independent check (docs/history.md, "DeepSpeed's ZenFlow regression"): every step a decision,
# no worker process.
BLOCK = {"topk_ratio": 0.25, "update_interval": 2, "full_warm_up_rounds": 0, "overlap_step": False,
         "select_strategy": "step", "select_interval": 100}
PR = "PR #8277 (issue #8276), first released in DeepSpeed 0.19.7; 0.17.5-0.19.6 view the weights correctly"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=cli.int_at_least(1), default=200, help="training steps of (b) (default 200)")
    ap.add_argument("--json", type=json_path, default=None, help="also write the findings to this JSON file")
    return ap.parse_args(argv)


def json_path(value: str) -> Path:
    """A `type=` for the --json file: its folder must be writable or creatable (checked, not made)."""
    path = Path(value).expanduser()
    problem = "is a folder" if path.is_dir() else cli.folder_problem(path.parent)
    if problem:
        raise argparse.ArgumentTypeError(f"{value!r}: {problem}: expected a file path in a writable folder")
    return path


# ---- the model, the data, the configs -------------------------------------------------------------------------
def mlp(seed: int = SEED) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(WIDTHS[0], WIDTHS[1], bias=False), torch.nn.ReLU(),
                               torch.nn.Linear(WIDTHS[1], WIDTHS[2], bias=False))


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    """SAMPLES inputs and a learnable target: another MLP's outputs (seed 7)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, WIDTHS[0], generator=gen)
    with torch.no_grad():
        y = mlp(seed=7)(x)
    return x, y


def batches(x: torch.Tensor, y: torch.Tensor, steps: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    for t in range(steps):
        i = t * MICRO_BATCH % SAMPLES
        yield x[i:i + MICRO_BATCH], y[i:i + MICRO_BATCH]


def full_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return torch.nn.functional.mse_loss(model(x), y).item()


def ds_config(stage: int, zenflow: bool) -> dict[str, Any]:
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu"}, **({"zenflow": dict(BLOCK)} if zenflow else {})}
    return {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8,
                                                      "weight_decay": 0.0}},
            "zero_optimization": zero, "steps_per_print": 10**9}


# ---- (a) the weights after initialize --------------------------------------------------------------------------
def layout(now: torch.Tensor, given: torch.Tensor) -> str:
    """"equal", "transposed" (W.T's memory read as [out, in]) or "neither"."""
    if torch.equal(now, given):
        return "equal"
    return "transposed" if torch.equal(now, given.t().contiguous().view(given.shape)) else "neither"


def layouts(model: torch.nn.Module, given: list[torch.Tensor]) -> str:
    found = {layout(p.detach(), g) for p, g in zip(model.parameters(), given)}
    return found.pop() if len(found) == 1 else "neither"


# ---- the runs ----------------------------------------------------------------------------------------------------
def train_torch(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, lr: float = LR,
                full_batch: bool = False) -> torch.nn.Module:
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    for xb, yb in ([(x, y)] * steps if full_batch else batches(x, y, steps)):
        torch.nn.functional.mse_loss(model(xb), yb).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


def run_deepspeed(start: torch.nn.Module, stage: int, zenflow: bool, intended: bool, x: torch.Tensor,
                  y: torch.Tensor, steps: int) -> dict[str, Any]:
    """deepspeed.initialize on a copy of `start`; its weights' layout and loss then, and after `steps` steps."""
    import deepspeed

    from zenflow.harness.engines.ds_divergences import intended_weight_view, weight_view_record

    model = copy.deepcopy(start)
    given = [p.detach().clone() for p in model.parameters()]
    view = intended_weight_view() if intended else contextlib.nullcontext()
    with view, contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's own prints: stdout keeps the findings
        config = ds_config(stage, zenflow)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        found = {"weights": layouts(model, given), "loss_at_init": full_loss(model, x, y)}
        if intended:
            found["repair"] = weight_view_record(engine.optimizer)["note"]
        for xb, yb in batches(x, y, steps):
            engine.backward(torch.nn.functional.mse_loss(engine(xb), yb))
            engine.step()
        found["loss_after"] = full_loss(model, x, y)
        if hasattr(engine, "destroy"):
            engine.destroy()
    return found


def start_deepspeed() -> str:
    """DeepSpeed's CPU accelerator, one process on gloo (as the harness's DeepSpeed runs set it up); its version."""
    from zenflow.harness.engines.classes import pin_deepspeed_to_cpu, single_process_env
    from zenflow.harness.preflight import torch_extensions_dir

    pin_deepspeed_to_cpu()
    # CPU Adam is JIT-built into the harness's op cache for the DeepSpeed the project pins; another release's sources
    # get a folder of their own, or the next harness run would rebuild over them.
    version = importlib.metadata.version("deepspeed")
    pinned = re.search(r'"deepspeed==([^"]+)"', (ROOT / "pyproject.toml").read_text())
    cache = torch_extensions_dir()
    if not (pinned and pinned[1] == version):
        cache = cache / f"deepspeed-{version}"
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(cache))
    single_process_env()
    import deepspeed

    with contextlib.redirect_stdout(sys.stderr):
        deepspeed.init_distributed(dist_backend="gloo")
    return deepspeed.__version__


def findings(steps: int) -> dict[str, Any]:
    torch.set_num_threads(1)  # a model this small: more threads only spin (and CPU Adam's OpenMP follows torch's)
    version = start_deepspeed()
    x, y = dataset()
    start = mlp()
    out: dict[str, Any] = {
        "deepspeed": version, "torch": torch.__version__, "accelerator": "cpu (gloo, 1 process)",
        "model": f"Linear({WIDTHS[0]}, {WIDTHS[1]}) ReLU Linear({WIDTHS[1]}, {WIDTHS[2]}), no bias, fp32",
        "zenflow": BLOCK, "steps": steps, "micro_batch": MICRO_BATCH, "lr": LR,
        "torch_adamw": {"loss_at_init": full_loss(start, x, y),
                        "loss_after": full_loss(train_torch(copy.deepcopy(start), x, y, steps), x, y)},
        "runs": {}, "pretrained": {}}
    pretrained = train_torch(copy.deepcopy(start), x, y, PRETRAIN_STEPS, lr=PRETRAIN_LR, full_batch=True)
    out["pretrained"]["torch"] = full_loss(pretrained, x, y)
    for stage in STAGES:
        for view, intended in (("shipped", False), ("intended", True)):
            out["runs"][f"zero{stage}-zenflow-{view}"] = run_deepspeed(start, stage, True, intended, x, y, steps)
            out["pretrained"][f"zero{stage}-zenflow-{view}"] = run_deepspeed(pretrained, stage, True, intended, x, y,
                                                                             0)["loss_at_init"]
    out["runs"]["zero2-offload-control"] = run_deepspeed(start, 2, False, False, x, y, steps)
    out["regression"] = all(out["runs"][f"zero{s}-zenflow-shipped"]["weights"] == "transposed" for s in STAGES)
    out["verdict"] = verdict(out)
    return out


def verdict(found: dict[str, Any]) -> str:
    shipped = {found["runs"][f"zero{s}-zenflow-shipped"]["weights"] for s in STAGES}
    name = f"DeepSpeed {found['deepspeed']}"
    if found["regression"]:
        return (f"REGRESSION: {name}'s ZenFlow (ZeRO stage 1/2) views every 2-D weight transposed from "
                f"deepspeed.initialize on: {PR}. Use DeepSpeed <= 0.19.6, or the engine ds-zenflow-intended "
                "(zenflow/harness/engines/ds_divergences.py).")
    if shipped == {"equal"}:
        return f"OK: {name}'s ZenFlow (ZeRO stage 1/2) keeps the model's weights at deepspeed.initialize."
    return f"UNEXPECTED: {name}'s ZenFlow weights after deepspeed.initialize: {sorted(shipped)} (see (a))."


def report(found: dict[str, Any]) -> str:
    runs, torch_run = found["runs"], found["torch_adamw"]
    lines = [f"DeepSpeed {found['deepspeed']}, torch {found['torch']}, accelerator {found['accelerator']}; "
             f"{found['model']}; zenflow {found['zenflow']}",
             "(a) the weights right after deepspeed.initialize, against the model's:"]
    lines += [f"    {name:<28} {run['weights']}" + (f"  ({run['repair']})" if "repair" in run else "")
              for name, run in runs.items()]
    lines += [f"(b) full-data MSE, {found['steps']} steps of micro-batch {found['micro_batch']}, AdamW lr "
              f"{found['lr']}: at init -> after",
              f"    {'torch AdamW':<28} {torch_run['loss_at_init']:.4f} -> {torch_run['loss_after']:.4f}"]
    lines += [f"    {name:<28} {run['loss_at_init']:.4f} -> {run['loss_after']:.4f}" for name, run in runs.items()]
    pretrained = found["pretrained"]
    lines += [f"    \"pretrained\" (fitted with torch: {pretrained['torch']:.4f}), right after deepspeed.initialize:"]
    lines += [f"    {name:<28} {loss:.4f}" for name, loss in pretrained.items() if name != "torch"]
    lines.append(f"(c) {found['verdict']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    found = findings(args.steps)
    print(report(found))
    if args.json:
        tables.write_json_atomic(args.json, found)
    return 0


if __name__ == "__main__":
    sys.exit(main())
