"""Exact resume through the Trainer: a run resumed from its step-k checkpoint (resume_from_checkpoint) logs the
same losses, bit for bit on CPU, and ends on the same weights as the uninterrupted run, for every optimizer
family in 32-bit and 8-bit (optimizer.pt written by torch.save and read back by the Trainer)."""

from __future__ import annotations

import pytest
from trainer_helpers import assert_same_training_state, checkpointing_trainer, losses

pytestmark = pytest.mark.slow  # subprocesses / Trainer runs: several seconds each

STEPS, SAVE_AT = 4, 2
NAMES = ["adamw_32bit", "adamw_8bit", "ademamix_32bit", "ademamix_8bit", "lamb_32bit", "lamb_8bit", "lion_32bit",
         "lion_8bit", "rmsprop_bnb_32bit", "rmsprop_8bit", "adafactor", "adafactor_8bit"]


def trainer(tmp_path, name: str, seed: int):
    return checkpointing_trainer(tmp_path, name, max_steps=STEPS, save_steps=SAVE_AT, seed=seed)


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
    assert_same_training_state(straight, resumed)
