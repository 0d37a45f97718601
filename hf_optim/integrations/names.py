"""The optimizer names hf_optim answers to in ``TrainingArguments(optim=...)``, and what each one builds.

Two kinds of name:

* names transformers already has and sends to bitsandbytes (``paged_adamw_8bit``, ...) plus ``adafactor``:
  hf_optim *takes them over*, so the same command line runs hf_optim's class (see ``takeover`` in
  :mod:`hf_optim.integrations.transformers` to keep bitsandbytes for them);
* names transformers does not have (``lamb_8bit``, ...): hf_optim adds them.

Each algorithm's description lists its names (``Algorithm.trainer``), completed from the formats it has classes of
(:mod:`hf_optim.optim.trainer_mapping`); this module reads them from the registry
(:mod:`hf_optim.optim.registry`), including algorithms registered later with ``hf_optim.register_algorithm``.

State format and paging follow the name as transformers reads it: a name ending in ``_8bit`` means 8-bit
blockwise state (``_4bit``: 4-bit blockwise; each format declares its suffix), otherwise fp32 (so ``ademamix`` and
``rmsprop_bnb`` are 32-bit, as in transformers); ``paged_`` means paged.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from hf_optim.core.algorithm import Algorithm
from hf_optim.errors import suggest  # noqa: F401  (re-exported: the did-you-mean of every name here)
from hf_optim.formats import StateFormat
from hf_optim.optim import adafactor, adamw, ademamix, lamb, lion, registry, rmsprop  # noqa: F401  (importing registers; muon via hf_optim/__init__.py)
from hf_optim.optim.trainer_mapping import mapping, parse_name


@dataclass(frozen=True)
class OptimizerName:
    """One ``optim=`` name: the class it builds and how that class is configured."""

    name: str
    cls: type
    family: str  # the algorithm's registered name: adamw | ademamix | lamb | lion | rmsprop | adafactor | ...
    state_format: StateFormat
    paged: bool
    takes_over: bool  # True: a transformers name hf_optim takes over; False: a name hf_optim adds

    @property
    def algorithm(self) -> Algorithm:
        """The algorithm's description (its state slots, Trainer mapping, ...)."""
        return registry.lookup_algorithm(self.family).algorithm

    @property
    def optim_bits(self) -> int:
        """bitsandbytes' ``optim_bits`` of the state format (its bits per element when it has no alias)."""
        return self.state_format.group_bits

    @property
    def precision(self) -> str:
        return self.state_format.label

    @property
    def class_label(self) -> str:
        """``hf_optim.PagedAdamW8bit`` for hf_optim's classes, ``module.Class`` for registered ones."""
        module = self.cls.__module__
        return f"hf_optim.{self.cls.__name__}" if module.startswith("hf_optim.") else f"{module}.{self.cls.__name__}"

    def describe(self, backend: str | None = None) -> str:
        """``hf_optim.PagedAdamW8bit (8-bit blockwise, paged, backend=...)``."""
        details = [self.precision] + (["paged"] if self.paged else []) + ([f"backend={backend}"] if backend else [])
        return f"{self.class_label} ({', '.join(details)})"

    @property
    def origin(self) -> str:
        return "transformers name, taken over" if self.takes_over else "added by hf_optim"

    def __repr__(self) -> str:  # one short line: the dataclass repr spells out the class object and every field
        return f"<OptimizerName {self.name!r} -> {self.describe()}>"


class OptimizerNames(list):
    """The list :func:`available_optimizers` returns: a plain list of :class:`OptimizerName`, shown as a table."""

    HEADER = ("name", "class", "state", "paged", "origin")

    def rows(self) -> list[tuple[str, str, str, str, str]]:
        """One row per name, as :attr:`HEADER` names the columns."""
        return [(e.name, e.class_label, e.precision, "yes" if e.paged else "no", e.origin) for e in self]

    def table(self) -> str:
        """The names as aligned plain-text columns, a header first."""
        rows = [self.HEADER, *self.rows()]
        widths = [max(len(row[i]) for row in rows) for i in range(len(self.HEADER))]
        return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)

    def __repr__(self) -> str:
        return self.table()

    __str__ = __repr__


def _entries() -> dict[str, OptimizerName]:
    """Every registered algorithm's names: the names transformers has first (as transformers lists them), then
    the names hf_optim adds."""
    taken, added = {}, {}
    for family in registry.families():
        algorithm = family.algorithm
        for name in family.trainer_names:
            fmt, paged = parse_name(name, mapping(algorithm).formats)
            takes_over = name in mapping(algorithm).takes_over
            entry = OptimizerName(name, family.class_for(fmt, paged), algorithm.name, fmt, paged, takes_over)
            (taken if takes_over else added)[name] = entry
    return {**taken, **added}


class _Names(Mapping):
    """``{name: OptimizerName}`` of every registered algorithm, kept up to date as algorithms are registered."""

    def __init__(self) -> None:
        self._table: dict[str, OptimizerName] | None = None
        registry.on_register(lambda family: self._forget())

    def _forget(self) -> None:
        self._table = None

    @property
    def table(self) -> dict[str, OptimizerName]:
        if self._table is None:
            self._table = _entries()
        return self._table

    def __getitem__(self, name: str) -> OptimizerName:
        return self.table[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.table)

    def __len__(self) -> int:
        return len(self.table)


OPTIMIZER_NAMES: Mapping[str, OptimizerName] = _Names()


def available_optimizers() -> OptimizerNames:
    """Every ``optim=`` name hf_optim answers to, with its class, precision and paging: a list of
    :class:`OptimizerName` that prints as a table (``print(hf_optim.available_optimizers())``)."""
    return OptimizerNames(OPTIMIZER_NAMES.values())
