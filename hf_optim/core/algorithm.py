"""An optimizer algorithm as one registered description: everything the rest of hf_optim needs to know about it.

An :class:`Algorithm` names the algorithm and holds its state slots, its PyTorch rule, its optional Triton twin, its
scalars (a ``NamedTuple`` class, ``hyper``, whose field order is the Triton rule's argument order, and the host
function ``hyper_at(group, step)`` that computes them), how it steps on Triton (:class:`TritonPlan`), which state
formats get named classes, and how many bytes its state takes (from the slots). It also carries the algorithm's
Trainer mapping (``trainer``), which only :mod:`hf_optim.optim.trainer_mapping` reads. Every module that used
to switch on algorithm names reads the description.

This module sits in the lowest layer (``hf_optim.kernels``): the kernels read descriptions, the optimizer classes
(``hf_optim.optim``) are built from them, and nothing here imports torch's optimizers, triton, or a higher layer.
A Triton rule or plan may be given as the object itself or as ``"module:attribute"``, imported when a Triton step
first needs it (so describing an algorithm never imports triton); a relative module (``".triton_rule:adamw"``) is
found in the package of the module that created the description (:attr:`Algorithm.package`).

:func:`hf_optim.optim.registry.register_algorithm` registers a description, builds its optimizer classes and adds
its Trainer names.
"""

from __future__ import annotations

import importlib
import math
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from hf_optim.core.own_update import OwnUpdate
from hf_optim.core.partition import Partition
from hf_optim.core.state_store import StateSpec, slot_bytes
from hf_optim.formats import FP32, StateFormat
from hf_optim.formats.base import BITSANDBYTES_FORMATS

ELEMENTWISE = "elementwise"
"""The Triton plan of an elementwise algorithm: its Triton rule runs in the shared fused multi-tensor kernel."""


def fp32(value: float) -> float:
    """``value`` rounded to fp32 (as a Python float, exactly representable in fp32)."""
    return struct.unpack("f", struct.pack("f", value))[0]


def fp32_reciprocal(value: float) -> float:
    """The fp32 reciprocal of ``value`` as torch computes it when it divides a tensor by a Python scalar on CUDA and
    XPU (the devices Triton runs on): ``a * (1.0f / float(b))``. A Triton rule multiplies by this where its PyTorch
    twin divides. Done in double and rounded once to fp32, which equals the fp32 IEEE division. (torch's CPU
    kernels divide instead; the two differ by at most an ulp in that intermediate.)"""
    return fp32(1.0 / fp32(float(value)))


def kernel_scalars(hyper: tuple) -> tuple:
    """``hyper`` with every value a Python float, in its own class: what a Triton kernel receives (an int would make
    Triton specialize and recompile on its value; a float arrives as fp32, exactly as torch converts a scalar)."""
    return type(hyper)(*(float(value) for value in hyper))


def resolve(ref: Any, package: str | None = None) -> Any:
    """``ref`` itself, or the object a ``"module:attribute"`` string names (imported now); a relative module
    (``".triton_rule:adamw"``) is looked up in ``package``."""
    if not isinstance(ref, str):
        return ref
    module, sep, attribute = ref.partition(":")
    if not sep or not module or not attribute:
        raise ValueError(f"{ref!r} is not a 'module:attribute' reference"
                         " (e.g. '.triton_rule:adamw', beside the description, or 'my_package.triton_rule:adamw')")
    if module.startswith(".") and not package:
        raise ValueError(f"{ref!r} is relative, but no package is known to resolve it in")
    return getattr(importlib.import_module(module, package), attribute)


@dataclass(frozen=True)
class TritonPlan:
    """How an algorithm steps on Triton.

    Args:
        step: :data:`ELEMENTWISE` (one launch of the shared fused kernel with the algorithm's Triton rule), or a
            function (or ``"module:function"``) ``step(algorithm, group, key, batch, step, hyper, cache,
            device, stochastic)`` running its own passes over ``batch`` = ``[(param, grad, state), ...]`` (LAMB's
            trust ratio, Adafactor's factored statistics); ``stochastic``: bf16 stochastic rounding's
            ``(ordinals, key)`` or None.
        shards: whether a shard of a sharded (DTensor) parameter can step alone; False for algorithms that
            reduce over the whole tensor (norms, statistics), whose shards take the PyTorch path.
        empty: whether a tensor with no elements can step on Triton.
        specs: for a ``step`` of its own, the kernels its passes launch, for ahead-of-time compilation: a function
            (or ``"module:function"``) ``specs(algorithm, formats, fused)`` returning
            ``hf_optim.kernels.triton_path.configs.LaunchSpec``s, where ``fused`` are the algorithm's fused-kernel
            configurations (LAMB's direction pass); None: the shared fused kernel is all it launches.
    """

    step: str | Callable = ELEMENTWISE
    shards: bool = True
    empty: bool = True
    specs: str | Callable | None = None

    @property
    def elementwise(self) -> bool:
        return isinstance(self.step, str) and self.step == ELEMENTWISE


@dataclass(frozen=True, eq=False)  # a registered description is compared (and hashed) by identity
class Algorithm:
    """One optimizer algorithm (see the module docstring).

    Args:
        name: the registry key, recorded in saved state dicts (``hf_optim_algorithm``); lower case, e.g. ``"adamw"``.
        class_name: the base class's name (``"AdamW"``); the variants are ``<class_name><suffix>`` per format of
            ``variant_formats`` (``AdamW8bit``: :attr:`StateFormat.class_suffix`), ``Paged<class_name>`` and
            ``Paged<class_name><suffix>``.
        slots: the per-element state slots (bitsandbytes' ``state1``/``state2`` names; signedness picks the 8-bit
            map; ``rows`` stacks several states in one slot).
        hyper: a ``NamedTuple`` class of the scalars both rules read, by name; its field order is the order in
            which they reach the Triton kernel.
        hyper_at: ``hyper_at(group, step) -> hyper`` on the host (double precision; bias corrections, schedules).
        rule: the PyTorch rule ``rule(param, grad, states, h) -> (out, new_states)`` on fp32 tensors (see
            :mod:`hf_optim.kernels.torch_path.elementwise`), or None for an algorithm with its own update (Adafactor).
        triton_rule: the ``@triton.jit`` twin ``rule(p, g, s0, s1, s2, h) -> (out, s0, s1, s2)`` (or
            ``"module:name"``), or None: the algorithm then always takes the PyTorch path.
        triton_plan: how it steps on Triton (:class:`TritonPlan`).
        trainer: its ``optim=`` names and the Trainer's argument mapping
            (:class:`hf_optim.optim.trainer_mapping.TrainerMapping`; None: the default mapping).
        state_bytes: ``state_bytes(shape, quantized, fmt) -> int`` for state that is not per-element slots
            (Adafactor's factored statistics): ``fmt`` is the optimizer's :class:`StateFormat`, ``quantized``
            whether this tensor's state is in it (else fp32); None: the slots' bytes (a hybrid's: those of the rule
            its partition gives the tensor).
        update: how the algorithm updates on the PyTorch path when it is not elementwise (LAMB, Adafactor, Muon):
            :class:`hf_optim.core.own_update.OwnUpdate`; None: the elementwise ``rule`` on every path.
        partition: for a hybrid algorithm (Muon), the labelled rules its parameters are split into
            (:class:`hf_optim.core.partition.Partition`); None: one rule for every parameter.
        variant_formats: the names of the formats with named classes (``<class_name><suffix>`` and their paged
            twins); default bitsandbytes' family (fp32, blockwise8); None: every registered format (a format
            registered later included). Any class runs with every format it supports through ``state_format``.
    """

    name: str
    class_name: str
    slots: tuple[StateSpec, ...]
    hyper: type
    hyper_at: Callable[[dict, int], Any]
    rule: Callable | None = None
    triton_rule: Any = None
    triton_plan: TritonPlan = TritonPlan()
    trainer: Any = None
    state_bytes: Callable[[tuple[int, ...], bool, StateFormat], int] | None = None
    variant_formats: tuple[str, ...] | None = BITSANDBYTES_FORMATS
    update: OwnUpdate | None = None
    partition: Partition | None = None
    package: str | None = None
    """Where relative references (``".triton_rule:adamw"``) are resolved; default: the package of the module that
    created the description."""

    def __post_init__(self) -> None:
        if self.package is None:  # the caller of the dataclass __init__ that called this
            caller = sys._getframe(2).f_globals
            object.__setattr__(self, "package", caller.get("__package__") or caller.get("__name__"))
        if not self.name or not self.name.isidentifier() or self.name != self.name.lower():
            raise ValueError(f"Algorithm name {self.name!r} must be a lower-case Python identifier, e.g. 'signum'")
        if not self.class_name.isidentifier():
            raise ValueError(f"Algorithm class_name {self.class_name!r} must be a Python identifier, e.g. 'Signum'")
        if not (isinstance(self.hyper, type) and issubclass(self.hyper, tuple) and hasattr(self.hyper, "_fields")):
            raise TypeError(f"Algorithm {self.name!r}: hyper must be a typing.NamedTuple class, got {self.hyper!r}")
        if self.triton_rule is not None and self.triton_plan.elementwise and not 1 <= self.state_rows <= 3:
            raise ValueError(f"Algorithm {self.name!r}: the fused Triton kernel reads 1 to 3 state rows, its slots "
                             f"have {self.state_rows}")
        if len({spec.key for spec in self.slots}) != len(self.slots):
            raise ValueError(f"Algorithm {self.name!r}: slot keys repeat: {[spec.key for spec in self.slots]}")
        if self.triton_plan.elementwise and self.triton_rule is not None and self.rule is None:
            raise ValueError(f"Algorithm {self.name!r}: an elementwise Triton rule needs its PyTorch rule")

    def resolve(self, ref: Any) -> Any:
        """A Triton rule or plan function of this description: ``ref`` itself, or what its reference names."""
        return resolve(ref, self.package)

    @property
    def runs_on_triton(self) -> bool:
        """Whether the algorithm has a Triton path (an elementwise twin, or its own plan)."""
        return self.triton_rule is not None or not self.triton_plan.elementwise

    @property
    def state_rows(self) -> int:
        return sum(spec.rows for spec in self.slots)

    def hyper_values(self, group: dict, step: int) -> NamedTuple:
        """The scalars at ``step`` for ``group``, checked to be of the declared ``hyper`` class."""
        values = self.hyper_at(group, step)
        if type(values) is not self.hyper:
            raise TypeError(f"{self.name}: hyper_at returned {type(values).__name__}, expected {self.hyper.__name__}")
        return values

    def bytes_per_tensor(self, shape: tuple[int, ...], quantized: bool, fmt: StateFormat,
                         rule: str | None = None) -> int:
        """Bytes of state for one tensor of ``shape`` in an optimizer of format ``fmt`` (``quantized``: this tensor's
        slots are in ``fmt``, not fp32: it has at least ``min_8bit_size`` elements; ``rule``: the rule a hybrid
        optimizer gives it, None where only the shape decides: a hybrid's partition then labels the unmarked
        tensor)."""
        if self.state_bytes is not None:
            return self.state_bytes(shape, quantized, fmt)
        slots = self.slots
        if self.partition is not None:
            label = rule if rule is not None else self.partition.label_for_mark(None, len(shape), {})
            slots = (self.partition.rule(label).algorithm or self).slots
        numel = math.prod(shape)
        return sum(slot_bytes(spec, numel, fmt if quantized else FP32, shape) for spec in slots)
