"""Blockwise 8-bit quantization in pure PyTorch: the reference every other backend is compared with.

Format (bitsandbytes' blockwise optimizer state): a flat state of ``n`` values is cut into blocks of 256;
``absmax[b]`` is the largest magnitude in block ``b`` and element ``i`` stores the code of the map value nearest
to ``value / absmax[i // 256]``. Dequantization is ``qmap[code] * absmax[block]``.

:func:`dequantize` and :func:`quantize` / :func:`quantize_into` read the map and the packed encoder table of
:mod:`dynamic_map` (the format's definition, the reference the tests compare with bitsandbytes, and what the
optimizers' PyTorch path runs). A table-free arithmetic of the same codes was measured slower on the CPU and on the
GPU; it lives with its proof in ``benchmarks/proofs/codebook8.py``.

The functions work on 2-D views ``(rows, n)`` so that AdEMAMix's stacked ``(2, ...)`` state, whose rows have
separate absmax rows, goes through the same code as every other state.
"""

from __future__ import annotations

import torch

from hf_optim.formats.dynamic_map import KEY_SHIFT, LOW_MASK, encoder_keys
from hf_optim.numerics import BLOCK_SIZE, padded_blocks


def num_blocks(numel: int) -> int:
    """Number of 256-element blocks that cover ``numel`` elements."""
    return -(-numel // BLOCK_SIZE)


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """fp32 values of ``codes`` (rows, n), or (rows, blocks, 256), under per-block ``absmax`` (rows, blocks)."""
    n = codes.shape[-1]
    # Codes may come as uint8 or as the int8 view the kernels pass (see quantize_into); & 255 makes either 0..255,
    # which always indexes the 256-entry map.
    values = torch.ops.aten._unsafe_index(qmap, [codes.int() & 255])
    scaled = padded_blocks(values) * absmax.unsqueeze(-1)
    return scaled if codes.dim() == 3 else scaled.flatten(1)[:, :n]


def encode_int8(normalized: torch.Tensor, table: torch.Tensor, signed: bool) -> torch.Tensor:
    """Nearest-code encoding of values in [-1, 1] through the packed table of :mod:`dynamic_map`, as the int8 bit
    patterns of the uint8 codes. (Inductor's CPU code narrows int32 to int8 about five times faster than to uint8,
    and reinterpreting a whole buffer is free outside the kernel: see :func:`quantize_into`.)"""
    bits = normalized.view(torch.int32)
    # The key always indexes the table (it is clamped); _unsafe_index lets torch.compile skip bounds checks.
    entry = torch.ops.aten._unsafe_index(table, [encoder_keys(bits)])
    further = ((bits & LOW_MASK) > (entry & LOW_MASK)).int()
    if signed:
        further = torch.where(bits < 0, -further, further)
    return ((entry >> KEY_SHIFT) + further).to(torch.int8)  # codes 0..255 wrap to their int8 bit patterns


def encode(normalized: torch.Tensor, table: torch.Tensor, signed: bool) -> torch.Tensor:
    """Nearest-code encoding (uint8 codes) of values in [-1, 1]."""
    return encode_int8(normalized, table, signed).view(torch.uint8)


def block_absmax(values: torch.Tensor) -> torch.Tensor:
    """The absmax (rows, blocks) of fp32 ``values`` (rows, n) or (rows, blocks, 256): what :func:`quantize` stores."""
    return padded_blocks(values).abs().amax(dim=-1)


def _normalized_blocks(values: torch.Tensor, absmax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(values / their block's absmax as (rows, blocks, 256), absmax (rows, blocks)); ``absmax``: the blocks' own
    (computed) when None."""
    blocks = padded_blocks(values)
    if absmax is None:
        absmax = blocks.abs().amax(dim=-1)
    # An all-zero block has absmax 0: divide by 1 so it encodes as exact zeros, not NaN.
    divisor = torch.where(absmax > 0, absmax, torch.ones_like(absmax)).unsqueeze(-1)
    return blocks / divisor, absmax


def quantize(values: torch.Tensor, table: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (rows, n) uint8 and absmax (rows, blocks) fp32 for fp32 ``values`` (rows, n)."""
    n = values.shape[-1]
    normalized, absmax = _normalized_blocks(values)
    return encode(normalized, table, signed).flatten(1)[:, :n], absmax


def quantize_into(values: torch.Tensor, table: torch.Tensor, signed: bool, codes: torch.Tensor,
                  absmax: torch.Tensor, scales: torch.Tensor | None = None) -> None:
    """:func:`quantize` written into ``codes`` and fp32 ``absmax``. The kernels pass ``codes`` as an int8 view of
    the uint8 state (``state_store.slot_tensors``): inside a compiled graph a dtype view of an input becomes a slow
    element-by-element bitcast, while outside it is free; uint8 ``codes`` work too (viewed here). ``scales``: the
    absmax to encode against (a whole tensor's, for part of it), instead of the blocks' own."""
    normalized, new_absmax = _normalized_blocks(values, scales)
    encoded = encode_int8(normalized, table, signed)
    codes.view(torch.int8).copy_(encoded if codes.dim() == 3 else encoded.flatten(1)[:, : values.shape[-1]])
    absmax.copy_(new_absmax)
