"""Validating a merged recipe: every problem collected, each reported with file, key path and a did-you-mean.

The checks themselves are :func:`hf_optim.recipes.checks.collect`, run here against the installed Hugging Face
classes (:mod:`hf_optim.recipes.targets`) and hf_optim's optimizer registry; a recipe they pass is then built once
with the classes that check combinations themselves (``BitsAndBytesConfig``, ``LoraConfig``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from hf_optim.integrations.names import OPTIMIZER_NAMES
from hf_optim.recipes.blame import blamed, culprit_keys
from hf_optim.recipes.checks import (  # noqa: F401  (re-exported: the schema's names)
    AUTO_KEYS,
    MODEL_OWN_KEYS,
    OWN_SECTIONS,
    TOP_LEVEL,
    CheckedAgainst,
    DataSection,
    Header,
    LoggingSection,
    check_value,
    collect,
    optimizer_issue,
    read_by_type,
)
from hf_optim.recipes.errors import RecipeError, RecipeIssue
from hf_optim.recipes.loading import RawRecipe, origin_of
from hf_optim.recipes.targets import pass_through_targets


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


def transformers_optimizer_names() -> list[str]:
    from transformers.training_args import OptimizerNames

    return [member.value for member in OptimizerNames]


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


def check_optimizer(raw: RawRecipe, name: Any, issues: list[RecipeIssue]) -> None:
    problem = optimizer_issue(raw, name, set(transformers_optimizer_names()) | set(OPTIMIZER_NAMES))
    if problem is not None:
        issues.append(problem)


def installed_classes() -> CheckedAgainst:
    """What the full check checks against: the installed classes, transformers' and hf_optim's optimizer names."""
    return CheckedAgainst(pass_through_targets(), set(transformers_optimizer_names()) | set(OPTIMIZER_NAMES),
                          check_optim_args)


def validate(raw: RawRecipe) -> Recipe:
    """Check every section of ``raw``; raise :class:`RecipeError` listing every problem, else the Recipe."""
    found = collect(raw, installed_classes())
    issues = found.issues
    no_adapters = issues.pop() if found.quantization is not None and found.peft is None else None
    if found.quantization is not None and not issues:
        from transformers import BitsAndBytesConfig

        _construct(raw, "quantization", BitsAndBytesConfig, found.quantization, "BitsAndBytesConfig", issues)
    if found.peft is not None and not issues:
        from peft import LoraConfig

        _construct(raw, "peft", LoraConfig, found.peft, "LoraConfig", issues)
    if no_adapters is not None:
        issues.append(no_adapters)
    if issues:
        raise RecipeError(issues)
    return Recipe(raw.source, found.model, found.quantization, found.peft, found.training, found.data,
                  found.logging, found.header.description, found.header.hardware, origins=dict(raw.origins))
