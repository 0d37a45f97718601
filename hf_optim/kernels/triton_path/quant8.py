"""Blockwise 8-bit quantization in Triton: the twin of :mod:`hf_optim.formats.quant8`, same codes and absmax; and
the 8-bit format's Triton branch (:data:`BLOCKWISE8_ROWS`, see :mod:`rows`), through which the fused kernels read and
write an 8-bit state row.

8-bit rows dequantize as ``qmap[code] * absmax[block]`` and re-quantize against the new per-block absmax with
:mod:`encode8`'s encoder: the codes of :mod:`hf_optim.formats.dynamic_map`'s nearest-code encoder (same tie and sign
rules) from a 10 KiB table, without dividing by the absmax (``formats.encode8`` has the method and its proof). Tiles
are :mod:`tile`'s ``(BLOCKS, 2, ROWS, W)`` offsets; whole tiles pass ``mask=None``.

The standalone :func:`quantize` / :func:`dequantize` take the arguments of their PyTorch twins (the encoder's tables
in place of the reference's packed table).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_optim.formats.blockwise8 import shared_map as shared_map8
from hf_optim.formats.encode8 import encoder8_tables
from hf_optim.formats.quant8 import num_blocks
from hf_optim.kernels.triton_path.encode8 import dequantize8, quantize8_params
from hf_optim.kernels.triton_path.encode8 import quantize8 as quantize8_codes
from hf_optim.kernels.triton_path.rows import FusedConfigLike, TritonRows
from hf_optim.kernels.triton_path.tile import (
    BF16,
    TRITON_VERSION,
    block_max,
    launch_options,
    masked_load,
    per_block,
    pointer,
    store_per_block,
    tile,
    zero_outside,
)


@triton.jit
def load_state8(codes_ptr, absmax_ptr, qmap_ptr, blocks, offs, mask, block_mask):
    """fp32 values ``qmap[code] * absmax[block]`` of an 8-bit row."""
    codes = masked_load(codes_ptr + offs, mask, 0)
    absmax = masked_load(absmax_ptr + blocks, block_mask, 0.0)
    return dequantize8(codes, per_block(absmax), qmap_ptr)


@triton.jit
def quantize8(values, mask, tables):
    """(uint8 codes, absmax per 256-block) of fp32 tile ``values``; lanes outside ``mask`` count as 0. ``tables``:
    the map's ``encode8.encoder8_tables`` (int32 pointer; it carries the map's signedness). The block's divisor
    (absmax, or 1 for an all-zero block, as the PyTorch twin divides) is prepared once per block."""
    values = zero_outside(values, mask)
    absmax = block_max(tl.abs(values))
    scale, norm, reciprocal = quantize8_params(absmax)
    return quantize8_codes(values, per_block(scale), per_block(norm), per_block(reciprocal), tables), absmax


@triton.jit
def store_state8(codes_ptr, absmax_ptr, tables, blocks, rows, offs, values, mask, block_mask):
    codes, absmax = quantize8(values, mask, tables)
    tl.store(codes_ptr + offs, codes, mask=mask)
    store_per_block(absmax_ptr, blocks, rows, absmax, block_mask)


@triton.jit
def load_blockwise8(address, absmax_address, qmap, blocks, halves, rows, offs, mask, n, SIGNED: tl.constexpr,
                    ALIGNED: tl.constexpr, NATIVE: tl.constexpr):
    """fp32 values of an 8-bit row: codes at ``address``, absmax at ``absmax_address``, ``qmap`` the slot's map (the
    :mod:`rows` signature)."""
    block_mask = None if mask is None else blocks * 256 < n
    return load_state8(pointer(address, tl.uint8, ALIGNED), absmax_address.to(tl.pointer_type(tl.float32)), qmap,
                       blocks, offs, mask, block_mask)


@triton.jit
def store_blockwise8(address, absmax_address, encoder, blocks, halves, rows, offs, values, mask, n,
                     SIGNED: tl.constexpr, ALIGNED: tl.constexpr, NATIVE: tl.constexpr):
    """Re-quantize fp32 ``values`` into an 8-bit row against their new block absmax, with the slot's encoder tables
    ``encoder`` (see :func:`quantize8`)."""
    block_mask = None if mask is None else blocks * 256 < n
    store_state8(pointer(address, tl.uint8, ALIGNED), absmax_address.to(tl.pointer_type(tl.float32)), encoder,
                 blocks, rows, offs, values, mask, block_mask)


def maps8(signed: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The slot's map (decoding) and its encoder's tables (``encode8.encoder8_tables``): kernel arguments rather than
    a table of addresses, so the kernel reads them from its constant bank, with no load."""
    return shared_map8(signed, device), encoder8_tables(signed, device)


def narrow_tile8(config: FusedConfigLike) -> bool:
    """Triton 3.8 only: AdamW with bf16 parameters and 8-bit state in two rows spills 4 bytes at 8 elements per thread
    on sm_75 with no limit set; 59 registers at 4."""
    return (config.arch == 75 and TRITON_VERSION < (3, 9) and config.param_dtype == BF16.value
            and len(config.formats) == 2)


BLOCKWISE8_ROWS = TritonRows("8-bit", load_blockwise8, store_blockwise8, maps=maps8, narrow_tile=narrow_tile8)
"""``BLOCKWISE8.triton_rows``. Its other tiles take the fused configuration's own width: 8 elements per thread make a
256-element block one warp (its absmax: warp shuffles); at 4 a block spans two warps (a reduction through shared
memory, 16 bytes)."""


# ------------------------------------------------------------------------------------------------------------
# Standalone quantize / dequantize over (rows, n) tensors, the twins of formats.quant8.quantize / dequantize.
TILE_BLOCKS = 4
W: tl.constexpr = tl.constexpr(8)


@triton.jit
def _quantize_kernel(values_ptr, codes_ptr, absmax_ptr, tables, n, blocks_per_row, BLOCKS: tl.constexpr):
    row = tl.program_id(1)
    blocks, _, rows, offs = tile(tl.program_id(0) * BLOCKS, BLOCKS, W)
    mask = offs < n
    values = tl.load(values_ptr + row * n + offs, mask=mask, other=0.0)
    store_state8(codes_ptr + row * n, absmax_ptr + row * blocks_per_row, tables, blocks, rows, offs, values, mask,
                 blocks < blocks_per_row)


@triton.jit
def _dequantize_kernel(codes_ptr, absmax_ptr, qmap_ptr, out_ptr, n, blocks_per_row, BLOCKS: tl.constexpr):
    row = tl.program_id(1)
    blocks, _, _, offs = tile(tl.program_id(0) * BLOCKS, BLOCKS, W)
    mask = offs < n
    values = load_state8(codes_ptr + row * n, absmax_ptr + row * blocks_per_row, qmap_ptr, blocks, offs, mask,
                         blocks < blocks_per_row)
    tl.store(out_ptr + row * n + offs, values, mask=mask)


def quantize(values: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (rows, n) uint8 and absmax (rows, blocks) fp32 for fp32 ``values`` (rows, n) with the signed or
    unsigned map."""
    values = values.contiguous()
    rows, n = values.shape
    blocks = num_blocks(n)
    codes = torch.empty((rows, n), dtype=torch.uint8, device=values.device)
    absmax = torch.empty((rows, blocks), dtype=torch.float32, device=values.device)
    if n and rows:
        grid = (triton.cdiv(blocks, TILE_BLOCKS), rows)
        _quantize_kernel[grid](values, codes, absmax, encoder8_tables(bool(signed), values.device), n, blocks,
                               BLOCKS=TILE_BLOCKS, **launch_options())
    return codes, absmax


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """fp32 values of ``codes`` (rows, n) under per-block ``absmax`` (rows, blocks)."""
    codes, absmax = codes.contiguous(), absmax.contiguous()
    rows, n = codes.shape
    out = torch.empty((rows, n), dtype=torch.float32, device=codes.device)
    if n and rows:
        blocks = num_blocks(n)
        grid = (triton.cdiv(blocks, TILE_BLOCKS), rows)
        _dequantize_kernel[grid](codes, absmax, qmap, out, n, blocks, BLOCKS=TILE_BLOCKS, **launch_options())
    return out
