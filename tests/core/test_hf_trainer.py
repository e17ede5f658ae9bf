"""ZenFlowAdamW in the Hugging Face Trainer (zenflow/hf_trainer.py): the callback drains before evaluation and
saving, the Trainer's LR scheduler drives it, and an interrupted run resumed from its checkpoint equals the
uninterrupted one bit for bit (weights and loss curve). A tiny BERT built from its config: no download."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from zenflow import ZenFlowAdamW  # noqa: E402
from zenflow.hf_trainer import ZenFlowCallback, decay_groups  # noqa: E402

BLOCK = {"topk_ratio": 0.25, "update_interval": 3, "overlap_step": True, "select_interval": 6}


def tiny_model() -> BertForSequenceClassification:
    torch.manual_seed(0)
    config = BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16, num_labels=2)
    return BertForSequenceClassification(config)


def dataset(n: int = 48) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 40, (n, 8), generator=g)
    return [{"input_ids": ids[i], "attention_mask": torch.ones(8, dtype=torch.long),
             "labels": torch.tensor(int(ids[i, 0] % 2))} for i in range(n)]


class Stop(Exception):
    """An interruption right after a checkpoint was written."""


class Probe(TrainerCallback):
    """Records whether a host update was still in flight when the Trainer evaluated or saved; can interrupt."""

    def __init__(self, stop_after_save_at: int | None = None) -> None:
        self.pending_at: list[tuple[str, bool]] = []
        self.stop_after_save_at = stop_after_save_at

    def on_evaluate(self, args, state, control, **kwargs) -> None:
        self.pending_at.append(("evaluate", self.optimizer.pending is not None))

    def on_save(self, args, state, control, **kwargs) -> None:
        self.pending_at.append(("save", self.optimizer.pending is not None))
        if state.global_step == self.stop_after_save_at:
            raise Stop


def trainer(out: Path, probe: Probe) -> tuple[Trainer, ZenFlowAdamW]:
    model = tiny_model()
    opt = ZenFlowAdamW(decay_groups(model, 0.01), lr=2e-3, zenflow=BLOCK)
    probe.optimizer = opt
    args = TrainingArguments(output_dir=str(out), max_steps=12, per_device_train_batch_size=8, learning_rate=2e-3,
                             lr_scheduler_type="linear", warmup_steps=2, save_strategy="steps", save_steps=6,
                             eval_strategy="steps", eval_steps=6, logging_steps=1, report_to=[], use_cpu=True,
                             seed=0, disable_tqdm=True, dataloader_num_workers=0, max_grad_norm=1.0)
    data = dataset()
    return Trainer(model=model, args=args, train_dataset=data, eval_dataset=data[:16], optimizers=(opt, None),
                   callbacks=[ZenFlowCallback(), probe]), opt


def losses(t: Trainer) -> list[float]:
    return [h["loss"] for h in t.state.log_history if "loss" in h]


def test_trainer_drains_before_evaluating_and_saving_and_resumes_bit_exactly(tmp_path: Path) -> None:
    whole_probe = Probe()
    whole, whole_opt = trainer(tmp_path / "whole", whole_probe)
    whole.train()
    assert whole_probe.pending_at == [("evaluate", False), ("save", False)] * 2  # steps 6 and 12
    assert not whole_opt.worker.started  # train end closed it
    assert whole.lr_scheduler.optimizer is whole_opt or whole.lr_scheduler.optimizer.optimizer is whole_opt

    interrupted, _ = trainer(tmp_path / "cut", Probe(stop_after_save_at=6))
    with pytest.raises(Stop):
        interrupted.train()
    resumed, _ = trainer(tmp_path / "cut", Probe())
    resumed.train(resume_from_checkpoint=str(tmp_path / "cut" / "checkpoint-6"))

    for (name, a), b in zip(whole.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name
    assert losses(resumed) == losses(whole)  # the history up to the checkpoint is restored, the rest retrained


def test_decay_groups_leave_biases_and_norms_undecayed_and_frozen_parameters_out() -> None:
    model = tiny_model()
    model.bert.embeddings.word_embeddings.weight.requires_grad_(False)
    decay, no_decay = decay_groups(model, 0.05)
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(decay["params"]) + len(no_decay["params"]) == len(trainable)
    assert all(p is not model.bert.embeddings.word_embeddings.weight for p in decay["params"])
