"""TRL: SFTTrainer, SFTConfig and TrlParser build hf_optim's optimizers for every hf_optim name (issue 3)."""

from __future__ import annotations

import pytest
import torch
from trainer_helpers import check_state, common_args, inner_optimizer, losses, text_dataset
from transformers import TrainingArguments
from trl import SFTConfig, SFTTrainer, TrlParser

import hf_optim
from hf_optim.integrations import transformers as integration
from hf_optim.integrations.names import OPTIMIZER_NAMES
from hf_optim.tiny import tiny_llama, tiny_tokenizer

NAMES = [entry.name for entry in hf_optim.available_optimizers()]


def sft_trainer(tmp_path, name: str, trainer_cls=SFTTrainer, **overrides) -> SFTTrainer:
    config = SFTConfig(**common_args(tmp_path, name, **overrides), max_length=64)
    return trainer_cls(model=tiny_llama(), args=config, train_dataset=text_dataset(), processing_class=tiny_tokenizer())


@pytest.mark.parametrize("name", NAMES)
def test_sft_trainer_builds_hf_optim_class_and_learns(tmp_path, name):
    trainer = sft_trainer(tmp_path, name)
    trainer.train()

    optimizer = inner_optimizer(trainer)
    assert type(optimizer) is OPTIMIZER_NAMES[name].cls
    check_state(optimizer, trainer.model, name)
    history = losses(trainer)
    assert len(history) == 8 and all(torch.isfinite(torch.tensor(history)))
    assert sum(history[-2:]) < sum(history[:2]), history


def test_sft_trainer_rebuilds_plain_training_arguments(tmp_path):
    """SFTTrainer turns a TrainingArguments into SFTConfig(**args.to_dict()): the added name must survive."""
    args = TrainingArguments(**common_args(tmp_path, "lamb_8bit", max_steps=2))
    trainer = SFTTrainer(model=tiny_llama(), args=args, train_dataset=text_dataset(32),
                         processing_class=tiny_tokenizer())
    assert isinstance(trainer.args, SFTConfig) and trainer.args.optim == "lamb_8bit"
    trainer.train()
    assert type(inner_optimizer(trainer)) is hf_optim.LAMB8bit


def test_checkpoint_resume_continues_8bit_training(tmp_path):
    def trainer_for(output_dir, max_steps):
        return sft_trainer(tmp_path, "paged_adamw_8bit", output_dir=str(output_dir), max_steps=max_steps,
                           save_strategy="steps", save_steps=3)

    straight = trainer_for(tmp_path / "straight", 6)
    straight.train()
    first = trainer_for(tmp_path / "resumed", 3)
    first.train()
    resumed = trainer_for(tmp_path / "resumed", 6)
    resumed.train(resume_from_checkpoint=str(tmp_path / "resumed" / "checkpoint-3"))

    optimizer = inner_optimizer(resumed)
    assert type(optimizer) is hf_optim.PagedAdamW8bit and resumed.state.global_step == 6
    check_state(optimizer, resumed.model, "paged_adamw_8bit")
    assert all(s["step"] == 6 for s in optimizer.state.values())
    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)


def test_trl_parser_command_line(tmp_path):
    (args,) = TrlParser(SFTConfig).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--use_cpu", "--optim", "paged_lamb_8bit", "--optim_args", "beta1=0.85"]
    )
    cls, kwargs = SFTTrainer.get_optimizer_cls_and_kwargs(args)
    assert cls is hf_optim.PagedLAMB8bit and kwargs["betas"] == (0.85, args.adam_beta2)


def test_sft_config_unknown_name_suggests():
    with pytest.raises(ValueError, match="'lamb8bit'.*'lamb_8bit' \\(hf_optim\\)"):
        SFTConfig(output_dir="unused", optim="lamb8bit", use_cpu=True)


def test_mixin_with_sft_trainer(tmp_path):
    class LambTrainer(integration.HfOptimTrainerMixin, SFTTrainer):
        hf_optim_name = "lamb_8bit"

    trainer = sft_trainer(tmp_path, "adamw_torch", trainer_cls=LambTrainer, max_steps=2)
    trainer.train()
    assert type(inner_optimizer(trainer)) is hf_optim.LAMB8bit
