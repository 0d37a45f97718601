"""The options every hf_optim optimizer takes, declared once: name, default, check, documentation, and where the
value lives (a param-group key, or an attribute of the optimizer).

An algorithm class writes only its own arguments and ends its signature with ``**options``; when the class is
created (:meth:`hf_optim.optim.base.HfOptimizer.__init_subclass__`) :func:`with_common_options` replaces
``**options`` by these arguments, placed where bitsandbytes puts them (the class's ``bitsandbytes_order``: the
tail of bitsandbytes' signature from ``optim_bits`` on, naming the class's own arguments that sit between them),
and appends their documentation to the class docstring. A new common option is one entry of :data:`OPTIONS` (and
the base class's use of it).
"""

from __future__ import annotations

import difflib
import functools
import inspect
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hf_optim.formats import FORMATS, StateFormat, format_for_bits, format_named, settings_format
from hf_optim.optim._validation import check_min_8bit_size, check_optim_bits, check_stochastic_round
from hf_optim.optim.release import check_release_gradients


@dataclass(frozen=True)
class Option:
    """One common constructor argument.

    Args:
        name: the keyword.
        default: its default (bitsandbytes' where bitsandbytes has the argument).
        kind: its type as the docstring shows it.
        doc: one sentence or more for the docstring.
        check: ``check(value) -> value`` raising a clear error for a bad value (None: any value).
        group: whether the value is a param-group key (per group, saved in state dicts) rather than an attribute
            of the optimizer.
        paging: offered only by classes that page (``HfOptimizer.pages``).
    """

    name: str
    default: Any
    kind: str
    doc: str
    check: Callable[[Any], Any] | None = None
    group: bool = True
    paging: bool = False

    def parameter(self) -> inspect.Parameter:
        return inspect.Parameter(self.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=self.default)

    def describe(self, indent: str = "        ") -> str:
        """The docstring entry, wrapped at 120 columns (continuation lines indented once more)."""
        return textwrap.fill(f"{self.name} ({self.kind}, default {self.default!r}): {self.doc}", 120,
                             initial_indent=indent, subsequent_indent=indent + "    ")


def _check_bool(name: str) -> Callable[[Any], bool]:
    def check(value) -> bool:
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
        return value

    return check


def _check_stochastic_round(value) -> bool:
    check_stochastic_round(value, 0)
    return value


OPTIONS: tuple[Option, ...] = (
    Option("optim_bits", 32, "int",
           "bitsandbytes' name for the state format: 32 is ``state_format='fp32'``, 8 ``'blockwise8'``, 4 "
           "``'stochastic4'`` (hf_optim's 4-bit state; bitsandbytes has none); a format without such a number (see "
           "``hf_optim.available_state_formats()``) is only chosen with ``state_format``."),
    Option("min_8bit_size", 4096, "int", "tensors with fewer elements keep fp32 state in a quantized format.",
           check_min_8bit_size),
    Option("is_paged", False, "bool", "paged state (see ``hf_optim.paging``).", _check_bool("is_paged"),
           group=False, paging=True),
    Option("bf16_stochastic_round", False, "bool",
           "round the fp32 result into bfloat16 parameters stochastically instead of to nearest, so updates below "
           "bf16's resolution are kept in expectation (deterministic per seed, step and element; fp32 parameters "
           "are unaffected, float16 ones raise).", _check_stochastic_round),
    Option("release_gradients", False, "bool",
           "step each parameter in a hook as soon as backward produces its gradient and free the gradient at once "
           "(see ``hf_optim.optim.release``); ``step()`` must still be called after every backward, and gradients "
           "cannot accumulate over several backward passes.", check_release_gradients, group=False),
    Option("state_format", None, "str | None",
           "how the state is stored, by name: ``'fp32'``, ``'blockwise8'`` (bitsandbytes' 8-bit format), "
           "``'stochastic4'`` (4-bit, rounded stochastically: the accurate 4-bit state), ``'blockwise4'`` (torchao's "
           "4-bit format), or any registered format (see "
           "``hf_optim.available_state_formats()``). None: the one ``optim_bits`` names. Given together with "
           "``optim_bits``, the two must agree.", group=False),
)
"""Every common option, in the order they follow a class's own arguments (bitsandbytes' ones are placed by
``bitsandbytes_order`` first)."""

BY_NAME: Mapping[str, Option] = {option.name: option for option in OPTIONS}


def offered(cls: type) -> tuple[Option, ...]:
    """The common options ``cls`` takes (``is_paged`` only where it pages)."""
    return tuple(option for option in OPTIONS if getattr(cls, "pages", True) or not option.paging)


def chosen_format(given: Mapping[str, Any], who: str, supported: tuple[StateFormat, ...]) -> StateFormat:
    """The format the given ``state_format`` (a registered name) or else ``optim_bits`` (bitsandbytes' alias, default
    32) selects. Both given and disagreeing, or a format ``who`` does not run with, is a ValueError naming them."""
    name, bits = given.get("state_format"), given.get("optim_bits")
    if name is None:
        aliases = tuple(f.optim_bits for f in supported if f.optim_bits is not None)
        fmt = format_for_bits(check_optim_bits(BY_NAME["optim_bits"].default if bits is None else bits, aliases, who))
    else:
        fmt = format_named(name)
        if bits is not None and bits != fmt.optim_bits:
            alias = f"optim_bits={fmt.optim_bits!r}" if fmt.optim_bits is not None else "no optim_bits value"
            raise ValueError(f"{who}: state_format={name!r} and optim_bits={bits!r} disagree ({name!r} is "
                             f"{alias}); pass only state_format")
    if fmt not in supported:
        names = ", ".join(repr(f.name) for f in supported)
        raise ValueError(f"Invalid state_format: {fmt.name!r}; {who} runs with {names}")
    return fmt


def resolve(cls: type, given: Mapping[str, Any], supported: tuple[StateFormat, ...]) -> dict[str, Any]:
    """Every option ``cls`` offers, from ``given`` (the keywords passed) or its default, checked; ``state_format``
    becomes the chosen :class:`StateFormat` and ``optim_bits`` its alias (``group_bits``)."""
    options = {option.name: option for option in offered(cls)}
    unknown = [key for key in given if key not in options]
    if unknown:
        close = difflib.get_close_matches(unknown[0], list(options), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise TypeError(f"{cls.__name__} got an unexpected option {unknown[0]!r}{hint}")
    values = {name: given.get(name, option.default) for name, option in options.items()}
    for name, option in options.items():
        if option.check is not None:
            values[name] = option.check(values[name])
    fmt = chosen_format(given, cls.__name__, supported)
    values["state_format"], values["optim_bits"] = fmt, fmt.group_bits
    return values


def check_group_format(group: Mapping[str, Any], supported: tuple[StateFormat, ...], who: str) -> StateFormat:
    """The format a param group asks for (:func:`~hf_optim.formats.settings_format`), checked to be one
    ``who`` runs with; a bad ``optim_bits`` is named as such."""
    named = FORMATS.get(group.get("state_format"))
    if named is None or group.get("optim_bits") != named.group_bits:  # optim_bits set apart: it decides
        check_optim_bits(group.get("optim_bits"), tuple(f.optim_bits for f in supported if f.optim_bits), who)
    fmt = settings_format(group)
    if fmt not in supported:
        raise ValueError(f"Invalid state_format: {fmt.name!r}; {who} runs with "
                         f"{', '.join(repr(f.name) for f in supported)}")
    return fmt


def group_entries(values: Mapping[str, Any]) -> dict[str, Any]:
    """The param-group keys of resolved ``values`` (``state_format`` as its name)."""
    entries = {name: values[name] for name, option in BY_NAME.items() if option.group and name in values}
    entries["state_format"] = values["state_format"].name
    return entries


def full_signature(cls: type, own: inspect.Signature, order: tuple[str, ...]) -> inspect.Signature:
    """``own`` (ending in ``**options``) with the options ``cls`` offers in place of ``**options``: own arguments up
    to the first name of ``order``, then ``order`` (common options and own arguments, bitsandbytes' order), then
    the remaining own arguments, then the remaining common options."""
    mine = {name: p for name, p in own.parameters.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}
    common = {option.name: option.parameter() for option in offered(cls)}
    order = tuple(name for name in order if name in common or name in mine)
    placed = set(order)
    names = list(mine)
    anchor = next((names.index(name) for name in order if name in mine), len(names))
    head = [mine[name] for name in names[:anchor] if name not in placed]
    tail = [mine[name] for name in names[anchor:] if name not in placed]
    middle = [common[name] if name in common else mine[name] for name in order]
    rest = [p for name, p in common.items() if name not in placed]
    return own.replace(parameters=[*head, *middle, *tail, *rest])


def with_common_options(cls: type) -> None:
    """Give ``cls`` (whose ``__init__`` ends in ``**options``) the common options in its signature and docstring."""
    own_init = cls.__dict__["__init__"]
    own = inspect.signature(own_init)
    signature = full_signature(cls, own, getattr(cls, "bitsandbytes_order", ()))
    own_names = [name for name, p in own.parameters.items() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    common = {option.name for option in offered(cls)}
    valid = [name for name in signature.parameters][2:]

    @functools.wraps(own_init)
    def __init__(self, *args, **kwargs):
        try:
            arguments = signature.bind(self, *args, **kwargs).arguments
        except TypeError as error:  # name the class the user called, and the closest argument
            unknown = [key for key in kwargs if key not in signature.parameters]
            close = difflib.get_close_matches(unknown[0], valid, n=1) if unknown else []
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"{type(self).__name__}.__init__() {error}{hint}") from None
        mine = {name: value for name, value in arguments.items() if name in own_names}
        options = {name: value for name, value in arguments.items() if name in common}
        own_init(**mine, **options)

    __init__.__signature__ = signature
    del __init__.__wrapped__  # inspect.signature must read __signature__, not the wrapped ``**options`` form
    cls.__init__ = __init__
    cls.__doc__ = (cls.__doc__ or "").rstrip() + "\n\n" + options_doc(cls)


def options_doc(cls: type) -> str:
    """The docstring section of the common options ``cls`` takes."""
    lines = ["    Common options (every hf_optim optimizer; :mod:`hf_optim.optim.options`):"]
    for option in offered(cls):
        lines.append(option.describe())
    return "\n".join(lines) + "\n"
