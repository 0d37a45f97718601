"""The algorithm registry: one call turns an :class:`~hf_optim.core.algorithm.Algorithm` into optimizer classes
and ``optim=`` names.

:func:`register_algorithm` records the description, builds (or takes) its base optimizer class and derives the
bitsandbytes family of fixed-precision and paged classes from it (:func:`hf_optim.optim.variants.family`). The
Trainer names (:mod:`hf_optim.integrations.names`) are read from the registry, and the transformers integration
subscribes with :func:`on_register`, so an algorithm registered after ``import hf_optim`` (or after transformers)
is accepted as ``TrainingArguments(optim=...)`` at once.
"""

from __future__ import annotations

import difflib
import inspect
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hf_optim.core.algorithm import Algorithm
from hf_optim.formats import StateFormat, formats_by_rank
from hf_optim.optim import options as common_options
from hf_optim.optim._validation import as_tuple, check_lr
from hf_optim.optim.base import HfOptimizer
from hf_optim.optim.trainer_mapping import mapping, parse_name, trainer_names
from hf_optim.optim.variants import family


@dataclass(frozen=True)
class Family:
    """A registered algorithm: its description, its base class and every class derived from it, by name."""

    algorithm: Algorithm
    base: type
    classes: Mapping[str, type]
    formats: tuple[StateFormat, ...] = ()
    """The formats with named classes (``AdamW8bit``), in table order."""

    def __getitem__(self, class_name: str) -> type:
        try:
            return self.classes[class_name]
        except KeyError:
            known = ", ".join(self.classes)
            raise KeyError(f"{self.algorithm.name} has no class {class_name!r}; it has {known}") from None

    def take(self, *class_names: str) -> tuple[type, ...]:
        """The classes named, in that order: a module binds its static names in one statement
        (``AdamW8bit, PagedAdamW8bit = family.take("AdamW8bit", "PagedAdamW8bit")``). Classes left unnamed (those of
        a format registered later) are still package attributes (``hf_optim._exports``)."""
        return tuple(self[name] for name in class_names)

    @property
    def pages(self) -> bool:
        """Whether the classes take ``is_paged`` (paged variants exist)."""
        return any(name.startswith("Paged") for name in self.classes)

    def class_for(self, fmt: StateFormat, paged: bool) -> type:
        """The class an ``optim=`` name of this format and paging builds: the matching fixed variant, else the
        base class (Adafactor has no fixed-format variants; its Trainer mapping sets ``state_format``)."""
        prefix = "Paged" if paged else ""
        variant = self.classes.get(f"{prefix}{self.algorithm.class_name}{fmt.class_suffix}")
        if variant is not None:
            return variant
        if paged:
            raise ValueError(f"{self.algorithm.class_name} has no paged {fmt.label} class")
        return self.base

    @property
    def trainer_names(self) -> tuple[str, ...]:
        """The ``optim=`` names of the algorithm (see :mod:`hf_optim.optim.trainer_mapping`)."""
        return trainer_names(self.algorithm, list(self.formats), self.pages)


class UnknownAlgorithmError(KeyError):
    """No algorithm is registered under the name asked for."""

    def __str__(self) -> str:  # KeyError would repr the message
        return str(self.args[0])


_FAMILIES: dict[str, Family] = {}
_LISTENERS: list[Callable[[Family], None]] = []


def register_algorithm(
    algorithm: Algorithm,
    optimizer: type | None = None,
    *,
    defaults: Mapping[str, Any] | None = None,
    check: Callable[[dict], None] | None = None,
    module: str | None = None,
    variants: bool = True,
) -> Family:
    """Register ``algorithm``: its optimizer classes, and its ``optim=`` names for the Trainer.

    Args:
        algorithm: the description.
        optimizer: its base class, an :class:`~hf_optim.optim.base.HfOptimizer` subclass whose ``definition`` is
            ``algorithm`` (hf_optim's own algorithms, which keep bitsandbytes' constructor signatures). None:
            a class is generated from ``defaults``.
        defaults: for a generated class, its hyperparameters with their defaults (``lr`` among them), in
            constructor order; the common options (:mod:`hf_optim.optim.options`) are added.
        check: for a generated class, ``check(group)`` validates a param group's hyperparameters (raise
            ``ValueError`` naming the bad value); ``lr`` is always checked.
        module: the ``__module__`` of generated classes (default: the caller's module), so they pickle when the
            caller keeps them as module attributes.
        variants: build the fixed-precision and paged classes (False: only the base class, as Adafactor, which
            bitsandbytes has no family for).

    Returns:
        the :class:`Family`: ``family["<ClassName>8bit"]``, ``family.base``, ...

    Registering the same description again returns its family; another description under a registered name, or a
    Trainer name another algorithm has, is an error.
    """
    current = _FAMILIES.get(algorithm.name)
    if current is not None:
        if current.algorithm is algorithm and optimizer in (None, current.base):
            return current
        raise ValueError(f"an algorithm named {algorithm.name!r} is already registered; choose another name")
    if optimizer is None:
        if defaults is None or "lr" not in defaults:
            raise ValueError(f"register_algorithm({algorithm.name!r}): pass the optimizer class, or defaults= with "
                             "'lr' among the hyperparameters to generate one")
        module = module or _caller_module()
        optimizer = _generated_class(algorithm, dict(defaults), check, module)
    elif getattr(optimizer, "definition", None) is not algorithm:
        raise ValueError(f"{optimizer.__name__}.definition is not the algorithm being registered ({algorithm.name!r})")
    supported = optimizer._supported_formats()
    named = supported if algorithm.variant_formats is None else formats_by_rank(algorithm.variant_formats)
    if not set(named) <= set(supported):
        raise ValueError(f"{algorithm.name!r}: variant_formats {[f.name for f in named]} are not all formats "
                         f"{optimizer.__name__} runs with ({[f.name for f in supported]})")
    named = tuple(named) if variants else ()
    derived = family(optimizer, algorithm.class_name, named) if variants else {}
    new = Family(algorithm, optimizer, {algorithm.class_name: optimizer, **derived}, named)
    taken = {name: f.algorithm.name for f in _FAMILIES.values() for name in f.trainer_names}
    for name in new.trainer_names:
        if name in taken:
            raise ValueError(f"optim name {name!r} of {algorithm.name!r} is already {taken[name]!r}'s")
        new.class_for(*parse_name(name, mapping(algorithm).formats))  # a name without a class fails here
    _FAMILIES[algorithm.name] = new
    home = sys.modules.get(optimizer.__module__)
    for class_name, cls in derived.items():  # the twins live in their base's module, where pickle looks for them
        if home is not None and not hasattr(home, class_name):
            setattr(home, class_name, cls)
    for listener in list(_LISTENERS):
        listener(new)
    return new


def lookup_algorithm(name: str) -> Family:
    """The registered algorithm ``name``; an unknown name raises with the closest registered ones."""
    try:
        return _FAMILIES[name]
    except KeyError:
        close = difflib.get_close_matches(str(name), list(_FAMILIES), n=3, cutoff=0.6)
        hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise UnknownAlgorithmError(
            f"no algorithm named {name!r} is registered.{hint} Registered: {', '.join(sorted(_FAMILIES))}"
        ) from None


def families() -> tuple[Family, ...]:
    """Every registered algorithm, in registration order."""
    return tuple(_FAMILIES.values())


def on_register(listener: Callable[[Family], None]) -> None:
    """Call ``listener(family)`` for every algorithm registered from now on."""
    _LISTENERS.append(listener)


def _caller_module() -> str:
    frame = inspect.currentframe()
    try:
        caller = frame.f_back.f_back  # register_algorithm's caller
        return caller.f_globals.get("__name__", __name__)
    finally:
        del frame


def _generated_class(algorithm: Algorithm, defaults: dict, check, module: str) -> type:
    """An :class:`HfOptimizer` subclass for ``algorithm`` whose constructor takes ``defaults``' hyperparameters and
    the common options (:mod:`hf_optim.optim.options`)."""
    reserved = {"params", *common_options.BY_NAME} & set(defaults)
    if reserved:
        raise ValueError(f"defaults of {algorithm.name!r} may not set {sorted(reserved)}: every class takes them")
    keyword = inspect.Parameter.POSITIONAL_OR_KEYWORD
    own = inspect.Signature(
        [inspect.Parameter("self", keyword), inspect.Parameter("params", keyword)]
        + [inspect.Parameter(name, keyword, default=value) for name, value in defaults.items()]
        + [inspect.Parameter("options", inspect.Parameter.VAR_KEYWORD)]
    )

    def __init__(self, params, **values) -> None:
        hyper = {name: values.pop(name, default) for name, default in defaults.items()}
        hyper = {name: as_tuple(value) if isinstance(value, list) else value for name, value in hyper.items()}
        HfOptimizer.__init__(self, params, hyper, **values)

    def validate_group(self, group: dict) -> None:
        HfOptimizer.validate_group(self, group)
        check_lr(group["lr"])
        if check is not None:
            check(group)

    __init__.__signature__ = own
    described = ", ".join(f"{name}={value!r}" for name, value in defaults.items())
    doc = (f"The {algorithm.name!r} algorithm ({described}), registered with ``hf_optim.register_algorithm``; "
           "every state format (``state_format``), optionally paged, optionally with bf16 stochastic rounding.")
    return type(algorithm.class_name, (HfOptimizer,), {
        "definition": algorithm, "__init__": __init__, "validate_group": validate_group, "__doc__": doc,
        "__module__": module,
    })
