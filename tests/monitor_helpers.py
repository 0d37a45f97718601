"""Shared pieces of the logging tests: short monitored runs, run-dir readers and a PNG check."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from datasets import Dataset
from trainer_helpers import common_args, text_dataset
from transformers import Trainer, TrainerCallback, TrainingArguments
from trl import SFTConfig, SFTTrainer

from hf_optim.monitor import TrainingMonitor
from hf_optim.tiny import markov_tokens, tiny_llama, tiny_tokenizer

FAST = dict(bf16=False, gradient_checkpointing=False)  # TRL's SFTConfig turns both on by default: slow on CPU


def fixed_length_dataset(count: int, seq_len: int) -> Dataset:
    """Token rows of exactly ``seq_len`` tokens and no attention mask: every batch has a known token count."""
    tokens = markov_tokens(1, count, seq_len)[0]
    return Dataset.from_dict({"input_ids": tokens.tolist(), "labels": tokens.tolist()})


def sft_run(tmp_path: Path, name: str, run_dir: Path, *, steps: int, eval_steps: int | None = None,
            callbacks=(), recipe=None, **monitor_kwargs) -> tuple[SFTTrainer, TrainingMonitor]:
    """A monitored SFTTrainer run of the tiny model (returns before ``train()``)."""
    evals = dict(eval_strategy="steps", eval_steps=eval_steps) if eval_steps else {}
    config = SFTConfig(**common_args(tmp_path, name, output_dir=str(run_dir), max_steps=steps, **FAST, **evals),
                       max_length=64)
    monitor = TrainingMonitor(run_dir, recipe=recipe, **monitor_kwargs)
    trainer = SFTTrainer(model=tiny_llama(), args=config, train_dataset=text_dataset(64),
                         eval_dataset=text_dataset(16) if eval_steps else None, processing_class=tiny_tokenizer(),
                         callbacks=[monitor, *callbacks])
    return trainer, monitor


def plain_trainer(tmp_path: Path, model, optimizer, monitor, *, steps: int, batch_size: int, seq_len: int):
    args = TrainingArguments(**common_args(tmp_path, "adamw_torch", max_steps=steps,
                                           per_device_train_batch_size=batch_size))
    return Trainer(model=model, args=args, train_dataset=fixed_length_dataset(steps * batch_size, seq_len),
                   optimizers=(optimizer, None), callbacks=[monitor])


class RaiseOomAt(TrainerCallback):
    """Raises torch.OutOfMemoryError in the middle of optimizer step ``step`` (after backward, at the optimizer
    step, where real OOMs of optimizer state happen): an OOM without a GPU, for the OOM paths."""

    def __init__(self, step: int):
        self.step = step

    def on_optimizer_step(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:  # global_step counts completed steps
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated in a test)")


def read_records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def read_summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def assert_png_drawn(path: Path) -> None:
    """The PNG exists and is a real drawing: many colours, a good share of non-white pixels, not one flat tone."""
    from matplotlib.image import imread

    assert path.exists() and path.stat().st_size > 5_000, path
    image = imread(path)[..., :3]
    assert image.shape[0] > 300 and image.shape[1] > 500, (path, image.shape)
    not_white = (image < 0.95).any(axis=-1).mean()
    colours = len({tuple(c) for c in (image.reshape(-1, 3)[::7] * 255).round().astype(int).tolist()})
    assert not_white > 0.03 and colours > 20 and image.std() > 0.05, (path, not_white, colours, image.std())


def figure_texts(fig) -> str:
    """Every text drawn on a figure (axes texts, titles, legend entries, annotations), joined."""
    texts = [t.get_text() for t in fig.texts]
    for ax in fig.axes:
        texts += [t.get_text() for t in ax.texts] + [ax.get_title()]
        legend = ax.get_legend()
        if legend is not None:
            texts += [t.get_text() for t in legend.get_texts()]
    return "\n".join(texts)
