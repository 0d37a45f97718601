"""Blockwise 4-bit quantization in Triton: the twin of :mod:`hf_optim.kernels.blockwise4`, same codes and scales.

The ``@triton.jit`` helpers :func:`load_state4` / :func:`store_state4` read and write one 4-bit state row for a
tile of element offsets, so a fused optimizer kernel can use them where it uses ``triton_blockwise.load_state`` /
``store_state`` for 8-bit rows. They take the element offsets tile the kernel already has (any 2-D shape, such as
the fused kernels' ``(BLOCKS, 256)``) under one condition: read in row-major order, the tile is a run of whole
128-element quantization blocks, each starting at a multiple of 128 (true of every tile made by
``triton_blockwise.tile_offsets``). Internally a tile is reshaped to ``(blocks, 128)`` rows for the per-block
scale and to ``(pairs, 2)`` for the two nibbles of a byte.

Same rules as the PyTorch path: scale is the exact block absmax (all-zero blocks: scale 0 and the code of 0.0),
values are divided with ``div_rn`` (correctly rounded, as torch), the code is the count of encoder thresholds at or
below the value, element ``2i`` goes to the high nibble, and a block holding NaN gets a NaN scale (Triton's ``max``
would drop it; the twin keeps it so that both paths agree on every input).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_optim.kernels import blockwise4

BLOCK4: tl.constexpr = tl.constexpr(blockwise4.BLOCK_SIZE)
THRESHOLDS: tl.constexpr = tl.constexpr(blockwise4.CODES - 1)


@triton.jit
def encode4(normalized, thresholds_ptr):
    """Nearest 4-bit code (int32) of values in [-1, 1]: how many of the 15 thresholds are at or below each."""
    codes = tl.zeros(normalized.shape, dtype=tl.int32)
    for index in tl.static_range(THRESHOLDS):
        codes += (normalized >= tl.load(thresholds_ptr + index)).to(tl.int32)
    return codes


@triton.jit
def _as_blocks(x):
    return tl.reshape(x, (x.numel // BLOCK4, BLOCK4))


@triton.jit
def _first_of_pairs(x):
    first, _ = tl.split(tl.reshape(x, (x.numel // 2, 2)))
    return first


@triton.jit
def _block_indices(offs, mask):
    """(quantization block of each 128-lane row, whether any lane of it is inside ``mask``)."""
    block = tl.min(_as_blocks(offs), axis=1) // BLOCK4
    live = tl.max(_as_blocks(mask.to(tl.int32)), axis=1) > 0
    return block, live


@triton.jit
def load_state4(codes_ptr, scale_ptr, qmap_ptr, offs, mask):
    """fp32 values (shaped like ``offs``) of a 4-bit row: packed uint8 ``codes_ptr``, fp32 ``scale_ptr``."""
    mask = tl.broadcast_to(mask, offs.shape)
    byte = tl.load(codes_ptr + _first_of_pairs(offs) // 2, mask=_first_of_pairs(mask), other=0).to(tl.int32)
    codes = tl.reshape(tl.join(byte >> 4, byte & 15), (offs.numel,))
    block, live = _block_indices(offs, mask)
    scale = tl.load(scale_ptr + block, mask=live, other=0.0)
    values = _as_blocks(tl.load(qmap_ptr + codes)) * scale[:, None]
    return tl.reshape(values, offs.shape)


@triton.jit
def quantize_blocks4(values, mask, thresholds_ptr):
    """(packed uint8 pairs (numel / 2,), scale (numel / 128,)) of fp32 ``values``; lanes outside ``mask`` are 0."""
    mask = tl.broadcast_to(mask, values.shape)
    blocks = _as_blocks(tl.where(mask, values, 0.0))
    scale = tl.max(tl.abs(blocks), axis=1)
    has_nan = tl.max((blocks != blocks).to(tl.int32), axis=1) > 0
    scale = tl.where(has_nan, float("nan"), scale)
    # An all-zero block has scale 0: divide by 1 so it encodes the code of 0.0, as the PyTorch twin does.
    divisor = tl.where(scale > 0, scale, 1.0)
    codes = encode4(tl.div_rn(blocks, divisor[:, None]), thresholds_ptr)
    high, low = tl.split(tl.reshape(codes, (values.numel // 2, 2)))
    return ((high << 4) | low).to(tl.uint8), scale


@triton.jit
def store_state4(codes_ptr, scale_ptr, thresholds_ptr, offs, values, mask):
    """Quantize fp32 ``values`` (shaped like ``offs``) against their new block scales into a 4-bit row."""
    mask = tl.broadcast_to(mask, offs.shape)
    packed, scale = quantize_blocks4(values, mask, thresholds_ptr)
    tl.store(codes_ptr + _first_of_pairs(offs) // 2, packed, mask=_first_of_pairs(mask))
    block, live = _block_indices(offs, mask)
    tl.store(scale_ptr + block, scale, mask=live)


# ------------------------------------------------------------------------------------------------------------
# Standalone quantize / dequantize over (rows, n) tensors, the twins of blockwise4.quantize / dequantize.
TILE_BLOCKS = 4


@triton.jit
def _tile(n, BLOCKS: tl.constexpr):
    offs = tl.program_id(0) * BLOCKS * BLOCK4 + tl.arange(0, BLOCKS)[:, None] * BLOCK4 + tl.arange(0, BLOCK4)[None, :]
    return offs, offs < n


@triton.jit
def _quantize_kernel(values_ptr, codes_ptr, scale_ptr, thresholds_ptr, n, row_bytes, row_blocks,
                     BLOCKS: tl.constexpr):
    row = tl.program_id(1)
    offs, mask = _tile(n, BLOCKS)
    values = tl.load(values_ptr + row * n + offs, mask=mask, other=0.0)
    store_state4(codes_ptr + row * row_bytes, scale_ptr + row * row_blocks, thresholds_ptr, offs, values, mask)


@triton.jit
def _dequantize_kernel(codes_ptr, scale_ptr, qmap_ptr, out_ptr, n, row_bytes, row_blocks, BLOCKS: tl.constexpr):
    row = tl.program_id(1)
    offs, mask = _tile(n, BLOCKS)
    values = load_state4(codes_ptr + row * row_bytes, scale_ptr + row * row_blocks, qmap_ptr, offs, mask)
    tl.store(out_ptr + row * n + offs, values, mask=mask)


def quantize(values: torch.Tensor, thresholds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed codes (rows, ceil(n / 2)) uint8 and scale (rows, ceil(n / 128)) fp32 of fp32 ``values`` (rows, n)."""
    values = values.contiguous()
    rows, n = values.shape
    row_bytes, row_blocks = blockwise4.packed_length(n), blockwise4.num_blocks(n)
    codes = torch.empty((rows, row_bytes), dtype=torch.uint8, device=values.device)
    scale = torch.empty((rows, row_blocks), dtype=torch.float32, device=values.device)
    if n and rows:
        grid = (triton.cdiv(row_blocks, TILE_BLOCKS), rows)
        _quantize_kernel[grid](values, codes, scale, thresholds, n, row_bytes, row_blocks, BLOCKS=TILE_BLOCKS)
    return codes, scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, qmap: torch.Tensor, n: int | None = None) -> torch.Tensor:
    """fp32 values (rows, n) of packed ``codes`` (rows, ceil(n / 2)) under ``scale`` (rows, ceil(n / 128))."""
    codes, scale = codes.contiguous(), scale.contiguous()
    rows, row_bytes = codes.shape
    n = 2 * row_bytes if n is None else n
    if blockwise4.packed_length(n) != row_bytes:
        raise ValueError(f"{row_bytes} bytes of 4-bit codes hold {2 * row_bytes - 1} or {2 * row_bytes} values, "
                         f"not n={n}")
    out = torch.empty((rows, n), dtype=torch.float32, device=codes.device)
    if n and rows:
        row_blocks = blockwise4.num_blocks(n)
        grid = (triton.cdiv(row_blocks, TILE_BLOCKS), rows)
        _dequantize_kernel[grid](codes, scale, qmap, out, n, row_bytes, row_blocks, BLOCKS=TILE_BLOCKS)
    return out
