"""Validating a merged recipe: every problem collected, each reported with file, key path and a did-you-mean.

The sections hf_optim owns (the top level, ``data``, ``logging``) are pydantic models; the pass-through sections
are checked against the installed Hugging Face classes (:mod:`hf_optim.recipes.targets`).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, TypeAdapter, ValidationError

from hf_optim.errors import did_you_mean
from hf_optim.integrations.names import OPTIMIZER_NAMES, suggest
from hf_optim.recipes.blame import blamed, culprit_keys
from hf_optim.recipes.errors import RecipeError, RecipeIssue
from hf_optim.recipes.loading import RawRecipe, origin_of
from hf_optim.recipes.targets import Target, pass_through_targets

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


@dataclass
class Recipe:
    """A validated recipe.

    Attributes:
        source: the recipe file, as errors and logs name it.
        model: ``id``, optional ``tokenizer``, and from_pretrained keyword arguments.
        quantization: BitsAndBytesConfig arguments, or None (no quantization).
        peft: LoraConfig arguments, or None (full fine-tune).
        training: SFTConfig arguments.
        data: the data section.
        logging: the logging section.
        description: free text.
        hardware: the hardware the recipe targets.
        notes: what resolving ``auto`` or smoke mode changed, for the logs.
        origins: the file (or ``command line``) that set each dotted key path, for error messages.
    """

    source: str
    model: dict[str, Any]
    quantization: dict[str, Any] | None
    peft: dict[str, Any] | None
    training: dict[str, Any]
    data: DataSection
    logging: LoggingSection
    description: str | None = None
    hardware: str | None = None
    notes: list[str] = field(default_factory=list)
    origins: dict[str, str] = field(default_factory=dict, repr=False)

    def origin(self, key_path: str) -> str:
        """The file (or ``command line``) that set ``key_path`` or its closest parent; the recipe file when unknown."""
        return origin_of(self.origins, key_path, self.source)

    @property
    def method(self) -> str:
        """``qlora`` (quantized base + adapters), ``lora`` or ``full``."""
        if self.peft is None:
            return "full"
        return "qlora" if self.quantization else "lora"

    @property
    def optim(self) -> str:
        return str(self.training.get("optim", default_optim()))

    def to_dict(self) -> dict[str, Any]:
        """The recipe as a plain mapping (what ``recipe.yaml`` holds)."""
        out: dict[str, Any] = {}
        if self.description:
            out["description"] = self.description
        if self.hardware:
            out["hardware"] = self.hardware
        out["model"] = dict(self.model)
        out["quantization"] = dict(self.quantization) if self.quantization is not None else None
        out["peft"] = dict(self.peft) if self.peft is not None else None
        out["training"] = dict(self.training)
        out["data"] = self.data.model_dump()
        out["logging"] = self.logging.model_dump()
        return out


def default_optim() -> str:
    from trl import SFTConfig

    default = next(f.default for f in dataclasses.fields(SFTConfig) if f.name == "optim")
    return str(getattr(default, "value", default))


@functools.cache
def _adapter(annotation: Any) -> TypeAdapter | None:
    try:
        return TypeAdapter(annotation)
    except Exception:  # a type pydantic cannot check (torch.dtype, classes): the HF class checks it when built
        return None


def _type_name(annotation: Any) -> str:
    name = getattr(annotation, "__name__", None)
    return name if name and not getattr(annotation, "__args__", None) else str(annotation).replace("typing.", "")


def check_value(annotation: Any, value: Any) -> tuple[bool, Any]:
    """(ok, value) for ``value`` against ``annotation``, as pydantic's lax mode reads it, except that a boolean is
    no number (``learning_rate: yes`` is refused, not 1.0). Number strings YAML left unparsed (``2e-4``) come back
    converted; any other value comes back unchanged."""
    adapter = _adapter(annotation) if annotation is not None else None
    if adapter is None:
        return True, value
    try:
        converted = adapter.validate_python(value)
    except ValidationError:
        return False, value
    except Exception:  # a validator that cannot run on this value: leave it to the class
        return True, value
    if isinstance(value, bool) and not isinstance(converted, bool):
        return False, value  # pydantic's lax mode would make it 0 or 1
    if isinstance(value, str) and type(converted) in (int, float, bool):
        return True, converted
    return True, value


def read_by_type(annotation: Any, value: Any, written: Any = None) -> tuple[bool, Any]:
    """(ok, value) as :func:`check_value`, for a value that YAML may have read as a boolean from a word
    (``written``: the value with that word, :meth:`RawRecipe.as_written`; None if there is none): a field that
    takes the boolean gets it (a bool field, an untyped one), one that refuses it but takes the word gets the word
    (a string or an enum: ``save_strategy: no`` is ``"no"``, not ``False``)."""
    ok, converted = check_value(annotation, value)
    if ok or written is None:
        return ok, converted
    ok, converted = check_value(annotation, written)
    return (True, converted) if ok else (False, value)


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
        ok, converted = read_by_type(accepted[key], value, raw.as_written(path, value))
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


def transformers_optimizer_names() -> list[str]:
    from transformers.training_args import OptimizerNames

    return [member.value for member in OptimizerNames]


def check_optimizer(raw: RawRecipe, name: Any, issues: list[RecipeIssue]) -> None:
    valid = sorted(set(transformers_optimizer_names()) | set(OPTIMIZER_NAMES))
    name = str(getattr(name, "value", name))
    if name in valid:
        return
    close = suggest(name, valid)
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    issues.append(RecipeIssue(raw.origin("training.optim"), "training.optim",
                              f"unknown optimizer {name!r}{hint} (`hf-optim optimizers` lists hf_optim's names; "
                              "transformers' are in transformers.training_args.OptimizerNames)"))


def check_optim_args(raw: RawRecipe, name: Any, optim_args: Any, issues: list[RecipeIssue],
                     training: dict | None = None) -> None:
    """``training.optim_args`` of an hf_optim name, checked as the optimizer will read them (keys and types), so
    that a typo fails at validation, not when training starts; with ``release_gradients``, the ``training`` keys
    gradient release cannot honour (the Trainer's defaults where unset, e.g. ``max_grad_norm=1.0``)."""
    entry = OPTIMIZER_NAMES.get(str(getattr(name, "value", name)))
    if entry is None or not optim_args:
        return
    from hf_optim.integrations.optim_args import OptimArgsError, parse_optim_args, typed_optim_args

    try:
        typed = typed_optim_args(entry, parse_optim_args(str(optim_args)))
    except OptimArgsError as error:
        issues.append(RecipeIssue(raw.origin("training.optim_args"), "training.optim_args", str(error)))
        return
    if typed.get("release_gradients"):
        from types import SimpleNamespace

        from hf_optim.integrations.transformers import release_argument_problems

        settings = {"gradient_accumulation_steps": 1, "max_grad_norm": 1.0, "fp16": False}  # the Trainer's defaults
        settings.update({k: v for k, v in (training or {}).items() if k in settings and v != "auto"})
        for problem in release_argument_problems(SimpleNamespace(**settings)):
            issues.append(RecipeIssue(raw.origin("training.optim_args"), "training.optim_args",
                                      f"release_gradients=True: {problem}"))


def _construct(raw: RawRecipe, name: str, factory, values: dict, label: str, issues: list[RecipeIssue]) -> None:
    """Build the Hugging Face object once, so that its own value checks (ranges, combinations) are reported too,
    naming the keys the rejection is about and the file (or command line) that set them."""
    values = {k: v for k, v in values.items() if v != "auto"}
    try:
        factory(**values)
    except Exception as exc:  # the class's own message is the useful part
        keys = culprit_keys(lambda kwargs: factory(**kwargs), values)
        file, path = blamed(raw.origin, name, keys)
        issues.append(RecipeIssue(file, path, f"{label} rejected {'this value' if len(keys) == 1 else 'these values'}"
                                  f": {exc}"))


def validate(raw: RawRecipe) -> Recipe:
    """Check every section of ``raw``; raise :class:`RecipeError` listing every problem, else the Recipe."""
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

    targets = pass_through_targets()
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
        check_optimizer(raw, training["optim"], issues)
        check_optim_args(raw, training["optim"], training.get("optim_args"), issues, training)

    data_section = sections["data"]
    if data_section is None and "data" not in data:
        issues.append(RecipeIssue(raw.source, "data", "missing section (needs at least `path`)"))
    data_model = _check_own(raw, "data", data_section or {}, DataSection, issues) if data_section is not None \
        else None
    logging_model = _check_own(raw, "logging", sections["logging"] or {}, LoggingSection, issues)

    if quantization is not None and not issues:
        from transformers import BitsAndBytesConfig

        _construct(raw, "quantization", BitsAndBytesConfig, quantization, "BitsAndBytesConfig", issues)
    if peft is not None and not issues:
        from peft import LoraConfig

        _construct(raw, "peft", LoraConfig, peft, "LoraConfig", issues)
    if quantization is not None and peft is None:
        issues.append(RecipeIssue(raw.source, "peft", "a quantized model trains through adapters: add a peft "
                                  "section (QLoRA), or remove the quantization section (full fine-tune)"))
    if issues:
        raise RecipeError(issues)
    return Recipe(raw.source, model, quantization, peft, training, data_model, logging_model,
                  header.description, header.hardware, origins=dict(raw.origins))
