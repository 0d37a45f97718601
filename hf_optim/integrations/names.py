"""The optimizer names hf_optim answers to in ``TrainingArguments(optim=...)``, and what each one builds.

Two kinds of name:

* names transformers already has and sends to bitsandbytes (``paged_adamw_8bit``, ...) plus ``adafactor``:
  hf_optim *takes them over*, so the same command line runs hf_optim's class (see ``takeover`` in
  :mod:`hf_optim.integrations.transformers` to keep bitsandbytes for them);
* names transformers does not have (``lamb_8bit``, ...): hf_optim adds them.

Precision and paging follow the name exactly as transformers reads it: ``8bit`` in the name means 8-bit state,
otherwise 32-bit (so ``ademamix`` and ``rmsprop_bnb`` are 32-bit, as in transformers); ``paged_`` means paged.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from hf_optim.optim import adafactor, adamw, ademamix, lamb, lion, rmsprop


@dataclass(frozen=True)
class OptimizerName:
    """One ``optim=`` name: the class it builds and how that class is configured."""

    name: str
    cls: type
    family: str  # adamw | ademamix | lamb | lion | rmsprop | adafactor
    optim_bits: int
    paged: bool
    takes_over: bool  # True: a transformers name hf_optim takes over; False: a name hf_optim adds

    @property
    def precision(self) -> str:
        return "8-bit blockwise" if self.optim_bits == 8 else "32-bit"

    def describe(self, backend: str | None = None) -> str:
        """``hf_optim.PagedAdamW8bit (8-bit blockwise, paged, backend=...)``."""
        details = [self.precision] + (["paged"] if self.paged else []) + ([f"backend={backend}"] if backend else [])
        return f"hf_optim.{self.cls.__name__} ({', '.join(details)})"


def _entry(name: str, cls: type, family: str, takes_over: bool) -> OptimizerName:
    bits = 8 if "8bit" in name else 32
    return OptimizerName(name, cls, family, bits, name.startswith("paged_"), takes_over)


_TAKEN_OVER = [
    ("adamw_bnb_8bit", adamw.AdamW8bit, "adamw"),
    ("adamw_8bit", adamw.AdamW8bit, "adamw"),
    ("paged_adamw_8bit", adamw.PagedAdamW8bit, "adamw"),
    ("paged_adamw_32bit", adamw.PagedAdamW32bit, "adamw"),
    ("ademamix", ademamix.AdEMAMix32bit, "ademamix"),
    ("ademamix_8bit", ademamix.AdEMAMix8bit, "ademamix"),
    ("paged_ademamix_8bit", ademamix.PagedAdEMAMix8bit, "ademamix"),
    ("paged_ademamix_32bit", ademamix.PagedAdEMAMix32bit, "ademamix"),
    ("lion_8bit", lion.Lion8bit, "lion"),
    ("lion_32bit", lion.Lion32bit, "lion"),
    ("paged_lion_8bit", lion.PagedLion8bit, "lion"),
    ("paged_lion_32bit", lion.PagedLion32bit, "lion"),
    ("rmsprop_bnb", rmsprop.RMSprop32bit, "rmsprop"),
    ("rmsprop_bnb_8bit", rmsprop.RMSprop8bit, "rmsprop"),
    ("rmsprop_bnb_32bit", rmsprop.RMSprop32bit, "rmsprop"),
    ("adafactor", adafactor.Adafactor, "adafactor"),
]

_ADDED = [
    ("adamw_32bit", adamw.AdamW32bit, "adamw"),
    ("ademamix_32bit", ademamix.AdEMAMix32bit, "ademamix"),
    ("lamb", lamb.LAMB32bit, "lamb"),
    ("lamb_32bit", lamb.LAMB32bit, "lamb"),
    ("lamb_8bit", lamb.LAMB8bit, "lamb"),
    ("paged_lamb_8bit", lamb.PagedLAMB8bit, "lamb"),
    ("paged_lamb_32bit", lamb.PagedLAMB32bit, "lamb"),
    ("rmsprop_8bit", rmsprop.RMSprop8bit, "rmsprop"),
    ("adafactor_8bit", adafactor.Adafactor, "adafactor"),
]

OPTIMIZER_NAMES: dict[str, OptimizerName] = {
    **{name: _entry(name, cls, family, True) for name, cls, family in _TAKEN_OVER},
    **{name: _entry(name, cls, family, False) for name, cls, family in _ADDED},
}


def available_optimizers() -> list[OptimizerName]:
    """Every ``optim=`` name hf_optim answers to, with its class, precision and paging."""
    return list(OPTIMIZER_NAMES.values())


def suggest(name: str, candidates: list[str], count: int = 3) -> list[str]:
    """The closest valid names to a misspelled one, best first."""
    return difflib.get_close_matches(str(name), candidates, n=count, cutoff=0.6)
