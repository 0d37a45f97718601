"""bitsandbytes' 8-bit blockwise state (>= 0.44), unchanged on disk, so checkpoints move both ways.

A slot ``stateK`` holds uint8 codes in the slot's shape, ``absmaxK`` one fp32 absmax per 256 elements (per row)
and ``qmapK`` the 256-entry dynamic map (signed for moments that can be negative). The math is in
:mod:`hf_optim.kernels.formats.quant8`; the kernels take a slot as ``[codes as int8, absmax, qmap, encoder table]``
(int8: see ``quant8.quantize_into``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from hf_optim.kernels.formats import quant8
from hf_optim.kernels.formats.base import StateDictError, StateFormat, in_blocks, register_format
from hf_optim.kernels.formats.dynamic_map import BLOCK_SIZE, ZERO_CODE_SIGNED, dynamic_map, encoder_table
from hf_optim.kernels.formats.quant8 import num_blocks

OLD_BLOCK_SIZE = 2048
"""bitsandbytes <= 0.43's optimizer block size, refused with an explanation."""

@functools.cache
def shared_map(signed: bool, device: torch.device) -> torch.Tensor:
    """One map per device for the kernels (each parameter's state keeps its own copy for ``state_dict``)."""
    return dynamic_map(signed, device)


class Blockwise8(StateFormat):
    name, bits, code, width, block_size = "blockwise8", 8, 1, 4, BLOCK_SIZE
    class_suffix, optim_suffix, label, rank, optim_bits = "8bit", "8bit", "8-bit blockwise", 2, 8

    def init_slot(self, state: dict, spec, param: torch.Tensor, allocate: Callable) -> None:
        shape = tuple(param.shape) if spec.rows == 1 else (spec.rows, *param.shape)
        blocks = num_blocks(param.numel())
        state[spec.key] = allocate(shape, dtype=torch.uint8, device=param.device, elements=param.numel())
        state[spec.qmap_key] = dynamic_map(spec.signed, param.device)
        absmax_shape = (blocks,) if spec.rows == 1 else (spec.rows, blocks)
        state[spec.absmax_key] = torch.zeros(absmax_shape, dtype=torch.float32, device=param.device)

    def raw(self, state: dict, spec) -> list[torch.Tensor]:
        main = state[spec.key].view(spec.rows, -1)
        absmax = state[spec.absmax_key].view(spec.rows, -1)
        return [main.view(torch.int8), absmax, state[spec.qmap_key], encoder_table(spec.signed, main.device)]

    def slice_raw(self, raw, start, stop, block_form):
        codes, absmax, qmap, table = raw
        codes = codes[:, start:stop]
        blocks = absmax[:, start // BLOCK_SIZE : -(-stop // BLOCK_SIZE)]
        return [codes.reshape(codes.shape[0], -1, BLOCK_SIZE) if block_form else codes, blocks, qmap, table]

    def flat_buffers(self, rows, total, signed, device, allocate):
        codes = allocate((rows, total), dtype=torch.uint8, device=device, elements=total)
        if signed:  # the code of 0.0: 127 in the signed map (0, the allocator's zeros, in the unsigned one)
            codes.fill_(ZERO_CODE_SIGNED)
        return [codes, torch.zeros((rows, total // BLOCK_SIZE), dtype=torch.float32, device=device)]

    def flat_views(self, buffers, offset, numel):
        first = offset // BLOCK_SIZE
        return [buffers[0][:, offset : offset + numel], buffers[1][:, first : first + num_blocks(numel)]]

    def bind(self, state, spec, views, shape):
        codes, absmax = views
        state[spec.key] = codes.view(shape) if spec.rows > 1 else codes[0].view(shape)
        state[spec.absmax_key] = absmax if spec.rows > 1 else absmax[0]
        if spec.qmap_key not in state:
            state[spec.qmap_key] = dynamic_map(spec.signed, codes.device)

    def main_offset_bytes(self, offset: int) -> int:
        return offset

    def main_dtype(self) -> torch.dtype:
        return torch.uint8

    def kernel_chunk(self, buffers, start, stop, signed, device):
        """The raw tensors of flat elements ``[start, stop)`` of the multi-tensor buffers, in block form."""
        codes = in_blocks(buffers[0][:, start:stop], BLOCK_SIZE)
        absmax = buffers[1][:, start // BLOCK_SIZE : -(-stop // BLOCK_SIZE)]
        return [codes.view(torch.int8), absmax, shared_map(signed, device), encoder_table(signed, device)]

    def dequantize(self, raw: Sequence[torch.Tensor], signed: bool, n: int | None = None) -> torch.Tensor:
        codes, absmax, qmap = raw[:3]
        return quant8.dequantize(codes, absmax, qmap)

    def store(self, values: torch.Tensor, raw: Sequence[torch.Tensor], signed: bool) -> None:
        codes, absmax, _, table = raw
        quant8.quantize_into(values, table, signed, codes, absmax)

    def state_bytes(self, numel: int, rows: int = 1) -> int:
        return rows * (numel + 4 * num_blocks(numel)) + 4 * 256

    def keys(self, spec) -> tuple[str, ...]:
        return (spec.key, spec.absmax_key, spec.qmap_key)  # flat_views' order first

    def recognises(self, state: dict, spec) -> bool:
        value, qmap = state.get(spec.key), state.get(spec.qmap_key)
        return (
            isinstance(value, torch.Tensor) and value.dtype == torch.uint8
            and (qmap is None or qmap.numel() == 256)  # no qmap: refused by check_loaded with a message
        )

    def check_loaded(self, param: torch.Tensor, state: dict, spec, where: str) -> None:
        shape = tuple(param.shape) if spec.rows == 1 else (spec.rows, *param.shape)
        self.check_slot_shape(param, state[spec.key], spec, where, shape)
        for key in (spec.qmap_key, spec.absmax_key):
            if key not in state:
                raise StateDictError(f"{where}: 8-bit {spec.key} has no {key}")
        blocks = num_blocks(param.numel())
        absmax = state[spec.absmax_key]
        expected = (blocks,) if spec.rows == 1 else (spec.rows, blocks)
        if tuple(absmax.shape) != expected:
            old_blocks = -(-param.numel() // OLD_BLOCK_SIZE)
            per_row = absmax.shape[-1] if absmax.dim() else 0
            if per_row == old_blocks and old_blocks != blocks:
                raise StateDictError(
                    f"{where}: {spec.absmax_key} has {per_row} blocks per row, which matches the 2048-element "
                    f"blocks of bitsandbytes <= 0.43; hf_optim and bitsandbytes >= 0.44 use {BLOCK_SIZE}-element "
                    "blocks. Re-save the checkpoint with a newer bitsandbytes or restart the optimizer state."
                )
            raise StateDictError(f"{where}: {spec.absmax_key} has shape {tuple(absmax.shape)}, expected {expected}")
        qmap = state[spec.qmap_key]
        if not torch.equal(qmap.detach().cpu().float(), dynamic_map(spec.signed)):
            kind = "signed" if spec.signed else "unsigned"
            raise StateDictError(f"{where}: {spec.qmap_key} is not the {kind} dynamic map this algorithm uses")


BLOCKWISE8 = register_format(Blockwise8())
