"""Exact resume through the Trainer: a run resumed from its step-k checkpoint (resume_from_checkpoint) logs the
same losses, bit for bit on CPU, and ends on the same weights as the uninterrupted run, for every optimizer
family in 32-bit and 8-bit (optimizer.pt written by torch.save and read back by the Trainer)."""

from __future__ import annotations

import pytest
import torch
from trainer_helpers import common_args, inner_optimizer, losses, token_dataset
from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

from hf_optim.tiny import tiny_llama, tiny_tokenizer

STEPS, SAVE_AT = 4, 2
NAMES = ["adamw_32bit", "adamw_8bit", "ademamix_32bit", "ademamix_8bit", "lamb_32bit", "lamb_8bit", "lion_32bit",
         "lion_8bit", "rmsprop_bnb_32bit", "rmsprop_8bit", "adafactor", "adafactor_8bit"]


def trainer(tmp_path, name: str, seed: int) -> Trainer:
    tokenizer = tiny_tokenizer()
    args = TrainingArguments(**common_args(tmp_path, name, max_steps=STEPS, save_strategy="steps",
                                           save_steps=SAVE_AT, lr_scheduler_type="linear", warmup_steps=1,
                                           per_device_train_batch_size=2))
    return Trainer(model=tiny_llama(seed=seed, layers=1), args=args, train_dataset=token_dataset(tokenizer, 16),
                   data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False))


@pytest.mark.parametrize("name", NAMES)
def test_resumed_run_logs_the_same_losses(tmp_path, name):
    straight = trainer(tmp_path, name, seed=0)
    straight.train()
    expected = losses(straight)
    assert len(expected) == STEPS

    resumed = trainer(tmp_path, name, seed=1)  # other initial weights: the checkpoint must decide everything
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / f"checkpoint-{SAVE_AT}"))
    assert losses(resumed) == expected  # the first SAVE_AT come from the checkpoint's trainer_state.json
    assert resumed.state.log_history[-2]["step"] == STEPS
    for (key, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), key
    state_a, state_b = inner_optimizer(straight).state, inner_optimizer(resumed).state
    for p_a, p_b in zip(straight.model.parameters(), resumed.model.parameters()):
        for key, value in state_a[p_a].items():
            other = state_b[p_b][key]
            if isinstance(value, torch.Tensor):
                assert value.dtype == other.dtype and torch.equal(value, other), key
            else:
                assert value == other, key
