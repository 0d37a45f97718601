"""A test kernel that updates one 4-bit state row through triton_blockwise4's helpers, tiled exactly like the
fused optimizer kernels: ``triton_tile.tile`` tiles, whole ones unmasked and the last one masked."""

import torch
import triton
import triton.language as tl

from hf_optim.kernels.triton_path.quant4 import load_state4, store_state4
from hf_optim.kernels.triton_path.tile import tile

BLOCKS = 2


@triton.jit
def _scale_and_shift_kernel(codes_ptr, scale_ptr, qmap_ptr, n, SIGNED: tl.constexpr, BLOCKS: tl.constexpr,
                            W: tl.constexpr, FULL: tl.constexpr):
    _, halves, rows, offs = tile(tl.program_id(0) * BLOCKS, BLOCKS, W)
    mask = None if FULL else offs < n
    values = load_state4(codes_ptr, scale_ptr, qmap_ptr, halves, rows, offs, mask, n, SIGNED, True)
    store_state4(codes_ptr, scale_ptr, halves, rows, offs, values * 0.5 + 0.25, mask, n, SIGNED, True)


def scale_and_shift_state(codes: torch.Tensor, scale: torch.Tensor, qmap: torch.Tensor, n: int, signed: bool,
                          width: int = 8) -> None:
    """state <- quantize(dequantize(state) * 0.5 + 0.25), in place, on a 1-row 4-bit state of ``n`` values: the
    whole tiles by an unmasked kernel, the last partial tile by a masked one (rows of ``width`` elements)."""
    per_tile = BLOCKS * 256
    whole = n // per_tile
    if whole:
        _scale_and_shift_kernel[(whole,)](codes, scale, qmap, n, SIGNED=signed, BLOCKS=BLOCKS, W=width, FULL=True,
                                          num_warps=BLOCKS * 256 // (32 * width))
    if n % per_tile:
        offset = whole * per_tile  # the partial tile's program works on its own view of the row
        _scale_and_shift_kernel[(1,)](codes[offset // 2:], scale[offset // 128:], qmap, n - offset, SIGNED=signed,
                                      BLOCKS=BLOCKS, W=width, FULL=False, num_warps=BLOCKS * 256 // (32 * width))
