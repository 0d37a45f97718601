"""Smoke mode: any recipe, run for a few steps on CPU with the tiny builtin model and the bundled data.

The recipe's method (full, LoRA or QLoRA on 4-bit bitsandbytes weights), its LoRA settings and its optimizer
are kept; only the model, data, size of the run and the hardware-specific settings change. This is how every
bundled recipe runs in CI without downloads or a GPU.
"""

from __future__ import annotations

import os
from pathlib import Path

from hf_optim.recipes.loading import RawRecipe, deep_merge
from hf_optim.recipes.rundir import smoke_dir
from hf_optim.tiny import BUILTIN_DATA, BUILTIN_MODEL

SMOKE_ENV = "HF_OPTIM_SMOKE"
SMOKE_STEPS = 3

# Settings that need a GPU or a particular kernel, or that only matter for long runs.
_DROP_TRAINING = ("bf16", "fp16", "tf32", "torch_compile", "optim_target_modules", "deepspeed", "fsdp",
                  "fsdp_config", "eval_steps", "save_steps", "num_train_epochs", "warmup_ratio", "use_liger_kernel",
                  "model_init_kwargs", "packing")
_DROP_QUANTIZATION = ("bnb_4bit_quant_storage",)


def smoke_requested(flag: bool = False) -> bool:
    """True when ``--smoke`` is given or ``HF_OPTIM_SMOKE`` is set to anything but ``0`` or empty."""
    return flag or os.environ.get(SMOKE_ENV, "0") not in ("", "0")


def smoke_recipe(raw: RawRecipe) -> RawRecipe:
    """``raw`` turned into a smoke run (before command-line overrides, so those still apply)."""
    data = dict(raw.data)
    model = data.get("model") if isinstance(data.get("model"), dict) else {}
    data["model"] = {"id": BUILTIN_MODEL, "dtype": "float32", **({"trust_remote_code": model["trust_remote_code"]}
                                                                  if "trust_remote_code" in model else {})}
    quantization = data.get("quantization")
    if isinstance(quantization, dict):
        quantization = {k: v for k, v in quantization.items() if k not in _DROP_QUANTIZATION}
        if quantization.get("load_in_4bit") or quantization.get("load_in_8bit"):
            quantization["bnb_4bit_compute_dtype"] = "float32"
        data["quantization"] = quantization
    training = data.get("training") if isinstance(data.get("training"), dict) else {}
    training = {k: v for k, v in training.items() if k not in _DROP_TRAINING}
    set_by_smoke = {
        "max_steps": SMOKE_STEPS, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 1,
        "max_length": 128, "logging_steps": 1, "save_strategy": "no", "eval_strategy": "no", "report_to": "none",
        "use_cpu": True, "warmup_steps": 0, "dataloader_num_workers": 0, "disable_tqdm": True,
    }
    data["training"] = deep_merge(training, set_by_smoke)
    real_run = training.get("output_dir") or Path("runs") / Path(raw.source).stem  # train.default_output_dir's
    data["training"]["output_dir"] = str(smoke_dir(real_run))  # its own directory: the real run's stays free
    logging = data.get("logging") if isinstance(data.get("logging"), dict) else {}
    data["data"] = {"path": BUILTIN_DATA, "max_samples": 32}
    data["logging"] = logging
    origins = dict(raw.origins)
    for key in ("model", "data"):
        for path in [p for p in origins if p == key or p.startswith(key + ".")]:
            origins[path] = "smoke mode"
    replaced = ("model", "data", "quantization.bnb_4bit_compute_dtype", *(f"training.{k}" for k in set_by_smoke))
    words = {path: word for path, word in raw.bool_words.items()  # the words of the values smoke mode kept
             if not any(path == key or path.startswith(key + ".") for key in replaced)}
    return RawRecipe(data, raw.source, origins, words)
