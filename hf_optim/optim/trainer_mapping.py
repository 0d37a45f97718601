"""How the Trainer names and configures an algorithm: its ``optim=`` names, their grammar, and how
``TrainingArguments`` become constructor keyword arguments.

The grammar is transformers' own, generalised to the format registry: a ``paged_`` prefix means paged state, a name
ending in ``_<suffix>`` for a format's :attr:`~hf_optim.formats.StateFormat.optim_suffix` means that format
(``adamw_8bit``, ``paged_lion_4bit``, ``adamw_bnb_8bit``), anything else fp32 (``ademamix``, ``rmsprop_bnb``).
An algorithm's names are the ones its :class:`TrainerMapping` lists (transformers' spellings) plus
``<name>_<suffix>`` and ``paged_<name>_<suffix>`` for every format it has classes of that no listed name covers,
so a newly registered format gets its names without touching any algorithm.

It lives beside the registry, which checks every name when an algorithm registers (a name without a class fails
there, not in the Trainer); :mod:`hf_optim.integrations` reads it. The kernels layer, which describes algorithms,
holds an algorithm's mapping without reading it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hf_optim.core.algorithm import Algorithm
from hf_optim.formats import FORMATS, FP32, StateFormat

TrainerAdjust = Callable[[dict, Any, list, dict, StateFormat], None]
"""``adjust(kwargs, args, betas, optim_args, state_format)``: a last change to the constructor kwargs (in place);
``state_format`` is the format the ``optim=`` name selects."""


@dataclass(frozen=True)
class TrainerMapping:
    """The ``optim=`` names of an algorithm and how ``TrainingArguments`` become constructor kwargs.

    Every name gets ``lr=args.learning_rate`` (weight decay comes through the Trainer's param groups), then:

    Args:
        names: the ``optim=`` names with their own spellings (transformers' ``adamw_bnb_8bit``, ``ademamix``);
            each name's format and paging are read from it (see the module docstring). Names
            ``<name>_<suffix>`` / ``paged_<name>_<suffix>`` are added for the formats with classes that no listed
            name covers. None: ``<name>`` (fp32) and the added names.
        takes_over: those of ``names`` that transformers already has (sent to bitsandbytes there): hf_optim builds
            them only while its takeover is on.
        betas: per entry of the constructor's ``betas``, its default: a ``TrainingArguments`` attribute name
            (``"adam_beta1"``) or a number. ``optim_args`` keys ``beta1``, ``beta2``, ... override entries.
            Empty: the Trainer passes no ``betas``.
        eps: pass ``eps=args.adam_epsilon``.
        fixed: constant kwargs (AdEMAMix's ``alpha=5.0``, as transformers passes).
        adjust: an algorithm-specific last step (see :data:`TrainerAdjust`); ``optim_args`` are applied after it.
        formats: names (of ``names``) whose format is not the one their suffix says, by format name: another
            library's spelling that means a format of its own (``adamw_torch_4bit``, torchao's 4-bit AdamW, is
            ``blockwise4``, torchao's format, where ``_4bit`` alone is the default 4-bit format).
    """

    names: tuple[str, ...] | None = None
    takes_over: tuple[str, ...] = ()
    betas: tuple[str | float, ...] = ()
    eps: bool = False
    fixed: Mapping[str, Any] = field(default_factory=dict)
    adjust: TrainerAdjust | None = None
    formats: Mapping[str, str] = field(default_factory=dict)

    def kwargs(self, args: Any, betas: list, optim_args: dict, state_format: StateFormat) -> dict[str, Any]:
        """Constructor kwargs from ``args`` (``TrainingArguments``), the ``optim_args`` betas (None where not given)
        and the other typed ``optim_args``, which win over everything else."""
        kwargs: dict[str, Any] = {"lr": args.learning_rate}
        given = [f"beta{i + 1}" for i, beta in enumerate(betas) if beta is not None]
        if given and not self.betas and self.adjust is None:
            raise ValueError(f"optim_args {', '.join(given)}: this optimizer name maps no betas from the Trainer; "
                             "pass them all as betas=b1;b2")
        if self.betas:
            defaults = [getattr(args, d) if isinstance(d, str) else d for d in self.betas]
            kwargs["betas"] = tuple(d if b is None else b for d, b in zip(defaults, [*betas, *[None] * len(defaults)]))
        if self.eps:
            kwargs["eps"] = args.adam_epsilon
        kwargs.update(self.fixed)
        if self.adjust is not None:
            self.adjust(kwargs, args, betas, optim_args, state_format)
        kwargs.update(optim_args)
        return kwargs


DEFAULT_MAPPING = TrainerMapping()


def mapping(algorithm: Algorithm) -> TrainerMapping:
    """``algorithm``'s Trainer mapping (the default one when it declares none)."""
    return DEFAULT_MAPPING if algorithm.trainer is None else algorithm.trainer


def parse_name(name: str, named: Mapping[str, str] | None = None) -> tuple[StateFormat, bool]:
    """(state format, paged) of an ``optim=`` name (see the module docstring); ``named``: an algorithm's names
    whose format is set by name (:attr:`TrainerMapping.formats`)."""
    if named and name in named:
        return FORMATS[named[name]], name.startswith("paged_")
    # the longest matching suffix: adamw_4bit_blockwise is blockwise4's, not a format ending in _blockwise
    matching = [f for f in FORMATS.values() if name.endswith(f"_{f.optim_suffix}")]
    fmt = max(matching, key=lambda f: len(f.optim_suffix), default=FP32)
    return fmt, name.startswith("paged_")


def trainer_names(algorithm: Algorithm, formats: list[StateFormat], pages: bool) -> tuple[str, ...]:
    """The ``optim=`` names of ``algorithm``, whose classes have ``formats`` (and page when ``pages``)."""
    listed = mapping(algorithm).names
    names = [algorithm.name] if listed is None else list(listed)
    named = mapping(algorithm).formats
    covered = set() if listed is None else {parse_name(name, named) for name in names}  # the bare default name adds
    for paged in (False, True) if pages else (False,):
        for fmt in formats:
            if (fmt, paged) not in covered:
                names.append(f"{'paged_' if paged else ''}{algorithm.name}_{fmt.optim_suffix}")
    return tuple(names)
