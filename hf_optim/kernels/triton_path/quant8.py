"""Blockwise 8-bit quantization in Triton: the twin of :mod:`hf_optim.formats.quant8`, same codes and absmax;
and :func:`load_state` / :func:`store_state`, through which every fused kernel reads and writes one state row.

A state row's format (fp32, 8-bit, 4-bit or fp8: ``hf_optim.formats`` codes) is a compile-time constant, so a
kernel holds only the path of its own formats. 8-bit rows dequantize as ``qmap[code] * absmax[block]`` and
re-quantize against the new per-block absmax with :mod:`encode8`'s encoder: the codes of
:mod:`hf_optim.formats.dynamic_map`'s nearest-code encoder (same tie and sign rules) from a 10 KiB table,
without dividing by the absmax (``formats.encode8`` has the method and its proof). 4-bit rows are :mod:`quant4`'s,
fp8 rows :mod:`fp8`'s. Tiles are :mod:`tile`'s ``(BLOCKS, 2, ROWS, W)`` offsets; whole tiles pass ``mask=None``.

The standalone :func:`quantize` / :func:`dequantize` take the arguments of their PyTorch twins (the encoder's tables
in place of the reference's packed table).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_optim.formats import BLOCKWISE4, BLOCKWISE8, FP8
from hf_optim.formats.encode8 import encoder8_tables
from hf_optim.formats.quant8 import num_blocks
from hf_optim.kernels.triton_path.encode8 import dequantize8, quantize8_params
from hf_optim.kernels.triton_path.encode8 import quantize8 as quantize8_codes
from hf_optim.kernels.triton_path.fp8 import load_state_fp8, quantize_fp8
from hf_optim.kernels.triton_path.quant4 import load_state4, store_state4
from hf_optim.kernels.triton_path.tile import (
    block_max,
    launch_options,
    masked_load,
    per_block,
    pointer,
    store_per_block,
    tile,
    zero_outside,
)

FORMAT_BLOCKWISE8: tl.constexpr = tl.constexpr(BLOCKWISE8.code)
FORMAT_BLOCKWISE4: tl.constexpr = tl.constexpr(BLOCKWISE4.code)
FORMAT_FP8: tl.constexpr = tl.constexpr(FP8.code)


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
def load_state(address, absmax_address, qmap_ptr, blocks, halves, rows, offs, mask, n,
               FORMAT: tl.constexpr, SIGNED: tl.constexpr, ALIGNED: tl.constexpr, FP8_NATIVE: tl.constexpr = False):
    """fp32 values of one state row of compile-time format ``FORMAT``: fp32 values at ``address``, or 8-bit, 4-bit
    or fp8 codes there with their absmax at ``absmax_address``; ``qmap_ptr``: the 8-bit map, or the signed 4-bit
    map. ``mask`` None: a whole tile; else ``n`` is the row's length. ``FP8_NATIVE``: the hardware's float8
    conversions (sm_89+), else :mod:`fp8`'s integer ones."""
    if FORMAT == FORMAT_BLOCKWISE8:
        block_mask = None if mask is None else blocks * 256 < n
        values = load_state8(pointer(address, tl.uint8, ALIGNED), absmax_address.to(tl.pointer_type(tl.float32)),
                             qmap_ptr, blocks, offs, mask, block_mask)
    elif FORMAT == FORMAT_BLOCKWISE4:
        values = load_state4(address, absmax_address.to(tl.pointer_type(tl.float32)), qmap_ptr, halves, rows, offs,
                             mask, n, SIGNED, ALIGNED)
    elif FORMAT == FORMAT_FP8:
        block_mask = None if mask is None else blocks * 256 < n
        values = load_state_fp8(pointer(address, tl.uint8, ALIGNED), absmax_address.to(tl.pointer_type(tl.float32)),
                                blocks, offs, mask, block_mask, SIGNED, FP8_NATIVE)
    else:
        values = masked_load(pointer(address, tl.float32, ALIGNED) + offs, mask, 0.0)
    return values


@triton.jit
def store_state(address, absmax_address, tables, blocks, halves, rows, offs, values, mask, n,
                FORMAT: tl.constexpr, SIGNED: tl.constexpr, ALIGNED: tl.constexpr, FP8_NATIVE: tl.constexpr = False):
    """Store fp32 ``values`` into one state row of format ``FORMAT``, re-quantizing an 8-bit (encoder tables
    ``tables``, see :func:`quantize8`), 4-bit or fp8 row against its new block absmax."""
    if FORMAT == FORMAT_BLOCKWISE8:
        block_mask = None if mask is None else blocks * 256 < n
        store_state8(pointer(address, tl.uint8, ALIGNED), absmax_address.to(tl.pointer_type(tl.float32)), tables,
                     blocks, rows, offs, values, mask, block_mask)
    elif FORMAT == FORMAT_BLOCKWISE4:
        store_state4(address, absmax_address.to(tl.pointer_type(tl.float32)), halves, rows, offs, values, mask, n,
                     SIGNED, ALIGNED)
    elif FORMAT == FORMAT_FP8:
        block_mask = None if mask is None else blocks * 256 < n
        codes, absmax = quantize_fp8(values, offs, mask, SIGNED, FP8_NATIVE)
        tl.store(pointer(address, tl.uint8, ALIGNED) + offs, codes, mask=mask)
        store_per_block(absmax_address.to(tl.pointer_type(tl.float32)), blocks, rows, absmax, block_mask)
    else:
        tl.store(pointer(address, tl.float32, ALIGNED) + offs, values, mask=mask)


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
