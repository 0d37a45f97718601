"""Which recipe keys a rejection is about, when a class rejects a section as a whole.

A Hugging Face class (``LoraConfig``, ``SFTConfig``, an optimizer) raises one message for all the values it got; an
error that names the key, and the file or ``command line`` that set it, is what the user can act on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hf_optim.recipes.loading import COMMAND_LINE


def culprit_keys(build: Callable[[dict[str, Any]], object], values: dict[str, Any],
                 neutral: dict[str, Any] | None = None) -> list[str]:
    """The keys of ``values`` whose removal alone makes ``build(values)`` succeed, in order; empty when no single
    key explains the rejection (the class's defaults are then wrong too, or it needs a key that is missing).

    Args:
        build: builds the object from a mapping of values; raises when it rejects them.
        values: the values that were rejected.
        neutral (default None): key -> the value tried instead of removing the key (``bf16: False``: TRL's
            default for a missing ``bf16`` is True).

    Call it only after ``build(values)`` failed: it builds once per key."""
    neutral = neutral or {}
    found = []
    for key in values:
        trial = {k: v for k, v in values.items() if k != key}
        if key in neutral:
            trial[key] = neutral[key]
        try:
            build(trial)
        except Exception:  # noqa: BLE001 (any rejection: the class's own checks raise what they like)
            continue
        found.append(key)
    return found


def blamed(origin: Callable[[str], str], section: str, keys: list[str]) -> tuple[str, str]:
    """(file, key path) for an issue about ``keys`` of ``section``: the file that set them (``command line`` when
    an override set any of them), and the keys as ``section.a, section.b``; the section itself when no key is known."""
    if not keys:
        return origin(section), section
    paths = [f"{section}.{key}" for key in keys]
    files = [origin(path) for path in paths]
    return (COMMAND_LINE if COMMAND_LINE in files else files[0]), ", ".join(paths)
