"""A test kernel that updates one 4-bit state row through triton_blockwise4's helpers, tiled exactly like the
fused optimizer kernels: (BLOCKS, 256) tiles from ``triton_blockwise.tile_offsets``."""

import torch
import triton
import triton.language as tl

from hf_optim.kernels.triton_blockwise import tile_offsets
from hf_optim.kernels.triton_blockwise4 import load_state4, store_state4

BLOCKS = 2


@triton.jit
def _scale_and_shift_kernel(codes_ptr, scale_ptr, qmap_ptr, thresholds_ptr, n, BLOCKS: tl.constexpr):
    _, offs = tile_offsets(tl.program_id(0) * BLOCKS, BLOCKS)
    mask = offs < n
    values = load_state4(codes_ptr, scale_ptr, qmap_ptr, offs, mask)
    store_state4(codes_ptr, scale_ptr, thresholds_ptr, offs, values * 0.5 + 0.25, mask)


def scale_and_shift_state(codes: torch.Tensor, scale: torch.Tensor, qmap: torch.Tensor, thresholds: torch.Tensor,
                          n: int) -> None:
    """state <- quantize(dequantize(state) * 0.5 + 0.25), in place, on a 1-row 4-bit state of ``n`` values."""
    grid = (triton.cdiv(n, BLOCKS * 256),)
    _scale_and_shift_kernel[grid](codes, scale, qmap, thresholds, n, BLOCKS=BLOCKS)
