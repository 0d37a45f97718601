"""Blockwise 8-bit quantization in pure PyTorch: the reference every other backend is compared with.

Format (bitsandbytes' blockwise optimizer state): a flat state of ``n`` values is cut into blocks of 256;
``absmax[b]`` is the largest magnitude in block ``b`` and element ``i`` stores the code of the map value nearest
to ``value / absmax[i // 256]``. Dequantization is ``qmap[code] * absmax[block]``.

The functions work on 2-D views ``(rows, n)`` so that AdEMAMix's stacked ``(2, ...)`` state, whose rows have
separate absmax rows, goes through the same code as every other state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hf_optim.kernels.dynamic_map import BLOCK_SIZE, KEY_SHIFT, LOW_MASK, encoder_keys


def num_blocks(numel: int) -> int:
    """Number of 256-element blocks that cover ``numel`` elements."""
    return -(-numel // BLOCK_SIZE)


def _blocked(x: torch.Tensor) -> torch.Tensor:
    """View ``(rows, n)`` as ``(rows, blocks, 256)``, zero-padding the last block."""
    rows, n = x.shape
    pad = num_blocks(n) * BLOCK_SIZE - n
    if pad:
        x = F.pad(x, (0, pad))
    return x.view(rows, -1, BLOCK_SIZE)


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """fp32 values of ``codes`` (rows, n) under per-block ``absmax`` (rows, blocks)."""
    n = codes.shape[-1]
    values = torch.ops.aten._unsafe_index(qmap, [codes.int()])  # a uint8 code always indexes the 256-entry map
    scaled = _blocked(values) * absmax.unsqueeze(-1)
    return scaled.flatten(1)[:, :n]


def encode(normalized: torch.Tensor, table: torch.Tensor, signed: bool) -> torch.Tensor:
    """Nearest-code encoding of values in [-1, 1] through the packed table of :mod:`dynamic_map`."""
    bits = normalized.view(torch.int32)
    # The key always indexes the table (it is clamped); _unsafe_index lets torch.compile skip bounds checks.
    entry = torch.ops.aten._unsafe_index(table, [encoder_keys(bits)])
    further = ((bits & LOW_MASK) > (entry & LOW_MASK)).int()
    if signed:
        further = torch.where(bits < 0, -further, further)
    return ((entry >> KEY_SHIFT) + further).to(torch.uint8)


def quantize(values: torch.Tensor, table: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (rows, n) uint8 and absmax (rows, blocks) fp32 for fp32 ``values`` (rows, n)."""
    n = values.shape[-1]
    blocks = _blocked(values)
    absmax = blocks.abs().amax(dim=-1)
    # An all-zero block has absmax 0: divide by 1 so it encodes as exact zeros, not NaN.
    divisor = torch.where(absmax > 0, absmax, torch.ones_like(absmax)).unsqueeze(-1)
    codes = encode(blocks / divisor, table, signed)
    return codes.flatten(1)[:, :n], absmax
