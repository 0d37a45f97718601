"""Blockwise 8-bit quantization in Triton: the twin of :mod:`hf_optim.kernels.blockwise`, same codes and absmax.

The ``@triton.jit`` helpers here are the one place where Triton kernels handle precision; every fused optimizer
kernel loads and stores through them:

- :func:`load_values` / :func:`store_values`: fp32, bf16 or fp16 tensors (a runtime dtype code per tensor, so
  one launch serves mixed-precision parameters). bf16 is converted with integer bit operations, round to
  nearest even as torch does, because Triton's interpreter truncates when casting to bf16.
- :func:`load_state` / :func:`store_state`: one state row, fp32, 8-bit or 4-bit (a runtime format code per
  tensor, so tensors below ``min_8bit_size`` keep fp32 state in the same launch; the 4-bit helpers are
  :mod:`triton_blockwise4`'s). 8-bit rows dequantize as ``qmap[code] *
  absmax[block]`` and re-quantize with the new per-block absmax and the exact nearest-code encoder of
  :mod:`hf_optim.kernels.dynamic_map` (same packed table, same tie and sign rules).

Work is done in tiles of ``(BLOCKS, 256)``: one row per quantization block, so a block's absmax is a row max.
The standalone :func:`quantize` / :func:`dequantize` take the same arguments as their PyTorch twins.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_optim.kernels import dynamic_map as dm
from hf_optim.kernels.blockwise import num_blocks
from hf_optim.kernels.formats import BLOCKWISE4, BLOCKWISE8
from hf_optim.kernels.triton_blockwise4 import load_state4, store_state4

BLOCK: tl.constexpr = tl.constexpr(dm.BLOCK_SIZE)
KEY_SHIFT: tl.constexpr = tl.constexpr(dm.KEY_SHIFT)
KEY_OFFSET: tl.constexpr = tl.constexpr(dm.KEY_OFFSET)
KEYS_PER_SIGN: tl.constexpr = tl.constexpr(dm.KEYS_PER_SIGN)
LOW_MASK: tl.constexpr = tl.constexpr(dm.LOW_MASK)

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
"""Runtime dtype codes of :func:`load_values` / :func:`store_values`."""


def dtype_code(dtype: torch.dtype) -> int:
    if dtype not in DTYPE_CODES:
        raise TypeError(f"hf_optim's Triton kernels take float32, bfloat16 or float16 tensors, got {dtype}")
    return DTYPE_CODES[dtype]


@triton.jit
def tile_offsets(first_block, BLOCKS: tl.constexpr):
    """(block indices (BLOCKS,), element offsets (BLOCKS, 256)) of a tile starting at ``first_block``."""
    blocks = first_block + tl.arange(0, BLOCKS)
    return blocks, blocks[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]


@triton.jit
def bf16_to_fp32(bits):
    return (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def fp32_to_bf16(values):
    """Round to nearest even (NaN stays a quiet NaN), as torch's float -> bfloat16 conversion."""
    bits = values.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(values != values, 0x7FC0, rounded).to(tl.uint16)


@triton.jit
def pointer(address, TYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """A typed pointer from an integer address; ``ALIGNED`` promises 16-byte alignment (the host checked), which
    with a tile-structured mask lets the compiler use vector loads and stores."""
    ptr = address.to(tl.pointer_type(TYPE))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def load_values(address, dtype, offs, mask, ALIGNED: tl.constexpr = False):
    """fp32 values of a float tensor at integer ``address`` whose dtype code is ``dtype`` (0 fp32, 1 bf16, 2 fp16)."""
    if dtype == 0:
        values = tl.load(pointer(address, tl.float32, ALIGNED) + offs, mask=mask, other=0.0)
    elif dtype == 1:
        values = bf16_to_fp32(tl.load(pointer(address, tl.uint16, ALIGNED) + offs, mask=mask, other=0))
    else:
        values = tl.load(pointer(address, tl.float16, ALIGNED) + offs, mask=mask, other=0.0).to(tl.float32)
    return values


@triton.jit
def store_values(address, dtype, offs, values, mask, ALIGNED: tl.constexpr = False):
    """Store fp32 ``values`` into a float tensor of dtype code ``dtype``, rounding to nearest even."""
    if dtype == 0:
        tl.store(pointer(address, tl.float32, ALIGNED) + offs, values, mask=mask)
    elif dtype == 1:
        tl.store(pointer(address, tl.uint16, ALIGNED) + offs, fp32_to_bf16(values), mask=mask)
    else:
        tl.store(pointer(address, tl.float16, ALIGNED) + offs, values.to(tl.float16), mask=mask)


@triton.jit
def encode(normalized, table_ptr, SIGNED: tl.constexpr):
    """Nearest code of values in [-1, 1] through the packed encoder table (see ``dynamic_map``): one lookup."""
    bits = normalized.to(tl.int32, bitcast=True)
    key = ((bits & 0x7FFFFFFF) >> KEY_SHIFT) - KEY_OFFSET
    key = tl.minimum(tl.maximum(key, 0), KEYS_PER_SIGN - 1) + tl.where(bits < 0, KEYS_PER_SIGN, 0)
    entry = tl.load(table_ptr + key)
    further = ((bits & LOW_MASK) > (entry & LOW_MASK)).to(tl.int32)
    if SIGNED:
        further = tl.where(bits < 0, -further, further)
    return ((entry >> KEY_SHIFT) + further).to(tl.uint8)


@triton.jit
def dequantize_tile(codes_ptr, absmax_ptr, qmap_ptr, blocks, offs, mask, block_mask):
    codes = tl.load(codes_ptr + offs, mask=mask, other=0)
    absmax = tl.load(absmax_ptr + blocks, mask=block_mask, other=0.0)
    return tl.load(qmap_ptr + codes.to(tl.int32)) * absmax[:, None]


@triton.jit
def quantize_tile(values, mask, table_ptr, SIGNED: tl.constexpr):
    """(codes, absmax per block) of fp32 ``values`` (BLOCKS, 256); lanes outside ``mask`` count as 0."""
    values = tl.where(mask, values, 0.0)
    absmax = tl.max(tl.abs(values), axis=1)
    # An all-zero block has absmax 0: divide by 1 so it encodes as exact zeros, as the PyTorch twin does.
    divisor = tl.where(absmax > 0, absmax, 1.0)
    return encode(tl.div_rn(values, divisor[:, None]), table_ptr, SIGNED), absmax


FORMAT_BLOCKWISE8: tl.constexpr = tl.constexpr(BLOCKWISE8.code)
FORMAT_BLOCKWISE4: tl.constexpr = tl.constexpr(BLOCKWISE4.code)


@triton.jit
def load_state(address, absmax_address, fmt, qmap_ptr, qmap4_ptr, blocks, offs, mask, block_mask,
               ALIGNED: tl.constexpr = False):
    """fp32 values of one state row in format ``fmt`` (a runtime code, see ``hf_optim.kernels.formats``): fp32
    values at ``address``, or 8-bit (``qmap_ptr``) or 4-bit (``qmap4_ptr``) codes there with their absmax."""
    if fmt == FORMAT_BLOCKWISE8:
        values = dequantize_tile(
            pointer(address, tl.uint8, ALIGNED), absmax_address.to(tl.pointer_type(tl.float32)), qmap_ptr,
            blocks, offs, mask, block_mask,
        )
    elif fmt == FORMAT_BLOCKWISE4:
        values = load_state4(address.to(tl.pointer_type(tl.uint8)), absmax_address.to(tl.pointer_type(tl.float32)),
                             qmap4_ptr, offs, mask)
    else:
        values = tl.load(pointer(address, tl.float32, ALIGNED) + offs, mask=mask, other=0.0)
    return values


@triton.jit
def store_state(address, absmax_address, fmt, table_ptr, thresholds4_ptr, blocks, offs, values, mask, block_mask,
                SIGNED: tl.constexpr, ALIGNED: tl.constexpr = False):
    """Store fp32 ``values`` into one state row of format ``fmt``, re-quantizing an 8-bit (encoder table
    ``table_ptr``) or 4-bit (``thresholds4_ptr``) row against its new block absmax."""
    if fmt == FORMAT_BLOCKWISE8:
        codes, absmax = quantize_tile(values, mask, table_ptr, SIGNED)
        tl.store(pointer(address, tl.uint8, ALIGNED) + offs, codes, mask=mask)
        tl.store(absmax_address.to(tl.pointer_type(tl.float32)) + blocks, absmax, mask=block_mask)
    elif fmt == FORMAT_BLOCKWISE4:
        store_state4(address.to(tl.pointer_type(tl.uint8)), absmax_address.to(tl.pointer_type(tl.float32)),
                     thresholds4_ptr, offs, values, mask)
    else:
        tl.store(pointer(address, tl.float32, ALIGNED) + offs, values, mask=mask)


# ------------------------------------------------------------------------------------------------------------
# Standalone quantize / dequantize over (rows, n) tensors, the twins of blockwise.quantize / dequantize.
TILE_BLOCKS = 4


@triton.jit
def _quantize_kernel(values_ptr, codes_ptr, absmax_ptr, table_ptr, n, blocks_per_row,
                     SIGNED: tl.constexpr, BLOCKS: tl.constexpr):
    row = tl.program_id(1)
    blocks, offs = tile_offsets(tl.program_id(0) * BLOCKS, BLOCKS)
    mask = offs < n
    block_mask = blocks < blocks_per_row
    values = tl.load(values_ptr + row * n + offs, mask=mask, other=0.0)
    codes, absmax = quantize_tile(values, mask, table_ptr, SIGNED)
    tl.store(codes_ptr + row * n + offs, codes, mask=mask)
    tl.store(absmax_ptr + row * blocks_per_row + blocks, absmax, mask=block_mask)


@triton.jit
def _dequantize_kernel(codes_ptr, absmax_ptr, qmap_ptr, out_ptr, n, blocks_per_row, BLOCKS: tl.constexpr):
    row = tl.program_id(1)
    blocks, offs = tile_offsets(tl.program_id(0) * BLOCKS, BLOCKS)
    mask = offs < n
    block_mask = blocks < blocks_per_row
    values = dequantize_tile(
        codes_ptr + row * n, absmax_ptr + row * blocks_per_row, qmap_ptr, blocks, offs, mask, block_mask
    )
    tl.store(out_ptr + row * n + offs, values, mask=mask)


def quantize(values: torch.Tensor, table: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (rows, n) uint8 and absmax (rows, blocks) fp32 for fp32 ``values`` (rows, n)."""
    values = values.contiguous()
    rows, n = values.shape
    blocks = num_blocks(n)
    codes = torch.empty((rows, n), dtype=torch.uint8, device=values.device)
    absmax = torch.empty((rows, blocks), dtype=torch.float32, device=values.device)
    if n:
        grid = (triton.cdiv(blocks, TILE_BLOCKS), rows)
        _quantize_kernel[grid](values, codes, absmax, table, n, blocks, SIGNED=bool(signed), BLOCKS=TILE_BLOCKS)
    return codes, absmax


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """fp32 values of ``codes`` (rows, n) under per-block ``absmax`` (rows, blocks)."""
    codes, absmax = codes.contiguous(), absmax.contiguous()
    rows, n = codes.shape
    out = torch.empty((rows, n), dtype=torch.float32, device=codes.device)
    if n:
        blocks = num_blocks(n)
        grid = (triton.cdiv(blocks, TILE_BLOCKS), rows)
        _dequantize_kernel[grid](codes, absmax, qmap, out, n, blocks, BLOCKS=TILE_BLOCKS)
    return out
