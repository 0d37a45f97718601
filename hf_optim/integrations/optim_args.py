"""Typed, validated ``optim_args`` for hf_optim's Trainer names.

transformers passes ``TrainingArguments.optim_args`` (``"k1=v1,k2=v2"``) through as strings. hf_optim accepts
the keys transformers reads for its bitsandbytes names (``beta1``, ``beta2``, ``beta3``, ``alpha``, ``eps``,
``t_alpha``, ``t_beta3``) plus every keyword argument of the class's constructor, converts each value to the
type of that argument's default, and rejects unknown keys with the list of valid ones.
"""

from __future__ import annotations

import inspect
from typing import Any

from hf_optim.integrations.names import OPTIMIZER_NAMES, OptimizerName, suggest

_BETA_KEYS = ("beta1", "beta2", "beta3")
_FIXED_BY_NAME = ("is_paged", "optim_bits", "state_format")
"""What the ``optim=`` name itself decides (paging and state format): not an ``optim_args`` key."""
_NOT_FROM_OPTIM_ARGS = {"self", "params", "args", *_FIXED_BY_NAME}


class OptimArgsError(ValueError):
    """A bad ``optim_args`` key or value."""


def parse_optim_args(text: str | None) -> dict[str, str]:
    """``"k1=v1,k2=v2"`` -> ``{"k1": "v1", "k2": "v2"}`` (transformers' format; values stay strings here)."""
    if not text:
        return {}
    pairs = {}
    for item in text.replace(" ", "").split(","):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise OptimArgsError(f"optim_args item {item!r} is not 'key=value' (expected e.g. 'beta1=0.9,eps=1e-6')")
        pairs[key] = value
    return pairs


def constructor_defaults(cls: type) -> dict[str, Any]:
    """The keyword arguments ``optim_args`` may set for ``cls``, with their defaults."""
    parameters = inspect.signature(cls.__init__).parameters
    return {k: p.default for k, p in parameters.items() if k not in _NOT_FROM_OPTIM_ARGS}


def valid_keys(entry: OptimizerName) -> list[str]:
    keys = list(constructor_defaults(entry.cls))
    if "betas" in keys:
        keys += list(_BETA_KEYS[: len(constructor_defaults(entry.cls)["betas"])])
    return sorted(keys)


def _declared_type(entry: OptimizerName, key: str) -> tuple[str, bool]:
    """The type a constructor argument is annotated with, as ``(base type name, whether None is allowed)``:
    ``("bool", True)`` for ``bool | None``; ``("", False)`` when it has no annotation (a generated class)."""
    parameter = inspect.signature(entry.cls.__init__).parameters.get(key)
    annotation = getattr(parameter, "annotation", inspect.Parameter.empty)
    if annotation is inspect.Parameter.empty:
        return "", False
    parts = [part.strip() for part in str(annotation).split("|")]
    base = [part for part in parts if part != "None"]
    return (base[0].partition("[")[0] if base else ""), len(base) < len(parts)


def _convert(key: str, raw: str, default: Any, entry: OptimizerName) -> Any:
    """``raw`` as the type of argument ``key``: its annotation (``str | None``: text; ``bool | None``: true, false or
    none), else the type of its default."""
    def fail(expected: str) -> OptimArgsError:
        return OptimArgsError(f"optim_args {key}={raw!r} for optim={entry.name!r}: expected {expected}")

    declared, nullable = _declared_type(entry, key)
    if (nullable or default is None) and raw.lower() == "none":
        return None
    if declared == "str":
        return raw  # a name: the class checks it (Muon's adjust_lr_fn)
    if declared == "bool" or isinstance(default, bool):
        lowered = raw.lower()
        if lowered in ("true", "1", "yes"):
            return True
        if lowered in ("false", "0", "no"):
            return False
        raise fail("true or false")
    if declared == "int" or isinstance(default, int):
        try:
            return int(raw)
        except ValueError:
            raise fail("an integer") from None
    if isinstance(default, tuple):
        try:
            return tuple(float(v) for v in raw.split(";"))
        except ValueError:
            raise fail(f"{len(default)} numbers separated by ';'") from None
    try:
        return float(raw)
    except ValueError:
        raise fail("a number") from None


def typed_optim_args(entry: OptimizerName, raw: dict[str, str]) -> dict[str, Any]:
    """Convert ``optim_args`` strings for ``entry``'s class; ``beta1``/``beta2``/``beta3`` are kept separate
    (the caller folds them into ``betas``)."""
    defaults = constructor_defaults(entry.cls)
    allowed = valid_keys(entry)
    typed: dict[str, Any] = {}
    for key, value in raw.items():
        if key in _FIXED_BY_NAME:
            names = ", ".join(name for name, other in OPTIMIZER_NAMES.items() if other.family == entry.family)
            raise OptimArgsError(f"optim_args key {key!r}: the optim name chooses the state format and paging; "
                                 f"for {entry.family} use one of {names}")
        if key not in allowed:
            close = suggest(key, allowed)
            hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            raise OptimArgsError(
                f"optim_args key {key!r} is not valid for optim={entry.name!r} ({entry.cls.__name__}){hint} "
                f"Valid keys: {', '.join(allowed)}"
            )
        if key in _BETA_KEYS:
            typed[key] = _convert(key, value, 0.0, entry)
        else:
            typed[key] = _convert(key, value, defaults[key], entry)
    return typed
