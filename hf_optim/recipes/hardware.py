"""``auto`` in a recipe: the precision this machine supports (bf16 on Ampere and newer GPUs, fp16 on older GPUs
such as the T4, fp32 on CPU)."""

from __future__ import annotations

import copy

import torch

from hf_optim.recipes.schema import Recipe


def best_dtype(use_cpu: bool = False) -> str:
    """``"bfloat16"`` on a GPU with bf16 support (compute capability 8.0+), ``"float16"`` on an older GPU,
    ``"float32"`` on CPU (or when ``use_cpu``)."""
    if use_cpu or not torch.cuda.is_available():
        return "float32"
    return "bfloat16" if torch.cuda.is_bf16_supported(including_emulation=False) else "float16"


def resolve_auto(recipe: Recipe, dtype: str | None = None) -> Recipe:
    """A copy of ``recipe`` with every ``auto`` replaced, each change noted in ``recipe.notes``.

    Args:
        recipe: a validated recipe.
        dtype (str | None, default None): the precision to resolve to; None asks :func:`best_dtype`.

    A full fine-tune on fp16-only hardware keeps fp32 weights (fp16 autocast): the Trainer cannot unscale fp16
    gradients, and fp16 master weights lose small updates.
    """
    resolved = copy.deepcopy(recipe)
    dtype = dtype or best_dtype(bool(recipe.training.get("use_cpu")))
    notes = []
    for key in ("dtype", "torch_dtype"):
        if resolved.model.get(key) == "auto":
            weights = "float32" if dtype == "float16" and recipe.method == "full" else dtype
            resolved.model[key] = weights
            notes.append(f"model.{key}: auto -> {weights}")
    if resolved.quantization and resolved.quantization.get("bnb_4bit_compute_dtype") == "auto":
        resolved.quantization["bnb_4bit_compute_dtype"] = dtype
        notes.append(f"quantization.bnb_4bit_compute_dtype: auto -> {dtype}")
    for key, wanted in (("bf16", "bfloat16"), ("fp16", "float16")):
        if resolved.training.get(key) == "auto":
            resolved.training[key] = dtype == wanted
            notes.append(f"training.{key}: auto -> {resolved.training[key]}")
    resolved.notes.extend(notes)
    return resolved
