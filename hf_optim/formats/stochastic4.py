"""4-bit state rounded stochastically: the accurate 4-bit format, and hf_optim's default 4-bit state.

The math, and why each choice, is in :mod:`hf_optim.formats.quant4_sr`: half a byte per element, one fp32 scale per
64 elements, a map linear in two segments (fine near 0) for signed states (first moments) and the linear map without
zero for unsigned ones (second moments), rounded stochastically (unbiased) with bits hashed from the values, in planar
nibble order.

A slot ``stateK`` holds the codes, ``(128 * blocks,)`` uint8 (``(rows, 128 * blocks)`` when stacked), ``blocks =
ceil(n / 256)``; ``absmaxK`` the scales, four per block; ``formatK`` the string ``"stochastic4"``, which tells this
slot from ``blockwise4``'s (the same dtypes; an unsigned slot would even have the same map) when a state is
loaded. There is no ``qmapK``: the maps are arithmetic, constants of the format.

Every chunk of whole 256-element blocks quantizes on its own, so the format has a flat-buffer (multi-tensor) form,
compiled on the CPU, and a Triton branch (``hf_optim.kernels.triton_path.stochastic4``); under FSDP2 each shard's
blocks are its own, as for the other blockwise formats (no reduction across ranks).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from hf_optim.formats import quant4_sr
from hf_optim.formats.base import StateDictError, StateFormat, in_blocks, register_format
from hf_optim.formats.quant4_sr import GROUP, GROUPS, HALF, SIGNED_ZERO, code_bytes, scale_count
from hf_optim.numerics import BLOCK_SIZE

ZERO_BYTE = {True: SIGNED_ZERO << 4 | SIGNED_ZERO, False: 0}
"""A byte whose two codes encode 0.0 (signed: the zero code; unsigned: the smallest code, what 0.0 encodes to, which
a zero scale decodes to 0)."""


def format_key(spec) -> str:
    """The key of a slot's format marker: ``format2`` for ``state2``."""
    return "format" + spec.key[-1] if spec.key.startswith("state") else spec.key + "_format"


class Stochastic4(StateFormat):
    name, bits, code, width, block_size, packed = "stochastic4", 4, 5, 2, GROUP, True
    # A byte holds elements i and 128 + i of a 256-element block, and a group's maximum reduces over a reshaped
    # tile: both exchange values between threads (shared memory on the GPU; counted in gpu_static's occupancy).
    crosses_threads = True
    class_suffix, optim_suffix, label, rank, optim_bits = "4bit", "4bit", "4-bit stochastic", 2.75, 4
    triton_rows = "hf_optim.kernels.triton_path.stochastic4:STOCHASTIC4_ROWS"
    ahead_of = "blockwise8"  # whose recognises() accepts any uint8 slot without a 16-entry map, this one's too

    def num_blocks(self, numel: int) -> int:
        return scale_count(numel)

    def main_length(self, numel: int) -> int:
        return code_bytes(numel)

    # -- allocation -------------------------------------------------------------------------------------------
    def init_slot(self, state: dict, spec, param: torch.Tensor, allocate: Callable) -> None:
        n = param.numel()
        lead = () if spec.rows == 1 else (spec.rows,)
        codes = allocate((*lead, code_bytes(n)), dtype=torch.uint8, device=param.device, elements=n)
        if spec.signed:
            codes.fill_(ZERO_BYTE[True])
        state[spec.key] = codes
        state[spec.absmax_key] = torch.zeros((*lead, scale_count(n)), dtype=torch.float32, device=param.device)
        state[format_key(spec)] = self.name

    def raw(self, state: dict, spec) -> list[torch.Tensor]:
        return [state[spec.key].view(spec.rows, -1).view(torch.int8), state[spec.absmax_key].view(spec.rows, -1)]

    def slice_raw(self, raw, start, stop, block_form):
        codes, scale = raw
        first, last = start // BLOCK_SIZE, -(-stop // BLOCK_SIZE)
        codes = codes[:, first * HALF : last * HALF]
        scale = scale[:, GROUPS * first : GROUPS * last]
        if block_form:
            codes = codes.reshape(codes.shape[0], -1, HALF)
        return [codes, scale]

    # -- flat buffers (multi-tensor path) ---------------------------------------------------------------------
    def flat_buffers(self, rows, total, signed, device, allocate):
        codes = allocate((rows, total // 2), dtype=torch.uint8, device=device, elements=total)
        if signed:
            codes.fill_(ZERO_BYTE[True])
        return [codes, torch.zeros((rows, total // GROUP), dtype=torch.float32, device=device)]

    def kernel_chunk(self, buffers, start, stop, signed, device):
        codes = in_blocks(buffers[0][:, start // 2 : stop // 2], HALF)
        return [codes.view(torch.int8), buffers[1][:, start // GROUP : stop // GROUP]]

    def flat_views(self, buffers, offset, numel):
        return [buffers[0][:, offset // 2 : offset // 2 + code_bytes(numel)],
                buffers[1][:, offset // GROUP : offset // GROUP + scale_count(numel)]]

    def bind(self, state, spec, views, shape):
        codes, scale = views
        state[spec.key] = codes if spec.rows > 1 else codes[0]
        state[spec.absmax_key] = scale if spec.rows > 1 else scale[0]
        state[format_key(spec)] = self.name

    def main_offset_bytes(self, offset: int) -> int:
        return offset // 2

    def main_dtype(self) -> torch.dtype:
        return torch.uint8

    # -- math -------------------------------------------------------------------------------------------------
    def dequantize(self, raw: Sequence[torch.Tensor], signed: bool, n: int | None = None) -> torch.Tensor:
        codes, scale = raw[:2]
        return quant4_sr.dequantize(codes, scale, signed, n)

    def store(self, values: torch.Tensor, raw: Sequence[torch.Tensor], signed: bool) -> None:
        codes, scale = raw[:2]
        quant4_sr.quantize_into(values, codes, scale, signed)

    def rounds_stochastically(self, signed: bool) -> bool:
        """Every slot is rounded stochastically (to either neighbouring code)."""
        return True

    def code_values(self, signed: bool) -> torch.Tensor:
        """The map's values, sorted (the format keeps no ``qmapK``: its maps are arithmetic)."""
        return (quant4_sr.SIGNED_MAP if signed else quant4_sr.UNSIGNED_MAP).clone()

    # -- size and checkpoints ---------------------------------------------------------------------------------
    def state_bytes(self, numel: int, rows: int = 1) -> int:
        return rows * (code_bytes(numel) + 4 * scale_count(numel))

    def keys(self, spec) -> tuple[str, ...]:
        return (spec.key, spec.absmax_key, format_key(spec))  # flat_views' order first

    def recognises(self, state: dict, spec) -> bool:
        value = state.get(spec.key)
        return (isinstance(value, torch.Tensor) and value.dtype == torch.uint8
                and state.get(format_key(spec)) == self.name)

    def load_views(self, views: Sequence[torch.Tensor], state: dict, spec) -> None:
        for view, key in zip(views, (spec.key, spec.absmax_key)):
            view.copy_(state[key].reshape(view.shape))

    def check_loaded(self, param: torch.Tensor, state: dict, spec, where: str) -> None:
        n = param.numel()
        lead = () if spec.rows == 1 else (spec.rows,)
        expected = {spec.key: (*lead, code_bytes(n)), spec.absmax_key: (*lead, scale_count(n))}
        self.check_shapes(state, spec, expected, where, "4-bit stochastic")
        if state[spec.absmax_key].dtype != torch.float32:
            raise StateDictError(f"{where}: {spec.absmax_key} has dtype {state[spec.absmax_key].dtype}, "
                                 "expected float32")


STOCHASTIC4 = register_format(Stochastic4())
