"""fp32 state: the values themselves (32-bit optimizers, and tensors below ``min_8bit_size``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from hf_optim.formats.base import StateFormat, in_blocks, register_format
from hf_optim.numerics import BLOCK_SIZE


class Fp32(StateFormat):
    name, bits, code, width = "fp32", 32, 0, 1
    class_suffix, optim_suffix, label, rank, optim_bits = "32bit", "32bit", "32-bit", 0, 32
    triton_rows = "hf_optim.kernels.triton_path.rows:FP32_ROWS"

    def init_slot(self, state: dict, spec, param: torch.Tensor, allocate: Callable) -> None:
        shape = tuple(param.shape) if spec.rows == 1 else (spec.rows, *param.shape)
        state[spec.key] = allocate(shape, dtype=torch.float32, device=param.device, elements=param.numel())

    def raw(self, state: dict, spec) -> list[torch.Tensor]:
        return [state[spec.key].view(spec.rows, -1)]

    def slice_raw(self, raw, start, stop, block_form):
        values = raw[0][:, start:stop]
        return [values.reshape(values.shape[0], -1, BLOCK_SIZE) if block_form else values]

    def flat_buffers(self, rows, total, signed, device, allocate):
        return [allocate((rows, total), dtype=torch.float32, device=device, elements=total)]

    def kernel_chunk(self, buffers, start, stop, signed, device):
        return [in_blocks(buffers[0][:, start:stop], BLOCK_SIZE)]

    def flat_views(self, buffers, offset, numel):
        return [buffers[0][:, offset : offset + numel]]

    def bind(self, state, spec, views, shape):
        state[spec.key] = views[0].view(shape) if spec.rows > 1 else views[0][0].view(shape)

    def main_offset_bytes(self, offset: int) -> int:
        return 4 * offset

    def main_dtype(self) -> torch.dtype:
        return torch.float32

    def dequantize(self, raw: Sequence[torch.Tensor], signed: bool, n: int | None = None) -> torch.Tensor:
        return raw[0]

    def store(self, values: torch.Tensor, raw: Sequence[torch.Tensor], signed: bool, scales=None) -> None:
        raw[0].copy_(values)

    def state_bytes(self, numel: int, rows: int = 1) -> int:
        return 4 * numel * rows

    def keys(self, spec) -> tuple[str, ...]:
        return (spec.key,)

    def recognises(self, state: dict, spec) -> bool:
        value = state.get(spec.key)
        return isinstance(value, torch.Tensor) and value.dtype == torch.float32

    def check_loaded(self, param: torch.Tensor, state: dict, spec, where: str) -> None:
        shape = tuple(param.shape) if spec.rows == 1 else (spec.rows, *param.shape)
        self.check_slot_shape(param, state[spec.key], spec, where, shape)


FP32 = register_format(Fp32())
