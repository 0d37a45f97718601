"""4-bit blockwise state ("Memory Efficient Optimizers with 4-bit States", Li et al. 2023), torchao's maps.

A slot ``stateK`` holds the codes packed two per byte, ``(rows, ceil(n / 2))`` uint8 (a 1-row slot drops the
leading dimension: ``(ceil(n / 2),)``); ``absmaxK`` one fp32 absmax per 128 elements (per row); ``qmapK`` the
16-entry map (signed tree map for moments that can be negative, linear without zero for second moments). The
math is in :mod:`hf_optim.formats.quant4`; kernels take a slot as ``[codes as int8, absmax, qmap, encoder
thresholds]``.

In the multi-tensor kernels' block form, a chunk of ``B`` 256-element blocks is ``2B`` quantization blocks of
128: codes ``(rows, B, 128)`` bytes, absmax ``(rows, 2B)``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from hf_optim.formats import quant4
from hf_optim.formats.base import Scales, StateDictError, StateFormat, in_blocks, register_format
from hf_optim.formats.quant4 import BLOCK_SIZE, encoder_thresholds, packed_length, qmap4
from hf_optim.numerics import BLOCK_SIZE as CHUNK_BLOCK


@functools.cache
def zero_byte(signed: bool) -> int:
    """A byte whose two codes both decode to 0.0 (the signed map holds 0; the unsigned one has no zero, and its
    smallest code is what a zero value encodes to)."""
    code = int((qmap4(True) == 0).nonzero()[0]) if signed else 0
    return code << 4 | code


@functools.cache
def shared_map(signed: bool, device: torch.device) -> torch.Tensor:
    """One map per device for the kernels (each parameter's state keeps its own copy for ``state_dict``)."""
    return qmap4(signed, device)


class Blockwise4(StateFormat):
    name, bits, code, width, block_size, packed = "blockwise4", 4, 2, 4, BLOCK_SIZE, True
    # torchao's format; no longer the default 4-bit (``stochastic4`` has the ``4bit`` names and optim_bits=4):
    # AdamW4bitBlockwise, adamw_4bit_blockwise, and the Trainer's torchao name adamw_torch_4bit
    class_suffix, optim_suffix, label, rank, optim_bits = "4bitBlockwise", "4bit_blockwise", "4-bit blockwise", 3, None
    triton_rows = "hf_optim.kernels.triton_path.quant4:BLOCKWISE4_ROWS"

    def main_length(self, numel: int) -> int:
        return packed_length(numel)

    def init_slot(self, state: dict, spec, param: torch.Tensor, allocate: Callable) -> None:
        n = param.numel()
        shape = (packed_length(n),) if spec.rows == 1 else (spec.rows, packed_length(n))
        codes = allocate(shape, dtype=torch.uint8, device=param.device, elements=n)
        if spec.signed:
            codes.fill_(zero_byte(True))
        state[spec.key] = codes
        state[spec.qmap_key] = qmap4(spec.signed, param.device)
        state[spec.absmax_key] = self.zero_absmax(spec, self.num_blocks(n), param.device)

    def raw(self, state: dict, spec) -> list[torch.Tensor]:
        return self.coded_raw(state, spec, encoder_thresholds)

    def slice_raw(self, raw, start, stop, block_form):
        codes, absmax, qmap, thresholds = raw
        codes = codes[:, start // 2 : -(-stop // 2)]
        absmax = absmax[:, start // BLOCK_SIZE : -(-stop // BLOCK_SIZE)]
        if block_form:
            codes = codes.reshape(codes.shape[0], -1, CHUNK_BLOCK // 2)
        return [codes, absmax, qmap, thresholds]

    def flat_buffers(self, rows, total, signed, device, allocate):
        codes = allocate((rows, total // 2), dtype=torch.uint8, device=device, elements=total)
        if signed:
            codes.fill_(zero_byte(True))
        return [codes, torch.zeros((rows, total // BLOCK_SIZE), dtype=torch.float32, device=device)]

    def kernel_chunk(self, buffers, start, stop, signed, device):
        codes = in_blocks(buffers[0][:, start // 2 : stop // 2], CHUNK_BLOCK // 2)
        absmax = buffers[1][:, start // BLOCK_SIZE : stop // BLOCK_SIZE]
        return [codes.view(torch.int8), absmax, shared_map(signed, device), encoder_thresholds(signed, device)]

    def flat_views(self, buffers, offset, numel):
        first = offset // BLOCK_SIZE
        return [buffers[0][:, offset // 2 : offset // 2 + packed_length(numel)],
                buffers[1][:, first : first + self.num_blocks(numel)]]

    def bind(self, state, spec, views, shape):
        codes, absmax = views
        state[spec.key] = codes if spec.rows > 1 else codes[0]
        state[spec.absmax_key] = absmax if spec.rows > 1 else absmax[0]
        if spec.qmap_key not in state:
            state[spec.qmap_key] = qmap4(spec.signed, codes.device)

    def main_offset_bytes(self, offset: int) -> int:
        return offset // 2

    def main_dtype(self) -> torch.dtype:
        return torch.uint8

    def dequantize(self, raw: Sequence[torch.Tensor], signed: bool, n: int | None = None) -> torch.Tensor:
        codes, absmax = raw[:2]  # the map's values are constants of quant4.decode: no read of the map
        if codes.dim() == 3:  # block form: (rows, B, 128) bytes are 2B quantization blocks of 128 elements
            rows, blocks = codes.shape[0], codes.shape[1]
            values = quant4.dequantize(codes.reshape(rows, 2 * blocks, BLOCK_SIZE // 2), absmax, signed)
            return values.reshape(rows, blocks, CHUNK_BLOCK)
        return quant4.dequantize(codes, absmax, signed, n)

    def scales(self, spec, shape):
        return (Scales(spec.absmax_key, BLOCK_SIZE),)

    def scales_of(self, values, raw, signed):
        return [quant4.block_scales(values)]

    def unpack_codes(self, main: torch.Tensor, n: int) -> torch.Tensor:
        return quant4.unpack_codes(main, n)

    def pack_codes(self, codes: torch.Tensor, signed: bool) -> torch.Tensor:
        return quant4.pack_codes(codes, signed)

    def store(self, values: torch.Tensor, raw: Sequence[torch.Tensor], signed: bool, scales=None) -> None:
        codes, absmax, _, thresholds = raw
        if scales is not None:
            quant4.quantize_into(values, thresholds, codes, absmax, scales[0])
        elif values.dim() == 3:
            rows, blocks = values.shape[0], values.shape[1]
            quant4.quantize_into(values.reshape(rows, 2 * blocks, BLOCK_SIZE), thresholds,
                                     codes.reshape(rows, 2 * blocks, BLOCK_SIZE // 2), absmax)
        else:
            quant4.quantize_into(values, thresholds, codes, absmax)

    def state_bytes(self, numel: int, rows: int = 1) -> int:
        return rows * (packed_length(numel) + 4 * self.num_blocks(numel)) + 4 * 16

    def keys(self, spec) -> tuple[str, ...]:
        return (spec.key, spec.absmax_key, spec.qmap_key)  # flat_views' order first

    def recognises(self, state: dict, spec) -> bool:
        value, qmap = state.get(spec.key), state.get(spec.qmap_key)
        return (isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and isinstance(qmap, torch.Tensor)
                and qmap.numel() == 16)

    def check_loaded(self, param: torch.Tensor, state: dict, spec, where: str) -> None:
        n = param.numel()
        expected = {
            spec.key: (packed_length(n),) if spec.rows == 1 else (spec.rows, packed_length(n)),
            spec.absmax_key: (self.num_blocks(n),) if spec.rows == 1 else (spec.rows, self.num_blocks(n)),
        }
        self.check_shapes(state, spec, expected, where, "4-bit")
        if not torch.equal(state[spec.qmap_key].detach().cpu().float(), qmap4(spec.signed)):
            kind = "signed tree" if spec.signed else "unsigned linear"
            raise StateDictError(f"{where}: {spec.qmap_key} is not the 4-bit {kind} map this algorithm uses")


BLOCKWISE4 = register_format(Blockwise4())
