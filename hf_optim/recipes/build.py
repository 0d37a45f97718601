"""Building the Hugging Face objects a recipe describes: tokenizer, model, datasets, SFTConfig, LoraConfig."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hf_optim.recipes.schema import Recipe
from hf_optim.tiny import BUILTIN_DATA, BUILTIN_MODEL, CHAT_FILE, builtin_model_dir, bundled_tokenizer

LLAMA3_PAD = "<|finetune_right_pad_id|>"


def torch_dtype(value: Any) -> Any:
    """``"bfloat16"`` -> ``torch.bfloat16``; anything else (None, a dtype) unchanged."""
    if isinstance(value, str) and value != "auto":
        dtype = getattr(torch, value.removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{value!r} is not a torch dtype (bfloat16, float16, float32, ...)")
        return dtype
    return value


def build_tokenizer(recipe: Recipe):
    """The recipe's tokenizer (``model.tokenizer`` or ``model.id``), with a pad token (Llama 3's
    ``<|finetune_right_pad_id|>`` when the vocabulary has it, else EOS)."""
    source = recipe.model.get("tokenizer") or recipe.model["id"]
    if source == BUILTIN_MODEL:
        tokenizer = bundled_tokenizer()
    else:
        from transformers import AutoTokenizer

        kwargs = {k: recipe.model[k] for k in ("revision", "trust_remote_code", "token", "local_files_only")
                  if k in recipe.model}
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    if tokenizer.pad_token is None:
        vocab = tokenizer.get_vocab()
        tokenizer.pad_token = LLAMA3_PAD if LLAMA3_PAD in vocab else tokenizer.eos_token
    return tokenizer


def model_location(recipe: Recipe) -> str:
    """Where ``from_pretrained`` reads the model: the id itself, or the builtin tiny model's directory in
    hf_optim's cache (written on first use; :func:`hf_optim.tiny.builtin_model_dir`)."""
    model_id = str(recipe.model["id"])
    return str(builtin_model_dir()) if model_id == BUILTIN_MODEL else model_id


def model_kwargs(recipe: Recipe) -> dict[str, Any]:
    """``from_pretrained`` keyword arguments: the model section (dtypes converted) and the quantization config."""
    kwargs = {k: v for k, v in recipe.model.items() if k not in ("id", "tokenizer")}
    for key in ("dtype", "torch_dtype"):
        if key in kwargs:
            kwargs[key] = torch_dtype(kwargs[key])
    if recipe.quantization:
        from transformers import BitsAndBytesConfig

        quantization = dict(recipe.quantization)
        for key in ("bnb_4bit_compute_dtype", "bnb_4bit_quant_storage"):
            if key in quantization:
                quantization[key] = torch_dtype(quantization[key])
        kwargs["quantization_config"] = BitsAndBytesConfig(**quantization)
    return kwargs


def build_model(recipe: Recipe):
    """The model to fine-tune, loaded with ``AutoModelForCausalLM.from_pretrained`` (the builtin tiny model goes
    through the same call, so 4-bit loading is exercised exactly as for a real checkpoint)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_location(recipe), **model_kwargs(recipe))


def build_lora_config(recipe: Recipe):
    """The LoraConfig of a LoRA/QLoRA recipe (``task_type`` defaults to CAUSAL_LM), or None for a full fine-tune."""
    if recipe.peft is None:
        return None
    from peft import LoraConfig

    return LoraConfig(**{"task_type": "CAUSAL_LM", **recipe.peft})


def build_datasets(recipe: Recipe):
    """(train, eval or None) from the data section."""
    from datasets import Dataset, load_dataset

    data = recipe.data
    if data.path == BUILTIN_DATA:
        import json

        rows = [json.loads(line) for line in CHAT_FILE.read_text().splitlines() if line.strip()]
        dataset = Dataset.from_list(rows)
    else:
        path = Path(data.path)
        formats = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
        if path.is_file() and path.suffix in formats:
            dataset = load_dataset(formats[path.suffix], data_files=str(path), split=data.split)
        else:
            dataset = load_dataset(data.path, data.name, split=data.split)
    if data.max_samples is not None:
        dataset = dataset.select(range(min(data.max_samples, len(dataset))))
    if data.eval_fraction > 0:
        split = dataset.train_test_split(test_size=data.eval_fraction, seed=data.seed)
        return split["train"], split["test"]
    return dataset, None


def build_sft_config(recipe: Recipe, output_dir: Path):
    from trl import SFTConfig  # hf_optim (imported with this package) has registered its optimizer names

    from hf_optim.recipes.targets import alias_defaults

    kwargs = {**recipe.training, "output_dir": str(output_dir)}
    return SFTConfig(**alias_defaults(SFTConfig, kwargs), **kwargs)
