"""Hybrid optimizers as a description: parameters partitioned into labelled rules (optax's ``combine.partition``).

Muon is one: hidden matrices take Muon's rule, every other parameter AdamW's, in one optimizer with one state format.
Everything that differs between the parts is read from the :class:`Partition`: which rule a parameter takes, the
slots its state holds, the scalars each rule reads from the param group, how the Trainer integration marks a
model's parameters, and how the memory estimate prices each tensor. Nothing outside the algorithm's own folder names
the algorithm.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


class MarkSummary(Protocol):
    """What :attr:`Partition.mark_model` returns: how it split a model."""

    def describe(self) -> str:
        """One line for the log, e.g. ``Muon: 112 tensors (...); AdamW: 33 tensors (...)``."""

    def warning(self) -> str | None:
        """A reason to warn the user about this split (e.g. no tensor takes the main rule), or None."""


@dataclass(frozen=True)
class PartRule:
    """One labelled rule of a partition.

    Args:
        label: the rule's name, e.g. ``"muon"`` or ``"adamw"``; :attr:`Partition.label_of` returns it.
        algorithm: the rule's description (an :class:`hf_optim.core.algorithm.Algorithm`: its slots,
            elementwise rule, scalars, Triton twin, own update); None: the partitioned algorithm's own.
        settings: ``settings(group) -> dict``: the hyperparameters this rule reads, from its param group (Muon's
            AdamW side reads ``adamw_betas`` as ``betas``); None: the group as it is.
        title: the rule's name in messages (``"Muon"``); default the label.
    """

    label: str
    algorithm: Any = None
    settings: Callable[[dict], dict] | None = None
    title: str = ""


@dataclass(frozen=True)
class Partition:
    """How a hybrid algorithm splits its parameters.

    Args:
        rules: the labelled rules; their slot sets must differ (a loaded state is matched to a rule by its slots).
        label_of: ``label_of(param, group) -> label``: the rule of parameter ``param`` (it may read the mark
            :attr:`mark_attr` on it) in param group ``group`` (overrides applied).
        mark_attr: the parameter attribute :attr:`mark_model` sets; the optimizer records it by position, so a
            parameter that replaces a marked one in place (accelerate's FSDP2 preparation) keeps the mark.
        mark_model: ``mark_model(model, kwargs) -> MarkSummary``: mark every trainable parameter of ``model`` with
            its route (the Trainer integration calls it with the optimizer's constructor ``kwargs``).
        label_for_mark: ``label_for_mark(mark, ndim, kwargs) -> label``: the rule a tensor marked ``mark`` (None:
            unmarked) with ``ndim`` dimensions takes in a Trainer-built optimizer (what the memory estimate prices).
        setting: the param-group key that chooses a group's rule (Muon's ``use_muon``), for messages.
    """

    rules: tuple[PartRule, ...]
    label_of: Callable[[Any, dict], str]
    mark_attr: str
    mark_model: Callable[[Any, dict], MarkSummary]
    label_for_mark: Callable[[str | None, int, dict], str]
    setting: str = ""

    def __post_init__(self) -> None:
        labels = [rule.label for rule in self.rules]
        if len(set(labels)) != len(labels) or not labels:
            raise ValueError(f"a partition needs distinct rule labels, got {labels}")

    def rule(self, label: str) -> PartRule:
        for rule in self.rules:
            if rule.label == label:
                return rule
        raise ValueError(f"no rule labelled {label!r} in this partition (labels: {[r.label for r in self.rules]})")
