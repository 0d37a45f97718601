"""What each pass-through section accepts, read from the installed classes (never a hard-coded list).

``model`` -> ``PreTrainedModel.from_pretrained`` (its signature and the keyword arguments its body pops),
``quantization`` -> ``BitsAndBytesConfig.__init__``, ``peft`` -> ``LoraConfig`` fields, ``training`` ->
``SFTConfig`` fields. Each field maps to its type annotation, or ``None`` when the class gives no usable type.

A field the class keeps only as a deprecated alias of another (transformers 5.2x: ``gradient_checkpointing`` ->
``activation_checkpointing``) is found from the help text transformers gives it, so a recipe's key reaches the
installed class under the name that class does not deprecate, and the recipe still runs on versions before the
rename.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import typing
from dataclasses import dataclass, field
from typing import Any

_NO_TYPE = None
UNREAD = object()
"""A field type read from source that could not be evaluated (:mod:`hf_optim.recipes.source_targets`): no value of
that field can be vouched for without the installed class."""


@dataclass(frozen=True)
class Target:
    """A class a recipe section passes its keys to.

    Attributes:
        section: recipe section name.
        label: how errors name the class (``LoraConfig``).
        fields: accepted key -> type annotation (``None``: any value).
        aliases: deprecated key -> the key that replaces it, both accepted.
        exact: the fields are the installed class's own; False: read from its source file
            (:mod:`hf_optim.recipes.source_targets`), where a value that cannot be vouched for is left to the full
            check.
        unread_aliases: keys whose source does not say whether they are deprecated aliases (read from source).
    """

    section: str
    label: str
    fields: dict[str, Any]
    aliases: dict[str, str] = field(default_factory=dict)
    exact: bool = True
    unread_aliases: frozenset[str] = frozenset()


_ALIAS_HELP = re.compile(r"Deprecated alias of `(\w+)`")


def deprecated_aliases(cls: type) -> dict[str, str]:
    """Deprecated field -> its replacement, for every dataclass field of ``cls`` (or of a base class: a subclass
    that redefines a field, as TRL's configs redefine defaults, keeps the base class's help) documented as
    "Deprecated alias of `name`"."""
    fields = {f.name for f in dataclasses.fields(cls)}
    aliases = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            for f in dataclasses.fields(klass):
                match = _ALIAS_HELP.match(str((f.metadata or {}).get("help", "")))
                if match and match.group(1) in fields:
                    aliases[f.name] = match.group(1)
    return aliases


def alias_defaults(cls: type, given: dict[str, Any]) -> dict[str, Any]:
    """Values to pass under the replacing name when ``given`` sets neither name but ``cls`` gives the deprecated
    one a default of its own (TRL's ``SFTConfig`` defaults ``gradient_checkpointing`` to True, the replacing
    ``activation_checkpointing`` to None, and transformers warns when it copies the old value over)."""
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    out = {}
    for old, new in deprecated_aliases(cls).items():
        if old in given or new in given:
            continue
        if defaults.get(old, None) not in (None, dataclasses.MISSING) and defaults.get(new, None) is None:
            out[new] = defaults[old]
    return out


def _dataclass_fields(cls: type) -> dict[str, Any]:
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # an annotation the running Python cannot evaluate: fall back to the raw field types
        hints = {}
    return {f.name: hints.get(f.name, f.type if not isinstance(f.type, str) else _NO_TYPE)
            for f in dataclasses.fields(cls) if f.init}


def _signature_fields(func, skip: set[str]) -> dict[str, Any]:
    """Parameters of ``func``; unannotated ones are typed by their default (bool, int, float, str)."""
    fields = {}
    for name, param in inspect.signature(func).parameters.items():
        if name in skip or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if param.annotation is not param.empty:
            fields[name] = param.annotation
        elif type(param.default) in (bool, int, float, str):
            fields[name] = type(param.default)
        else:
            fields[name] = _NO_TYPE
    return fields


@functools.cache
def model_target() -> Target:
    from transformers import PreTrainedModel

    func = PreTrainedModel.from_pretrained
    fields = _signature_fields(func, {"cls", "pretrained_model_name_or_path", "config"})
    # from_pretrained takes most options through **kwargs and pops them by name in its body.
    popped = set(re.findall(r"""kwargs\.pop\(\s*["']([A-Za-z]\w*)["']""", inspect.getsource(func)))
    for name in sorted(popped - set(fields)):
        fields[name] = _NO_TYPE
    fields.pop("quantization_config", None)  # the quantization section builds it
    return Target("model", "from_pretrained argument", fields)


@functools.cache
def quantization_target() -> Target:
    from transformers import BitsAndBytesConfig

    return Target("quantization", "BitsAndBytesConfig field", _signature_fields(BitsAndBytesConfig.__init__, {"self"}))


@functools.cache
def peft_target() -> Target:
    from peft import LoraConfig

    return Target("peft", "LoraConfig field", _dataclass_fields(LoraConfig))


@functools.cache
def training_target() -> Target:
    from trl import SFTConfig

    return Target("training", "SFTConfig field", _dataclass_fields(SFTConfig), deprecated_aliases(SFTConfig))


def pass_through_targets() -> dict[str, Target]:
    return {t.section: t for t in (model_target(), quantization_target(), peft_target(), training_target())}
