"""Optimizer state precision, in one place: every algorithm reads and writes fp32 state through this module.

A state slot is stored either as fp32 (32-bit optimizers, and tensors below ``min_8bit_size``) or as
bitsandbytes' 8-bit blockwise format. The slot names and layout follow bitsandbytes exactly:

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

from hf_optim.kernels import blockwise
from hf_optim.kernels.blockwise import num_blocks
from hf_optim.kernels.dynamic_map import dynamic_map, encoder_table


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


def slot_shape(spec: StateSpec, param: torch.Tensor) -> tuple[int, ...]:
    return tuple(param.shape) if spec.rows == 1 else (spec.rows, *param.shape)


def init_slot(
    state: dict, spec: StateSpec, param: torch.Tensor, eight_bit: bool, allocate=torch.zeros
) -> None:
    """Create one zeroed slot in ``state`` for ``param`` (its local tensor, for sharded parameters).

    ``allocate(shape, dtype=, device=)`` makes the big buffers, so paged memory can be plugged in.
    """
    shape = slot_shape(spec, param)
    if not eight_bit:
        state[spec.key] = allocate(shape, dtype=torch.float32, device=param.device)
        return
    blocks = num_blocks(param.numel())
    state[spec.key] = allocate(shape, dtype=torch.uint8, device=param.device)
    state[spec.qmap_key] = dynamic_map(spec.signed, param.device)
    absmax_shape = (blocks,) if spec.rows == 1 else (spec.rows, blocks)
    state[spec.absmax_key] = torch.zeros(absmax_shape, dtype=torch.float32, device=param.device)


def is_8bit(state: dict, spec: StateSpec) -> bool:
    return state[spec.key].dtype == torch.uint8


def slot_tensors(state: dict, spec: StateSpec) -> list[torch.Tensor]:
    """The raw tensors of a slot as 2-D ``(rows, n)`` views, in the order the kernels take them.

    fp32: ``[values]``; 8-bit: ``[codes as an int8 view, absmax, qmap, encoder table]`` (see
    ``blockwise.quantize_into`` for why int8).
    """
    main = state[spec.key].view(spec.rows, -1)
    if not is_8bit(state, spec):
        return [main]
    absmax = state[spec.absmax_key].view(spec.rows, -1)
    return [main.view(torch.int8), absmax, state[spec.qmap_key], encoder_table(spec.signed, main.device)]


def read_slot(state: dict, spec: StateSpec) -> torch.Tensor:
    """The slot's values as fp32 ``(rows, n)`` (a view for fp32 slots, a dequantized copy for 8-bit ones)."""
    tensors = slot_tensors(state, spec)
    if len(tensors) == 1:
        return tensors[0]
    codes, absmax, qmap = tensors[:3]
    return blockwise.dequantize(codes, absmax, qmap)


def write_slot(state: dict, spec: StateSpec, values: torch.Tensor) -> None:
    """Store fp32 ``values`` (rows, n) into the slot, re-quantizing an 8-bit slot."""
    tensors = slot_tensors(state, spec)
    if len(tensors) == 1:
        tensors[0].copy_(values)
        return
    codes, absmax, _, table = tensors
    new_codes, new_absmax = blockwise.quantize(values, table, spec.signed)
    codes.copy_(new_codes)
    absmax.copy_(new_absmax)


def slot_kinds(state: dict, specs: tuple[StateSpec, ...]) -> tuple[bool | None, ...]:
    """Static description of the slots for kernels: None for fp32, else the map's signedness."""
    return tuple(spec.signed if is_8bit(state, spec) else None for spec in specs)


def slot_bytes(spec: StateSpec, numel: int, quantized: bool) -> int:
    """Bytes one slot takes for a tensor of ``numel`` elements, as :func:`init_slot` allocates it: fp32 values, or
    8-bit codes with an fp32 absmax per block and the slot's own 256-entry fp32 map."""
    if not quantized:
        return 4 * spec.rows * numel
    return spec.rows * (numel + 4 * num_blocks(numel)) + 4 * 256
