"""The checks of a merged recipe, every problem collected: sections, keys, value types, the optimizer name.

One walk (:func:`collect`) serves both checks of a recipe. The full one (:func:`hf_optim.recipes.schema.validate`)
runs it against the installed Hugging Face classes; the quick one (:mod:`hf_optim.recipes.quickcheck`), before torch
is imported, against the same classes read from their source files (:mod:`hf_optim.recipes.source_targets`). A
value the source alone cannot vouch for (a type it cannot evaluate, a value its reading refuses) stops the quick
walk (:class:`Undecided`), and the full check answers instead: the quick check reports a list only when it is the
list the full check would report, in the same order and words.

The sections hf_optim owns (the top level, ``data``, ``logging``) are pydantic models. Standard library, pydantic and
hf_optim's torch-free modules only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, TypeAdapter, ValidationError

from hf_optim.errors import did_you_mean, suggest
from hf_optim.recipes.errors import RecipeIssue
from hf_optim.recipes.loading import RawRecipe
from hf_optim.recipes.targets import UNREAD, Target

AUTO_KEYS = {("model", "dtype"), ("model", "torch_dtype"), ("training", "bf16"), ("training", "fp16"),
             ("quantization", "bnb_4bit_compute_dtype")}
"""Keys that accept ``auto``: resolved to what the hardware supports (:mod:`hf_optim.recipes.hardware`)."""


class DataSection(BaseModel):
    """The ``data`` section.

    Attributes:
        path: ``builtin:tiny-chat`` (shipped with hf_optim), a local ``.jsonl``/``.json``/``.csv``/``.parquet``
            file, or a Hub dataset id. Rows in any format SFTTrainer reads (``messages``, ``text``,
            ``prompt``/``completion``).
        name: dataset configuration name (Hub datasets).
        split: split to train on.
        max_samples: keep only the first N rows (None: all).
        eval_fraction: fraction of rows held out for evaluation (0: no evaluation set).
        seed: seed of the evaluation split.
    """

    model_config = ConfigDict(extra="forbid")
    path: str
    name: str | None = None
    split: str = "train"
    max_samples: PositiveInt | None = None
    eval_fraction: float = Field(0.0, ge=0.0, lt=1.0)
    seed: int = 0


class LoggingSection(BaseModel):
    """The ``logging`` section.

    Attributes:
        run_name: name shown in plots and comparisons (None: the output directory's name).
        monitor: attach hf_optim's TrainingMonitor (metrics.jsonl, summary.json, plots).
    """

    model_config = ConfigDict(extra="forbid")
    run_name: str | None = None
    monitor: bool = True


class Header(BaseModel):
    """Top-level keys besides the sections: free text that documents the recipe."""

    model_config = ConfigDict(extra="forbid")
    description: str | None = None
    hardware: str | None = Field(None, description="the hardware the recipe targets, e.g. '1x A100 80GB'")


OWN_SECTIONS: dict[str, type[BaseModel]] = {"data": DataSection, "logging": LoggingSection}
TOP_LEVEL = ["model", "quantization", "peft", "training", "data", "logging", *Header.model_fields]
MODEL_OWN_KEYS = {"id": str, "tokenizer": str | None}
"""Keys of ``model`` that hf_optim reads itself: the model id/path and an optional tokenizer id/path."""

class Undecided(Exception):
    """The quick check met a value it cannot vouch for: the full check decides (and reports every problem)."""


@dataclass(frozen=True)
class CheckedAgainst:
    """What :func:`collect` checks a recipe against.

    Attributes:
        targets: the pass-through sections' classes (``model``, ``quantization``, ``peft``, ``training``).
        optimizer_names: every valid ``training.optim``.
        optim_args: ``check_optim_args(raw, optim, optim_args, issues, training)``.
        exact: the targets are the installed classes themselves; False: read from their source, and a value that
            cannot be vouched for raises :class:`Undecided`.
    """

    targets: dict[str, Target]
    optimizer_names: Collection[str]
    optim_args: Callable[[RawRecipe, Any, Any, list[RecipeIssue], dict], None]
    exact: bool = True


@dataclass
class Collected:
    """The sections of a recipe after :func:`collect`: the checked values, and every problem found."""

    issues: list[RecipeIssue]
    header: Header | None
    model: dict[str, Any]
    quantization: dict[str, Any] | None
    peft: dict[str, Any] | None
    training: dict[str, Any]
    data: DataSection | None
    logging: LoggingSection | None


@functools.cache
def _adapter(annotation: Any) -> TypeAdapter | None:
    try:
        return TypeAdapter(annotation)
    except Exception:  # a type pydantic cannot check (torch.dtype, classes): the HF class checks it when built
        return None


def _type_name(annotation: Any) -> str:
    name = getattr(annotation, "__name__", None)
    return name if name and not getattr(annotation, "__args__", None) else str(annotation).replace("typing.", "")


def check_value(annotation: Any, value: Any, exact: bool = True) -> tuple[bool, Any]:
    """(ok, value) for ``value`` against ``annotation``, as pydantic's lax mode reads it, except that a boolean is
    no number (``learning_rate: yes`` is refused, not 1.0). Number strings YAML left unparsed (``2e-4``) come back
    converted; any other value comes back unchanged. ``exact=False`` (an annotation read from source): what would
    be left to the class raises :class:`Undecided`."""
    if annotation is UNREAD:
        raise Undecided
    adapter = _adapter(annotation) if annotation is not None else None
    if adapter is None:
        if annotation is not None and not exact:
            raise Undecided
        return True, value
    try:
        converted = adapter.validate_python(value)
    except ValidationError:
        return False, value
    except Exception:  # a validator that cannot run on this value: leave it to the class
        if not exact:
            raise Undecided from None
        return True, value
    if isinstance(value, bool) and not isinstance(converted, bool):
        return False, value  # pydantic's lax mode would make it 0 or 1
    if isinstance(value, str) and type(converted) in (int, float, bool):
        return True, converted
    return True, value


def read_by_type(annotation: Any, value: Any, written: Any = None, exact: bool = True) -> tuple[bool, Any]:
    """(ok, value) as :func:`check_value`, for a value that YAML may have read as a boolean from a word
    (``written``: the value with that word, :meth:`RawRecipe.as_written`; None if there is none): a field that
    takes the boolean gets it (a bool field, an untyped one), one that refuses it but takes the word gets the word
    (a string or an enum: ``save_strategy: no`` is ``"no"``, not ``False``). ``exact=False``: a value refused
    raises :class:`Undecided` (a type read from source says less than the class)."""
    ok, converted = check_value(annotation, value, exact)
    if not ok and written is not None:
        ok, converted = check_value(annotation, written, exact)
        converted = converted if ok else value
    if not ok and not exact:
        raise Undecided
    return ok, converted


def _type_issue(raw: RawRecipe, path: str, annotation: Any, value: Any) -> RecipeIssue:
    written = raw.as_written(path, value)
    got = repr(written) if isinstance(written, str) else f"{type(value).__name__} {value!r}"
    return RecipeIssue(raw.origin(path), path, f"expected {_type_name(annotation)}, got {got}")


def _check_pass_through(raw: RawRecipe, name: str, values: dict, target: Target, issues: list[RecipeIssue],
                        extra_keys: dict[str, Any] | None = None) -> dict:
    accepted = dict(target.fields)
    accepted.update(extra_keys or {})
    checked = {}
    for key, value in values.items():
        path = f"{name}.{key}"
        if key in target.unread_aliases:
            raise Undecided  # the source does not say whether the class deprecates this key
        replacement = target.aliases.get(key)
        if replacement is not None:
            if replacement in values:
                issues.append(RecipeIssue(raw.origin(path), path, f"deprecated alias of {replacement!r}, which is "
                                          "set too: keep only one of them"))
                continue
            key = replacement  # the installed class deprecates the old name: pass the new one
        if key not in accepted:
            issues.append(RecipeIssue(raw.origin(path), path,
                                      f"unknown {target.label}{did_you_mean(str(key), list(accepted))}"))
            continue
        if (name, key) in AUTO_KEYS and value == "auto":
            checked[key] = value
            continue
        ok, converted = read_by_type(accepted[key], value, raw.as_written(path, value), target.exact)
        if not ok:
            issues.append(_type_issue(raw, path, accepted[key], value))
            continue
        checked[key] = converted
    return checked


def _check_own(raw: RawRecipe, name: str, values: dict, model: type[BaseModel], issues: list[RecipeIssue]):
    known = list(model.model_fields)
    clean = {}
    for key, value in values.items():
        path = f"{name}.{key}" if name else str(key)
        if key not in model.model_fields:
            issues.append(RecipeIssue(raw.origin(path), path, f"unknown key{did_you_mean(str(key), known)}"))
            continue
        if isinstance(value, bool):  # a string field keeps the word YAML read; a number field refuses it
            annotation = model.model_fields[key].annotation
            ok, value = read_by_type(annotation, value, raw.as_written(path, value))
            if not ok:
                issues.append(_type_issue(raw, path, annotation, value))
                continue
        clean[key] = value
    try:
        return model.model_validate(clean)
    except ValidationError as exc:
        for error in exc.errors():
            path = ".".join(str(p) for p in ((name,) if name else ()) + tuple(error["loc"]))
            issues.append(RecipeIssue(raw.origin(path), path, error["msg"]))
    return None


def optimizer_issue(raw: RawRecipe, name: Any, valid: Collection[str]) -> RecipeIssue | None:
    """The problem with ``training.optim`` = ``name`` (an hf_optim or transformers name), or None."""
    valid = sorted(valid)
    name = str(getattr(name, "value", name))
    if name in valid:
        return None
    close = suggest(name, valid)
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return RecipeIssue(raw.origin("training.optim"), "training.optim",
                       f"unknown optimizer {name!r}{hint} (`hf-optim optimizers` lists hf_optim's names; "
                       "transformers' are in transformers.training_args.OptimizerNames)")


def collect(raw: RawRecipe, against: CheckedAgainst) -> Collected:
    """Every problem of ``raw`` against ``against``, in the order of the sections, with the checked values."""
    issues: list[RecipeIssue] = []
    data = raw.data
    for key in data:
        if key not in TOP_LEVEL:
            issues.append(RecipeIssue(raw.origin(str(key)), str(key),
                                      f"unknown section{did_you_mean(str(key), TOP_LEVEL)}"))
    header = _check_own(raw, "", {k: v for k, v in data.items() if k in Header.model_fields}, Header, issues)

    sections: dict[str, dict | None] = {}
    for name in ("model", "quantization", "peft", "training", "data", "logging"):
        value = data.get(name)
        if value is None:
            sections[name] = None
        elif not isinstance(value, dict):
            issues.append(RecipeIssue(raw.origin(name), name, f"must be a mapping of keys, got {type(value).__name__} "
                                      f"{value!r}"))
            sections[name] = None
        else:
            sections[name] = value

    targets = against.targets
    model = sections["model"]
    if model is None:
        if "model" not in data:
            issues.append(RecipeIssue(raw.source, "model", "missing section (needs at least `id`)"))
        model = {}
    elif "id" not in model:
        issues.append(RecipeIssue(raw.origin("model"), "model.id", "missing: the model id or path to fine-tune"))
    model = _check_pass_through(raw, "model", model, targets["model"], issues, MODEL_OWN_KEYS)

    quantization = sections["quantization"]
    if quantization is not None:
        quantization = _check_pass_through(raw, "quantization", quantization, targets["quantization"], issues)
    peft = sections["peft"]
    if peft is not None:
        peft = _check_pass_through(raw, "peft", peft, targets["peft"], issues)
    training = _check_pass_through(raw, "training", sections["training"] or {}, targets["training"], issues)
    if "optim" in training:
        problem = optimizer_issue(raw, training["optim"], against.optimizer_names)
        if problem is not None:
            issues.append(problem)
        against.optim_args(raw, training["optim"], training.get("optim_args"), issues, training)

    data_section = sections["data"]
    if data_section is None and "data" not in data:
        issues.append(RecipeIssue(raw.source, "data", "missing section (needs at least `path`)"))
    data_model = _check_own(raw, "data", data_section or {}, DataSection, issues) if data_section is not None \
        else None
    logging_model = _check_own(raw, "logging", sections["logging"] or {}, LoggingSection, issues)
    if quantization is not None and peft is None:
        issues.append(no_adapters_issue(raw))
    return Collected(issues, header, model, quantization, peft, training, data_model, logging_model)


def no_adapters_issue(raw: RawRecipe) -> RecipeIssue:
    """The problem of a quantized model without a ``peft`` section (always the last one :func:`collect` lists)."""
    return RecipeIssue(raw.source, "peft", "a quantized model trains through adapters: add a peft section (QLoRA), "
                       "or remove the quantization section (full fine-tune)")
