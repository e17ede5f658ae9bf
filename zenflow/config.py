"""ZenFlow configuration: DeepSpeed's `zenflow` block, validated up front.

Field names and defaults are DeepSpeed's, so a user's existing `ds_config.json` works verbatim. Every check runs
before the optimizer allocates anything, and every error names the field, the value and what is allowed.
The "auto" rules are documented in docs/step-semantics.md and resolved here into plain integers where possible.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

AUTO = "auto"
SELECT_STRATEGIES = ("auto", "step", "epoch")
COLUMN_NORMS = ("l2", "l1")
# Where the unselected gradient columns are summed between host updates: ZenFlowAdamW's `accumulate_on` keyword, ours,
# outside DeepSpeed's `zenflow` vocabulary, so a DeepSpeed config cannot carry it (docs/host-worker.md).
ACCUMULATE_ON = ("host", "device")
# select_interval="auto" when the epoch length is unknown: reselect every this many steps (rounded up to a
# multiple of an integer update_interval so reselection lands on a boundary and costs no extra drain).
AUTO_SELECT_INTERVAL_STEPS = 64
# update_interval="auto" never lets the host part fall further behind than this many steps.
AUTO_MAX_UPDATE_INTERVAL = 16


class ConfigError(ValueError):
    """A configuration value that is not allowed; the message names the field, the value and the rule."""


@dataclass(frozen=True)
class ZenFlowConfig:
    """DeepSpeed's `zero_optimization.zenflow` block (plus `column_norm`, ours: "l2" or "l1")."""

    topk_ratio: float = 0.1
    select_strategy: str = AUTO
    select_interval: int | str = AUTO
    update_interval: int | str = AUTO
    full_warm_up_rounds: int = 0
    overlap_step: bool = False
    offload: bool = False
    auto_ratio: float = 0.99
    pt_reserved_cores_perc: float = 0.5
    steps_per_epoch: int | None = None
    column_norm: str = "l2"
    max_update_interval: int = AUTO_MAX_UPDATE_INTERVAL

    def __post_init__(self) -> None:
        _validate(self)

    @classmethod
    def from_dict(cls, block: dict[str, Any] | None) -> ZenFlowConfig:
        block = dict(block or {})
        _reject_accumulate_on(block)
        _reject_unknown_keys(block, [f.name for f in dataclasses.fields(cls)], "zenflow")
        return cls(**block)

    @classmethod
    def coerce(cls, value: ZenFlowConfig | dict[str, Any] | None) -> ZenFlowConfig:
        if isinstance(value, cls):
            return value
        if value is None or isinstance(value, dict):
            return cls.from_dict(value)
        raise ConfigError(f"zenflow: expected a dict or ZenFlowConfig, found {type(value).__name__}")

    # ---- resolved values (the "auto" rules) -------------------------------------------------------------
    @property
    def auto_update(self) -> bool:
        return self.update_interval == AUTO

    def resolved_select_interval(self) -> int:
        """Steps between reselections. "epoch" counts in epochs; "auto" means once per epoch when known."""
        strategy = self.select_strategy
        if strategy == AUTO:
            strategy = "epoch" if self.steps_per_epoch else "step"
        if strategy == "epoch":
            epochs = 1 if self.select_interval == AUTO else int(self.select_interval)
            return epochs * int(self.steps_per_epoch)  # validated non-None for "epoch"
        if self.select_interval != AUTO:
            return int(self.select_interval)
        steps = AUTO_SELECT_INTERVAL_STEPS
        if isinstance(self.update_interval, int):
            steps = math.ceil(steps / self.update_interval) * self.update_interval
        return steps


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _fail(field: str, value: Any, allowed: str) -> None:
    raise ConfigError(f"zenflow.{field} = {value!r} is not allowed: expected {allowed}")


def _validate(c: ZenFlowConfig) -> None:
    if not _is_number(c.topk_ratio) or not 0.0 <= c.topk_ratio <= 1.0:
        _fail("topk_ratio", c.topk_ratio, "a number in [0, 1]")
    if c.select_strategy not in SELECT_STRATEGIES:
        _fail("select_strategy", c.select_strategy, f"one of {SELECT_STRATEGIES}")
    for name in ("update_interval", "select_interval"):
        value = getattr(c, name)
        if value != AUTO and (not _is_int(value) or value < 1):
            _fail(name, value, '"auto" or an integer >= 1')
    if not _is_int(c.full_warm_up_rounds) or c.full_warm_up_rounds < 0:
        _fail("full_warm_up_rounds", c.full_warm_up_rounds, "an integer >= 0")
    for name in ("overlap_step", "offload"):
        if not isinstance(getattr(c, name), bool):
            _fail(name, getattr(c, name), "true or false")
    if not _is_number(c.auto_ratio) or not 0.0 < c.auto_ratio <= 1.0:
        _fail("auto_ratio", c.auto_ratio, "a number in (0, 1]")
    if not _is_number(c.pt_reserved_cores_perc) or not 0.0 <= c.pt_reserved_cores_perc <= 1.0:
        _fail("pt_reserved_cores_perc", c.pt_reserved_cores_perc,
              "a number in [0, 1] (fraction of CPU cores kept for PyTorch compute; the rest run the host worker)")
    if c.steps_per_epoch is not None and (not _is_int(c.steps_per_epoch) or c.steps_per_epoch < 1):
        _fail("steps_per_epoch", c.steps_per_epoch, "null or an integer >= 1")
    if c.select_strategy == "epoch" and c.steps_per_epoch is None:
        _fail("select_strategy", c.select_strategy, '"step" or "auto" unless steps_per_epoch is given')
    # select_interval counts steps only under the "step" strategy ("auto" with steps_per_epoch counts epochs)
    counts_steps = c.select_strategy == "step" or (c.select_strategy == AUTO and c.steps_per_epoch is None)
    if counts_steps and _is_int(c.update_interval) and _is_int(c.select_interval):
        if c.select_interval < c.update_interval:
            _fail("select_interval", c.select_interval,
                  f"an integer >= update_interval ({c.update_interval}): reselection waits for a host boundary")
    if c.column_norm not in COLUMN_NORMS:
        _fail("column_norm", c.column_norm, f"one of {COLUMN_NORMS}")
    if not _is_int(c.max_update_interval) or c.max_update_interval < 1:
        _fail("max_update_interval", c.max_update_interval, "an integer >= 1")


def check_accumulate_on(value: Any) -> str:
    """ZenFlowAdamW's `accumulate_on` keyword: "host" (every step's unselected gradient columns cross and the host
    sums them) or "device" (an fp32 sum on the device crosses once per interval)."""
    if not isinstance(value, str) or value not in ACCUMULATE_ON:
        raise ConfigError(f"accumulate_on = {value!r} is not allowed: expected one of {ACCUMULATE_ON}")
    return value


def _reject_accumulate_on(block: dict[str, Any]) -> None:
    """A device-accumulation request inside the zenflow block is refused by name, before the generic unknown-key
    check, so that the message says where the option lives: DeepSpeed has no such field, and a config that both
    engines read must mean the same to both."""
    for key in block:
        if key == "accumulate_on" or "accumulat" in str(key).lower():
            raise ConfigError(f"zenflow.{key} = {block[key]!r} is not allowed: expected no such key in the zenflow "
                              "block (it is not a DeepSpeed field); where the unselected gradient is summed is the "
                              f"optimizer's keyword: ZenFlowAdamW(..., accumulate_on=...) with one of {ACCUMULATE_ON}")


def _reject_unknown_keys(block: dict[str, Any], known: list[str], where: str) -> None:
    for key in block:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(known)}"
            raise ConfigError(f"{where}: unknown key {key!r}{hint}")


# ---- whole DeepSpeed JSON ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class OptimizerSettings:
    """Everything ZenFlowAdamW needs from a DeepSpeed config."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    gradient_clipping: float = 0.0
    dtype: str = "fp32"  # "fp32" | "bf16" | "fp16": the model dtype DeepSpeed would train in
    zenflow: ZenFlowConfig = dataclasses.field(default_factory=ZenFlowConfig)


OPTIMIZER_TYPES = ("adamw", "adam")


def load_deepspeed_config(source: str | Path | dict[str, Any]) -> OptimizerSettings:
    """Read the parts of a DeepSpeed config that define ZenFlow's optimizer.

    `weight_decay` omitted from `optimizer.params` means 0.0 on *both* parts (DeepSpeed 0.19 uses 0.01 on the
    device part and 0 on the host part: divergence E).
    """
    ds = _read_json(source) if not isinstance(source, dict) else source
    zero = _section(ds.get("zero_optimization"), "zero_optimization")
    if zero.get("zenflow") is None:  # DeepSpeed reads "zenflow": null as ZenFlow off
        raise ConfigError("zero_optimization.zenflow: missing; a ZenFlow optimizer needs the zenflow block")
    offload = _section(zero.get("offload_optimizer"), "zero_optimization.offload_optimizer").get("device", "none")
    if offload != "cpu":
        raise ConfigError(f"zero_optimization.offload_optimizer.device = {offload!r} is not allowed with zenflow: "
                          "expected \"cpu\" (ZenFlow is an extension of ZeRO-Offload)")
    optimizer = _section(ds.get("optimizer"), "optimizer") or {"type": "AdamW", "params": {}}
    kind = str(optimizer.get("type", "AdamW")).lower()
    if kind not in OPTIMIZER_TYPES:
        raise ConfigError(f"optimizer.type = {optimizer.get('type')!r} is not allowed: expected one of "
                          f"{OPTIMIZER_TYPES} (ZenFlow implements AdamW)")
    params = dict(_section(optimizer.get("params"), "optimizer.params"))
    known = ["lr", "betas", "eps", "weight_decay", "torch_adam", "adam_w_mode", "bias_correction", "amsgrad"]
    _reject_unknown_keys(params, known, "optimizer.params")
    if params.get("amsgrad"):
        raise ConfigError("optimizer.params.amsgrad = true is not allowed: expected false (not supported)")
    if params.get("adam_w_mode") is False:
        raise ConfigError("optimizer.params.adam_w_mode = false is not allowed: expected true (decoupled decay)")
    clipping = ds.get("gradient_clipping", 0.0)
    if not _is_number(clipping) or not clipping >= 0:  # also rejects NaN
        raise ConfigError(f"gradient_clipping = {clipping!r} is not allowed: expected a number >= 0")
    bf16, fp16 = (_section(ds.get(name), name).get("enabled", False) for name in ("bf16", "fp16"))
    for name, enabled in (("bf16", bf16), ("fp16", fp16)):
        if not isinstance(enabled, bool):
            raise ConfigError(f"{name}.enabled = {enabled!r} is not allowed: expected true or false")
    if bf16 and fp16:
        raise ConfigError("bf16.enabled and fp16.enabled are both true: expected at most one")
    betas = params.get("betas", (0.9, 0.999))
    return OptimizerSettings(
        lr=params.get("lr", 1e-3),
        betas=tuple(betas) if isinstance(betas, (list, tuple)) else betas,  # anything else: rejected by name later
        eps=params.get("eps", 1e-8),
        weight_decay=params.get("weight_decay", 0.0),
        gradient_clipping=float(clipping),
        dtype="bf16" if bf16 else "fp16" if fp16 else "fp32",
        zenflow=ZenFlowConfig.from_dict(_section(zero["zenflow"], "zero_optimization.zenflow")),
    )


def _section(value: Any, where: str) -> dict[str, Any]:
    """A config section: absent/null reads as empty; anything but a JSON object is an error naming the section."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where} = {value!r} is not allowed: expected an object ({{...}})")
    return value


def _read_json(path: str | Path) -> dict[str, Any]:
    if not isinstance(path, (str, Path)):
        raise ConfigError(f"DeepSpeed config = {path!r} is not allowed: expected a dict or a path to a JSON file")
    path = Path(path)
    try:
        ds = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"DeepSpeed config {str(path)!r}: file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"DeepSpeed config {str(path)!r}: not valid JSON ({exc})") from None
    except OSError as exc:  # a directory, no permission, ...
        raise ConfigError(f"DeepSpeed config {str(path)!r}: cannot be read ({exc.strerror})") from None
    return _section(ds, f"DeepSpeed config {str(path)!r}")


# ---- optimizer arguments and parameters (checked before any state exists) ------------------------------------
def check_hyperparameters(lr: float, betas: tuple[float, float], eps: float, weight_decay: float, clip: float) -> None:
    def bad(field: str, value: Any, allowed: str) -> None:
        raise ConfigError(f"{field} = {value!r} is not allowed: expected {allowed}")

    def number(x: Any) -> bool:  # NaN fails every comparison below, so it is refused too
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    if not number(lr) or not 0 <= lr < math.inf:
        bad("lr", lr, "a number >= 0 (finite)")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2 or not all(number(b) and 0 <= b < 1 for b in betas):
        bad("betas", betas, "two numbers in [0, 1)")
    if not number(eps) or not 0 < eps < math.inf:
        bad("eps", eps, "a number > 0 (finite)")
    if not number(weight_decay) or not 0 <= weight_decay < math.inf:
        bad("weight_decay", weight_decay, "a number >= 0 (finite)")
    if not number(clip) or not 0 <= clip < math.inf:
        bad("gradient_clipping", clip, "a number >= 0 (finite; 0 disables clipping)")


def check_params(groups: list[dict]) -> torch.device:
    """One device, real floating dtypes, contiguous weights: checked before any state exists."""
    devices = set()
    for gi, group in enumerate(groups):
        for pi, p in enumerate(group["params"]):
            where = f"param_groups[{gi}]['params'][{pi}] (shape {tuple(p.shape)}, {p.dtype})"
            if not p.is_floating_point():
                raise ConfigError(f"{where}: dtype {p.dtype} is not allowed: expected a floating dtype")
            if p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                raise ConfigError(f"{where}: dtype {p.dtype} is not allowed: expected float32, bfloat16 or float16")
            if p.is_sparse:
                raise ConfigError(f"{where}: sparse parameters are not allowed: expected a dense tensor")
            if p.dim() >= 2 and not p.is_contiguous():
                raise ConfigError(f"{where}: a non-contiguous weight is not allowed: expected a contiguous tensor "
                                  "(its columns are viewed as [out, prod(rest)])")
            devices.add(p.device)
    if len(devices) != 1:
        raise ConfigError(f"parameters on {sorted(map(str, devices))}: expected all on one device")
    return devices.pop()
