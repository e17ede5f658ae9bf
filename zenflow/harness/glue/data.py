"""GLUE: the nine tasks, one loader for the official TSV layout (or `datasets` `nyu-mll/glue`), official metrics.

Files are the official GLUE download layout, `<glue_dir>/<TASK>/{train,dev}.tsv` (MNLI: `dev_matched.tsv`,
`dev_mismatched.tsv`), read as plain tab-separated text without quoting (GLUE sentences contain quotes). CoLA has no
header line (4 columns: source, label, original judgement, sentence); every other task has one, and columns are
found by their header names (MNLI train has 12 columns, its dev files 16). MRPC's UTF-8 BOM is stripped. Labels are
mapped to the integers `datasets` uses (MNLI: entailment 0, neutral 1, contradiction 2; RTE/QNLI: entailment 0);
STS-B scores stay floats (regression). Metrics are those of the GLUE benchmark, computed with scikit-learn / scipy:
CoLA Matthews correlation, MRPC/QQP F1 and accuracy, STS-B Pearson and Spearman, the rest accuracy. A task's score
(in points, 0–100) is the mean of its metrics, as on the GLUE leaderboard (MNLI: matched and mismatched accuracy).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SHARED_GLUE = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "glue"
HUB_DATASET = "nyu-mll/glue"


class GlueError(ValueError):
    """Bad GLUE input: unknown task, missing task or split, a file not in the official layout."""


@dataclass(frozen=True)
class Task:
    name: str                         # the official folder name
    hub_config: str                   # the `nyu-mll/glue` configuration
    text: tuple[str, ...]             # text columns (header names; CoLA: column indices as strings)
    label: str                        # label column
    labels: tuple[str, ...] | None    # label strings in `datasets` order; None = regression (STS-B)
    metric: str                       # "matthews" | "accuracy" | "f1_accuracy" | "pearson_spearman"
    hub_text: tuple[str, ...]         # text fields in `datasets`
    dev_splits: tuple[str, ...] = ("dev",)
    columns: int | None = None        # headerless files: the exact number of columns

    @property
    def num_labels(self) -> int:
        return 1 if self.labels is None else len(self.labels)

    @property
    def header(self) -> bool:
        return self.columns is None


_PAIR = ("sentence1", "sentence2")
TASKS: dict[str, Task] = {t.name: t for t in (
    Task("CoLA", "cola", ("3",), "1", ("0", "1"), "matthews", ("sentence",), columns=4),
    Task("SST-2", "sst2", ("sentence",), "label", ("0", "1"), "accuracy", ("sentence",)),
    Task("MRPC", "mrpc", ("#1 String", "#2 String"), "Quality", ("0", "1"), "f1_accuracy", _PAIR),
    Task("QQP", "qqp", ("question1", "question2"), "is_duplicate", ("0", "1"), "f1_accuracy",
         ("question1", "question2")),
    Task("STS-B", "stsb", _PAIR, "score", None, "pearson_spearman", _PAIR),
    Task("MNLI", "mnli", _PAIR, "gold_label", ("entailment", "neutral", "contradiction"), "accuracy",
         ("premise", "hypothesis"), dev_splits=("dev_matched", "dev_mismatched")),
    Task("QNLI", "qnli", ("question", "sentence"), "label", ("entailment", "not_entailment"), "accuracy",
         ("question", "sentence")),
    Task("RTE", "rte", _PAIR, "label", ("entailment", "not_entailment"), "accuracy", _PAIR),
    Task("WNLI", "wnli", _PAIR, "label", ("0", "1"), "accuracy", _PAIR),
)}
_ALIASES = {name.lower().replace("-", ""): name for name in TASKS}
_HUB_SPLITS = {"train": "train", "dev": "validation", "dev_matched": "validation_matched",
               "dev_mismatched": "validation_mismatched"}


def get_task(name: str) -> Task:
    """'SST-2', 'sst2', 'sst-2' all name SST-2."""
    key = str(name).lower().replace("-", "").replace("_", "")
    if key not in _ALIASES:
        raise GlueError(f"unknown GLUE task {name!r}: expected one of {', '.join(TASKS)}")
    return TASKS[_ALIASES[key]]


@dataclass
class Examples:
    texts: list[tuple[str, ...]]
    labels: list[Any]                 # int class ids, or float scores (STS-B)
    source: str                       # "tsv:<path>" or "datasets:nyu-mll/glue/<config>/<split>"
    meta: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.labels)

    def subset(self, indices: list[int]) -> Examples:
        return Examples([self.texts[i] for i in indices], [self.labels[i] for i in indices], self.source,
                        {**self.meta, "subset_of": len(self)})


def split_file(task: Task, split: str) -> str:
    if split != "train" and split not in task.dev_splits:
        raise GlueError(f"GLUE {task.name}: unknown split {split!r}: expected train or {' / '.join(task.dev_splits)}")
    return f"{split}.tsv"


def load_split(task: Task | str, split: str, glue_dir: str | Path | None = None, strict: bool = True) -> Examples:
    """One split of one task. `glue_dir` holds the official layout; with strict=False (the default directory, not
    one the user named) a missing file falls back to `datasets` `nyu-mll/glue` unless HF_HUB_OFFLINE is set."""
    task = get_task(task) if isinstance(task, str) else task
    path = Path(glue_dir if glue_dir is not None else SHARED_GLUE) / task.name / split_file(task, split)
    if path.is_file():
        return read_tsv(task, path)
    missing = _describe_missing(path)
    if strict:
        raise GlueError(f"GLUE {task.name} {split}: {missing}; expected the official GLUE layout "
                        f"<glue-dir>/{task.name}/{path.name}")
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0"):
        raise GlueError(f"GLUE {task.name} {split}: {missing}, and the hub is not used (HF_HUB_OFFLINE is set)")
    try:
        return _load_hub(task, split)
    except Exception as exc:  # any hub/network failure: one message naming both places looked at
        raise GlueError(f"GLUE {task.name} {split}: {missing}, and loading {HUB_DATASET}/{task.hub_config} "
                        f"with `datasets` failed: {type(exc).__name__}: {exc}") from None


def _describe_missing(path: Path) -> str:
    folder = path.parent
    if not folder.parent.is_dir():
        return f"GLUE directory {folder.parent} does not exist"
    if not folder.is_dir():
        found = sorted(p.name for p in folder.parent.iterdir() if p.is_dir())
        return f"{folder.parent} has no {folder.name}/ folder (task folders found: {', '.join(found) or 'none'})"
    found = sorted(p.name for p in folder.iterdir())
    return f"{path} not found (files in {folder.name}/: {', '.join(found) or 'none'})"


def read_tsv(task: Task, path: str | Path) -> Examples:
    """Parse one official GLUE TSV; any deviation is an error naming the file, line, what was expected and found."""
    path = Path(path)
    lines = path.read_text(encoding="utf-8-sig").splitlines()
    if task.header:
        if not lines:
            raise GlueError(f"{path}: empty file; expected a header line with columns {_names(task)}")
        header = lines[0].split("\t")
        absent = [c for c in (*task.text, task.label) if c not in header]
        if absent:
            raise GlueError(f"{path}: not a GLUE {task.name} file: header columns are {header}; expected columns "
                            f"{_names(task)} (missing {absent})")
        width, rows, first = len(header), lines[1:], 2
        text_idx, label_idx = [header.index(c) for c in task.text], header.index(task.label)
    else:
        width, rows, first = task.columns, lines, 1
        text_idx, label_idx = [int(c) for c in task.text], int(task.label)
    texts, labels = [], []
    for number, line in enumerate(rows, start=first):
        cells = line.split("\t")
        if len(cells) != width:
            what = f"columns {_names(task)} of the header" if task.header else f"{width} columns (no header line)"
            raise GlueError(f"{path}, line {number}: {len(cells)} tab-separated columns, expected {width} "
                            f"({what}); found {line[:80]!r}")
        texts.append(tuple(cells[i] for i in text_idx))
        labels.append(_label(task, cells[label_idx], path, number))
    if not labels:
        raise GlueError(f"{path}: no data rows")
    return Examples(texts, labels, f"tsv:{path}")


def _names(task: Task) -> str:
    return ", ".join(repr(c) for c in (*task.text, task.label)) if task.header else f"{task.columns} columns"


def _label(task: Task, raw: str, path: Path, number: int) -> Any:
    if task.labels is None:
        try:
            return float(raw)
        except ValueError:
            raise GlueError(f"{path}, line {number}: score {raw!r} is not a number") from None
    if raw not in task.labels:
        raise GlueError(f"{path}, line {number}: label {raw!r} is not a {task.name} label: expected one of "
                        f"{list(task.labels)}")
    return task.labels.index(raw)


def _load_hub(task: Task, split: str) -> Examples:
    from datasets import load_dataset

    data = load_dataset(HUB_DATASET, task.hub_config, split=_HUB_SPLITS[split])
    texts = list(zip(*(data[f] for f in task.hub_text)))
    return Examples(texts, [float(x) if task.labels is None else int(x) for x in data["label"]],
                    f"datasets:{HUB_DATASET}/{task.hub_config}/{_HUB_SPLITS[split]}")


# ---- metrics (the GLUE benchmark's, with scikit-learn / scipy; key names as in `evaluate`'s "glue") ---------
def compute_metrics(task: Task | str, predictions: list, references: list) -> dict[str, float]:
    task = get_task(task) if isinstance(task, str) else task
    if len(predictions) != len(references) or not references:
        raise ValueError(f"{len(predictions)} predictions for {len(references)} references")
    if task.metric == "pearson_spearman":
        from scipy.stats import pearsonr, spearmanr

        return {"pearson": float(pearsonr(predictions, references)[0]),
                "spearmanr": float(spearmanr(predictions, references)[0])}
    from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

    if task.metric == "matthews":
        return {"matthews_correlation": float(matthews_corrcoef(references, predictions))}
    result = {"accuracy": float(accuracy_score(references, predictions))}
    if task.metric == "f1_accuracy":
        result["f1"] = float(f1_score(references, predictions))
    return result


def task_score(metrics_by_split: dict[str, dict[str, float]]) -> float:
    """The task's GLUE score in points: the mean of its metrics over its dev splits, × 100."""
    values = [v for m in metrics_by_split.values() for v in m.values()]
    return 100.0 * sum(values) / len(values)


def metric_name(task: Task) -> str:
    return {"matthews": "Matthews corr.", "accuracy": "accuracy", "f1_accuracy": "mean(F1, accuracy)",
            "pearson_spearman": "mean(Pearson, Spearman)"}[task.metric] + (
        " (m/mm mean)" if len(task.dev_splits) > 1 else "")
