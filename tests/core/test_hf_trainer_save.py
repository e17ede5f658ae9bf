"""The Trainer callback drains ZenFlowAdamW on a step after which the Trainer only saves (zenflow/hf_trainer.py).

The promises: hf_trainer.py's docstring, "The callback drains (applies it) at the end of any step after which the
Trainer evaluates, saves or stops"; `ZenFlowCallback`: "Drains ZenFlowAdamW before the Trainer evaluates, saves or
stops". With overlap_step the last host update is still in flight after a step, so a save that is not also an
evaluation would write weights that miss it. tests/core/test_hf_trainer.py saves and evaluates at the same steps, so a
save-only step is never seen there; here the callback is called as the Trainer calls it, one flag at a time.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import TrainerControl, TrainerState, TrainingArguments  # noqa: E402

from zenflow import ZenFlowAdamW  # noqa: E402
from zenflow.hf_trainer import ZenFlowCallback  # noqa: E402

ROWS, WIDTH, SELECTED = 8, 16, 4  # topk_ratio 0.25
BLOCK = {"topk_ratio": 0.25, "update_interval": 2, "overlap_step": True, "full_warm_up_rounds": 0,
         "select_interval": 10_000}


def uploaded(opt: ZenFlowAdamW) -> int:
    return opt.transfer_bytes.get(("h2d", "params"), 0)


@pytest.mark.parametrize("flag", ["should_save", "should_evaluate", "should_training_stop"])
def test_the_callback_applies_the_host_update_in_flight_when_the_trainer_will_save_evaluate_or_stop(tmp_path, flag):
    torch.manual_seed(0)
    layer = torch.nn.Linear(WIDTH, ROWS, bias=False)
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[])
    callback = ZenFlowCallback()
    with ZenFlowAdamW(layer.parameters(), lr=1e-2, zenflow=BLOCK) as opt:
        for _ in range(2):  # the second step is a boundary: its host update runs in the background
            layer.weight.grad = torch.randn(ROWS, WIDTH)
            opt.step()
            opt.zero_grad()
        assert opt.host_updates == 1 and uploaded(opt) == 0  # in flight: nothing uploaded yet
        weights = layer.weight.detach().clone()

        callback.on_step_end(args, TrainerState(), TrainerControl(), optimizer=opt)  # the Trainer does nothing
        assert uploaded(opt) == 0 and torch.equal(layer.weight, weights)  # the control: no drain, nothing applied

        callback.on_step_end(args, TrainerState(), TrainerControl(**{flag: True}), optimizer=opt)
        assert uploaded(opt) == 4 * ROWS * (WIDTH - SELECTED), f"{flag}: the host update in flight was not applied"
        assert not torch.equal(layer.weight, weights)  # the weights the Trainer writes now include it
