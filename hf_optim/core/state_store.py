"""Optimizer state slots: every algorithm reads and writes fp32 state through this module.

A state slot is stored in one of the formats of :mod:`hf_optim.formats`: fp32 (32-bit optimizers, and
tensors below ``min_8bit_size``), bitsandbytes' 8-bit blockwise format, or 4-bit blockwise. The slot names and
layout follow bitsandbytes exactly:

=========  ==========================  ==========================================================
key        32-bit                      8-bit
=========  ==========================  ==========================================================
state1     fp32, shape (rows, *shape)   uint8 codes, same shape; ``qmap1`` signed map; ``absmax1``
state2     fp32                         uint8 codes; ``qmap2`` map; ``absmax2``
=========  ==========================  ==========================================================

``rows`` is 1 for every state except AdEMAMix's ``state1``, which stacks its two EMAs as ``(2, *shape)`` and
keeps the absmax of the second in row 1 of ``absmax1``. With ``rows == 1`` the leading dimension is dropped,
so a 1-row state has exactly the parameter's shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_optim.formats import SlotLayout, StateFormat, loaded_format
from hf_optim.formats.base import StateDictError, zeroed_buffer


@dataclass(frozen=True)
class StateSpec:
    """One state slot of an algorithm.

    Args:
        key: bitsandbytes slot name, ``"state1"`` or ``"state2"``.
        signed: whether the state can be negative (signed dynamic map) or not (unsigned map).
        rows: how many same-shaped tensors the slot stacks (2 for AdEMAMix's fast and slow EMAs).
    """

    key: str
    signed: bool
    rows: int = 1

    @property
    def qmap_key(self) -> str:
        """``qmap1`` for ``state1`` (bitsandbytes' names); ``<key>_qmap`` for other slots."""
        return "qmap" + self.key[-1] if self.key.startswith("state") else self.key + "_qmap"

    @property
    def absmax_key(self) -> str:
        return "absmax" + self.key[-1] if self.key.startswith("state") else self.key + "_absmax"


QUANT_KEYS = ("state1", "state2", "qmap1", "qmap2", "absmax1", "absmax2", "unorm_vec", "gnorm_vec")
"""Keys bitsandbytes nests under ``__bnb_optimizer_quant_state__`` in ``state_dict()``."""
QUANT_STATE_KEY = "__bnb_optimizer_quant_state__"


def slot_shape(spec: StateSpec, param: torch.Tensor) -> tuple[int, ...]:
    return tuple(param.shape) if spec.rows == 1 else (spec.rows, *param.shape)


def init_slot(state: dict, spec: StateSpec, param: torch.Tensor, fmt: StateFormat,
              allocate=zeroed_buffer) -> None:
    """Create one zeroed slot in ``state`` for ``param`` (its local tensor, for sharded parameters) in format
    ``fmt``. ``allocate(shape, *, dtype, device, elements)`` makes the big buffers, so paged memory can be plugged
    in (:meth:`hf_optim.formats.StateFormat.init_slot`)."""
    fmt.init_slot(state, spec, param, allocate)


def slot_format(state: dict, spec: StateSpec) -> StateFormat:
    """The format slot ``spec`` of a parameter's state is stored in."""
    fmt = loaded_format(state, spec)
    if fmt is None:
        value = state.get(spec.key)
        found = "nothing" if value is None else f"{getattr(value, 'dtype', type(value).__name__)}"
        raise StateDictError(f"state slot {spec.key} holds {found}, which no state format recognises")
    return fmt


def slot_tensors(state: dict, spec: StateSpec) -> list[torch.Tensor]:
    """The raw tensors of a slot as 2-D ``(rows, n)`` views, in the order the kernels take them (see the
    slot's format, e.g. ``formats.blockwise8``)."""
    return slot_format(state, spec).raw(state, spec)


def read_slot(state: dict, spec: StateSpec, n: int | None = None) -> torch.Tensor:
    """The slot's values as fp32 ``(rows, n)`` (a view for fp32 slots, a dequantized copy otherwise). ``n``: the
    parameter's element count (a packed 4-bit slot of an odd count cannot tell it from its bytes)."""
    fmt = slot_format(state, spec)
    return fmt.dequantize(fmt.raw(state, spec), spec.signed, n)


def write_slot(state: dict, spec: StateSpec, values: torch.Tensor) -> None:
    """Store fp32 ``values`` (rows, n) into the slot, re-quantizing a quantized slot."""
    fmt = slot_format(state, spec)
    fmt.store(values.contiguous(), fmt.raw(state, spec), spec.signed)


def slot_layouts(state: dict, specs: tuple[StateSpec, ...]) -> tuple[SlotLayout, ...]:
    """Static description of the slots for kernels: each slot's format and map signedness."""
    return tuple(SlotLayout(slot_format(state, spec), spec.signed) for spec in specs)


def slot_bytes(spec: StateSpec, numel: int, fmt: StateFormat, shape: tuple[int, ...] | None = None) -> int:
    """Bytes one slot takes for a tensor of ``numel`` elements (of ``shape``; None: 1-D) in format ``fmt``, as
    :func:`init_slot` allocates it (values or codes, absmax per block, the slot's own map)."""
    return fmt.slot_bytes(spec, (numel,) if shape is None else tuple(shape))
