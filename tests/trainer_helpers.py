"""Shared pieces of the Trainer / TRL integration tests: arguments, data, and state checks."""

from __future__ import annotations

import torch
from datasets import Dataset

from hf_optim.integrations.names import OPTIMIZER_NAMES
from hf_optim.tiny import tiny_texts

# Lion's sign update moves every weight by lr: it needs a smaller lr than the Adam family for the same model.
LEARNING_RATES = {"lion": 3e-4, "rmsprop": 1e-3}


def common_args(tmp_path, name: str, **overrides) -> dict:
    """TrainingArguments / SFTConfig keywords for a short, deterministic CPU run with ``optim=name``."""
    family = OPTIMIZER_NAMES[name].family if name in OPTIMIZER_NAMES else "adamw"
    args = dict(
        output_dir=str(tmp_path / "out"), optim=name, max_steps=8, per_device_train_batch_size=8,
        learning_rate=LEARNING_RATES.get(family, 3e-3), logging_steps=1, report_to=[], save_strategy="no",
        use_cpu=True, seed=0, disable_tqdm=True, lr_scheduler_type="constant", dataloader_num_workers=0,
    )
    args.update(overrides)
    return args


def text_dataset(count: int = 128) -> Dataset:
    return Dataset.from_dict({"text": tiny_texts(count)})


def token_dataset(tokenizer, count: int = 128) -> Dataset:
    encoded = tokenizer(tiny_texts(count), truncation=True, max_length=64)
    return Dataset.from_dict({"input_ids": encoded["input_ids"]})


def checkpointing_trainer(output_root, name: str, *, max_steps: int, save_steps: int, seed: int = 0, callbacks=()):
    """A Trainer on a 1-layer tiny Llama that saves a checkpoint every ``save_steps`` under ``output_root/out``
    (small batches, so resume tests stay fast). Weight decay is on, so LAMB's trust ratio is used."""
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    from hf_optim.tiny import tiny_llama, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    args = TrainingArguments(**common_args(output_root, name, max_steps=max_steps, save_strategy="steps",
                                           save_steps=save_steps, lr_scheduler_type="linear", warmup_steps=1,
                                           per_device_train_batch_size=2, weight_decay=0.01))
    return Trainer(model=tiny_llama(seed=seed, layers=1), args=args, train_dataset=token_dataset(tokenizer, 16),
                   data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False), callbacks=list(callbacks))


def inner_optimizer(trainer) -> torch.optim.Optimizer:
    optimizer = trainer.optimizer
    return getattr(optimizer, "optimizer", optimizer)  # accelerate wraps it


def losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def check_state(optimizer, model, name: str) -> None:
    """8-bit and 4-bit names keep one-byte codes (uint8; float8 for fp8; 4-bit: packed, half the elements) for large
    non-embedding tensors, fp32 for embeddings and small tensors."""
    entry = OPTIMIZER_NAMES[name]
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    saw_quantized = False
    for param, state in optimizer.state.items():
        tensors = [v for v in state.values() if isinstance(v, torch.Tensor) and v.numel() > 1]
        dtypes = {v.dtype for v in tensors}
        expect_quantized = entry.optim_bits < 32 and param.numel() >= 4096 and id(param) not in embeddings
        has_codes = any(v.element_size() == 1 for v in tensors)
        assert has_codes == expect_quantized, (name, tuple(param.shape), dtypes)
        if expect_quantized:
            codes = next(v for v in tensors if v.element_size() == 1)
            per_row = -(-param.numel() * entry.optim_bits // 8)  # AdEMAMix stacks two rows in state1
            assert codes.numel() in (per_row, 2 * per_row), (name, codes.shape)
        saw_quantized |= expect_quantized
    assert saw_quantized == (entry.optim_bits < 32)


def assert_same_training_state(expected, got) -> None:
    """Two Trainers ended on bit-identical weights and optimizer state (dtypes included)."""
    for (key, a), b in zip(expected.model.state_dict().items(), got.model.state_dict().values()):
        assert torch.equal(a, b), key
    state_a, state_b = inner_optimizer(expected).state, inner_optimizer(got).state
    for p_a, p_b in zip(expected.model.parameters(), got.model.parameters()):
        assert state_a[p_a].keys() == state_b[p_b].keys()
        for key, value in state_a[p_a].items():
            other = state_b[p_b][key]
            if isinstance(value, torch.Tensor):
                assert value.dtype == other.dtype and torch.equal(value, other), key
            else:
                assert value == other, key
