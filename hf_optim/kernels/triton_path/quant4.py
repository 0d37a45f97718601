"""Blockwise 4-bit quantization in Triton: the twin of :mod:`hf_optim.formats.quant4`, same codes, same nibble
order and same scales; and the 4-bit format's Triton branch (:data:`BLOCKWISE4_ROWS`, see :mod:`rows`).

:func:`load_state4` / :func:`store_state4` read and write one 4-bit state row for a :mod:`tile` tile
``(BLOCKS, 2, ROWS, W)``: a 128-element quantization block is one half ``[:, h]`` of the tile, and the ``W`` codes of
a row (``W / 2`` bytes: element ``2i`` in the high nibble of byte ``i``, as torchao) are one 32-bit (``W = 8``) or
16-bit (``W = 4``) little-endian word, unpacked and packed with shifts inside the thread. Whole, aligned tiles access
each row's word with one load and one store; a tensor's last, partial tile (or an unaligned row, such as AdEMAMix's
second 4-bit row when ``n`` is not a multiple of 32) goes byte by byte, writing no byte beyond ``ceil(n / 2)``.

Same rules as the PyTorch path: the scale is the exact block absmax (NaN-propagating; an all-zero block has scale 0
and encodes the code of 0.0), values are divided with ``div_rn`` (correctly rounded, as torch), and the code is the
number of the map's encoder thresholds at or below the quotient (``quant4.encode``). The Triton encoders reach
that count without reading the thresholds, and are exact (``tests/formats/test_blockwise4.py`` checks every fp32 near
each threshold, both signs, and the special values):

- unsigned map ``k/16, k = 1..16``: its thresholds are the midpoints ``(2k + 1) / 32`` exactly, so the count is
  ``clamp(trunc(16 y - 0.5), 0, 15)``, with ``16 y - 0.5`` in one fma. ``16 y`` is exact, and ``16 y - 0.5`` is
  exact whenever ``16 y >= 1`` (both terms are multiples of ``ulp(16 y)`` and the difference is smaller than
  ``16 y``); below that it is under 0.5, so no integer boundary is ever crossed by rounding. The lower clamp is
  ``max.f32``, which returns 0 for NaN.
- signed tree map: with ``a = |y|``, a value ``y >= 0`` counts ``7 + #{P_i <= a}`` and a value ``y < 0`` counts
  ``7 - #{M_i < a}``, where ``P_i`` (8) are the positive thresholds and ``M_i`` (7: the largest value, 1.0, has no
  negative twin) the magnitudes of the negative ones (``M_i = P_i`` where the midpoint is an fp32 number, else the
  fp32 just below it). On the integer grid ``key = 2 * min(bits(a), bits(1.0)) - (y < 0)`` the tests of
  ``P_0..P_6`` and ``M_0..M_6`` become ``key >= S_i`` with one compile-time constant per threshold: ``S_i = 2 *
  bits(P_i)`` where the midpoint is exact, ``2 * bits(P_i) - 1`` where it is not (3 compares: a binary search);
  ``P_7`` is one fp32 compare of ``y`` (false for negative values). A NaN takes the negative side (``y >= 0`` is
  false) with a key above every ``S_i``: ``7 - 7``, code 0, as the threshold count.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_optim.formats import quant4
from hf_optim.formats.blockwise4 import shared_map as shared_map4
from hf_optim.kernels.triton_path.rows import FusedConfigLike, TritonRows
from hf_optim.kernels.triton_path.tile import (
    FP16,
    INTERPRETED,
    SM_64_WARPS,
    TRITON_VERSION,
    half_max,
    launch_options,
    masked_load,
    pointer,
    tile,
    zero_outside,
)


def signed_keys() -> list[int]:
    """The integer thresholds ``S_i`` of the signed map's encoder (see the module docstring), from the map's fp32
    thresholds: positive thresholds only (the negative ones are the same midpoints)."""
    qmap = quant4.qmap4(True).double()
    mids = (qmap[:-1] + qmap[1:]) / 2  # exact in float64
    positive = mids > 0
    thresholds = quant4.encoder_thresholds(True)[positive]
    exact = (mids[positive].float().double() == mids[positive])
    bits = thresholds.view(torch.int32).long()
    return [int(2 * b - (0 if e else 1)) for b, e in zip(bits, exact)]


_KEYS = signed_keys()
assert len(_KEYS) == 8 and _KEYS == sorted(_KEYS)
S0: tl.constexpr = tl.constexpr(_KEYS[0])
S1: tl.constexpr = tl.constexpr(_KEYS[1])
S2: tl.constexpr = tl.constexpr(_KEYS[2])
S3: tl.constexpr = tl.constexpr(_KEYS[3])
S4: tl.constexpr = tl.constexpr(_KEYS[4])
S5: tl.constexpr = tl.constexpr(_KEYS[5])
S6: tl.constexpr = tl.constexpr(_KEYS[6])
T7: tl.constexpr = tl.constexpr(float(quant4.encoder_thresholds(True)[-1]))
"""The signed map's largest threshold (between its two largest values), an fp32 number."""
ZERO_CODE: tl.constexpr = tl.constexpr(7)
"""The signed map's code of 0.0 (7 negative values below it)."""
ONE_BITS: tl.constexpr = tl.constexpr(0x3F800000)


@triton.jit
def _signed_code(count, negative, base):
    """``base + (count ^ negative) - negative``: ``base + count`` where ``negative`` is 0, ``base - count`` where it
    is -1. Compiled, spelled in PTX (an xor and a subtraction: ``LOP3`` and ``IADD3``): knowing that ``negative`` is
    0 or -1, LLVM turns the integer expression into selects and predicated moves, twice the instructions."""
    if INTERPRETED:
        codes = base + (count ^ negative) - negative
    else:
        codes = tl.inline_asm_elementwise(
            "{ .reg .b32 t; xor.b32 t, $1, $2; add.s32 t, $3, t; sub.s32 $0, t, $2; }",
            "=r,r,r,r", [count, negative, base], dtype=tl.int32, is_pure=True, pack=1)
    return codes


@triton.jit
def encode4(normalized, SIGNED: tl.constexpr):
    """Nearest 4-bit code (int32, 0..15) of values in [-1, 1]: ``quant4.encode``'s threshold count, computed
    without the thresholds (see the module docstring)."""
    if SIGNED:
        bits = normalized.to(tl.int32, bitcast=True)
        # -1 for negative values and NaN (a NaN then counts as a negative value beyond every threshold: code 0),
        # 0 for the rest, -0.0 included
        negative = tl.where(normalized >= 0.0, 0, -1)
        # magnitudes of 1.0 and above count every threshold; clamping keeps 2 * bits inside int32 (inf included)
        key = 2 * tl.minimum(bits & 0x7FFFFFFF, ONE_BITS) + negative
        # how many of S_0..S_6 are <= key (0..7): a binary search, 3 compares against selected constants
        four = key >= S3
        two = key >= tl.where(four, S5, S1)
        one = key >= tl.where(four, tl.where(two, S6, S4), tl.where(two, S2, S0))
        count = tl.where(four, 4, 0) + tl.where(two, 2, 0) + one.to(tl.int32)
        # 7 - count for negative values ((count ^ -1) + 1 = -count), 7 + count for the rest, plus 1.0's neighbour
        # S_7 (no negative twin), which a positive value reaches exactly when it is >= its fp32 threshold T_7
        codes = _signed_code(count, negative, tl.where(normalized >= T7, ZERO_CODE + 1, ZERO_CODE))
    else:
        # 16 y - 0.5 in one rounding: the same number as rounding 16 y (exact) and then subtracting 0.5; max(NaN, 0)
        # is 0 (NaN and values below 3/32 truncate to code 0)
        shifted = tl.minimum(tl.maximum(tl.fma(normalized, 16.0, -0.5), 0.0), 15.0)
        codes = shifted.to(tl.int32)
    return codes


@triton.jit
def decode4(codes, qmap_ptr, SIGNED: tl.constexpr):
    """Map values of int32 codes: the signed tree map is read (16 values, cached), the unsigned map is
    ``(code + 1) / 16``, computed exactly."""
    if SIGNED:
        values = tl.load(qmap_ptr + codes)
    else:
        values = (codes + 1).to(tl.float32) * 0.0625
    return values


@triton.jit
def nibble_shifts(W: tl.constexpr):
    """Bit position of each of a row's ``W`` codes in its little-endian word: element ``2i`` is the high nibble of
    byte ``i``."""
    j = tl.arange(0, W)
    return (j // 2) * 8 + (1 - j % 2) * 4


@triton.jit
def _byte_valid(rows, k: tl.constexpr, n, W: tl.constexpr):
    """Whether byte ``k`` of each row holds a code of the row's ``n`` elements (its first element is < n)."""
    return rows * W + 2 * k < n


@triton.jit
def _load_words(address, rows, mask, n, W: tl.constexpr, ALIGNED: tl.constexpr):
    """The little-endian word of each row's codes (int32): one load per row on whole aligned tiles, else bytes."""
    if (mask is None) and ALIGNED:
        if W == 8:
            words = tl.load(pointer(address, tl.uint32, True) + rows).to(tl.int32, bitcast=True)
        else:
            words = tl.load(pointer(address, tl.uint16, True) + rows).to(tl.int32)
    else:
        codes_ptr = address.to(tl.pointer_type(tl.uint8))
        words = tl.zeros(rows.shape, dtype=tl.int32)
        for k in tl.static_range(W // 2):
            valid = _byte_valid(rows, k, n, W) if mask is not None else None
            byte = masked_load(codes_ptr + rows * (W // 2) + k, valid, 0).to(tl.int32)
            words = words | (byte << (8 * k))
    return words


@triton.jit
def _store_words(address, rows, words, mask, n, W: tl.constexpr, ALIGNED: tl.constexpr):
    if (mask is None) and ALIGNED:
        if W == 8:
            tl.store(pointer(address, tl.uint32, True) + rows, words.to(tl.uint32, bitcast=True))
        else:
            tl.store(pointer(address, tl.uint16, True) + rows, words.to(tl.uint16))
    else:
        codes_ptr = address.to(tl.pointer_type(tl.uint8))
        for k in tl.static_range(W // 2):
            valid = _byte_valid(rows, k, n, W) if mask is not None else None
            tl.store(codes_ptr + rows * (W // 2) + k, ((words >> (8 * k)) & 255).to(tl.uint8), mask=valid)


@triton.jit
def per_half(values):
    """A ``(BLOCKS, 2)`` per-half value broadcast over the tile."""
    return values[:, :, None, None]


@triton.jit
def load_state4(address, scale_ptr, qmap_ptr, halves, rows, offs, mask, n, SIGNED: tl.constexpr,
                ALIGNED: tl.constexpr):
    """fp32 values (tile-shaped) of a 4-bit row: packed codes at ``address`` (an integer address or a pointer),
    fp32 scales at ``scale_ptr``; ``mask`` None: a whole tile, else ``n`` is the row's length."""
    W: tl.constexpr = offs.shape[3]
    words = _load_words(address, rows, mask, n, W, ALIGNED)
    codes = (words[:, :, :, None] >> nibble_shifts(W)[None, None, None, :]) & 15
    half_mask = None if mask is None else halves * 128 < n
    scale = masked_load(scale_ptr + halves, half_mask, 0.0)
    return decode4(codes, qmap_ptr, SIGNED) * per_half(scale)


@triton.jit
def quantize4(values, mask, SIGNED: tl.constexpr):
    """(codes packed per row (int32 words), scale per half) of fp32 tile ``values``; lanes outside ``mask`` are 0
    (the padding nibble of an odd length holds the code of 0.0, as the PyTorch path writes it)."""
    values = zero_outside(values, mask)
    scale = half_max(tl.abs(values))
    # An all-zero block has scale 0: divide by 1 so it encodes the code of 0.0, as the PyTorch twin does.
    divisor = tl.where(scale > 0, scale, 1.0)
    codes = encode4(tl.div_rn(values, per_half(divisor)), SIGNED)
    # the fields are disjoint, so their sum is the packed word (a reduction inside each thread)
    words = tl.sum(codes << nibble_shifts(values.shape[3])[None, None, None, :], axis=3)
    return words, scale


@triton.jit
def store_state4(address, scale_ptr, halves, rows, offs, values, mask, n, SIGNED: tl.constexpr,
                 ALIGNED: tl.constexpr):
    """Quantize fp32 ``values`` (tile-shaped) against their new block scales into a 4-bit row."""
    words, scale = quantize4(values, mask, SIGNED)
    _store_words(address, rows, words, mask, n, offs.shape[3], ALIGNED)
    # written by each half's first thread, from where the reduction left the scales (see
    # tile.store_per_block)
    lane = rows & (rows.shape[2] - 1)  # rows are non-negative; a power-of-two count per half
    first = lane == 0
    if mask is not None:
        first = first & (halves * 128 < n)[:, :, None]
    tl.store(scale_ptr + halves[:, :, None] + lane, scale[:, :, None] + tl.zeros(rows.shape, tl.float32),
             mask=first)


@triton.jit
def load_blockwise4(address, absmax_address, qmap, blocks, halves, rows, offs, mask, n, SIGNED: tl.constexpr,
                    ALIGNED: tl.constexpr, NATIVE: tl.constexpr):
    """fp32 values of a 4-bit row (the :mod:`rows` signature): ``qmap`` is the signed map (the unsigned one is
    computed)."""
    return load_state4(address, absmax_address.to(tl.pointer_type(tl.float32)), qmap, halves, rows, offs, mask, n,
                       SIGNED, ALIGNED)


@triton.jit
def store_blockwise4(address, absmax_address, encoder, blocks, halves, rows, offs, values, mask, n,
                     SIGNED: tl.constexpr, ALIGNED: tl.constexpr, NATIVE: tl.constexpr):
    store_state4(address, absmax_address.to(tl.pointer_type(tl.float32)), halves, rows, offs, values, mask, n,
                 SIGNED, ALIGNED)


def maps4(signed: bool, device: torch.device) -> tuple[torch.Tensor, None]:
    """The signed map for every row (:func:`decode4` reads it; the unsigned map is computed); the encoders read no
    table."""
    return shared_map4(True, device), None


def narrow_tile4(config: FusedConfigLike) -> bool:
    """4 elements per thread where 8 take more than 64 registers (50% occupancy on the SMs of 64 warps; the other
    arches stay under their limit): on sm_80 and sm_90 with stochastic rounding or fp16 parameters, and on sm_80 in
    two rows. Triton 3.8 (torch 2.14's) also on sm_90 in two rows: AdamW bf16 spills 68-72 bytes at 8 under the limit
    of 64 and takes 84-94 registers (31% occupancy) without it; 54-56 registers at 4, no spill. (At 8 a row of bf16
    is one 16-byte vector and its 4-bit codes one 32-bit word.)"""
    two_rows = len(config.formats) == 2
    if config.arch in SM_64_WARPS and (config.stochastic or config.param_dtype == FP16.value):
        return True
    return (config.arch == 80 and two_rows) or (config.arch == 90 and TRITON_VERSION < (3, 9) and two_rows)


def register_limit4(config: FusedConfigLike) -> int | None:
    """64 for whole tiles of width 8 on sm_90: AdamW with bf16 parameters and 4-bit state takes 68 registers there
    without a limit (Triton 3.9), and none spills with it."""
    return 64 if config.arch == 90 and config.full and config.whole_tile_width == 8 else None


BLOCKWISE4_ROWS = TritonRows("4-bit", load_blockwise4, store_blockwise4, maps=maps4, narrow_tile=narrow_tile4,
                             register_limit=register_limit4)
"""``BLOCKWISE4.triton_rows``."""


# ------------------------------------------------------------------------------------------------------------
# Standalone quantize / dequantize over (rows, n) tensors, the twins of quant4.quantize / dequantize.
TILE_BLOCKS = 2
W: tl.constexpr = tl.constexpr(8)


@triton.jit
def _quantize_kernel(values_ptr, codes_ptr, scale_ptr, n, row_bytes, row_blocks, SIGNED: tl.constexpr,
                     BLOCKS: tl.constexpr):
    row = tl.program_id(1)
    _, halves, rows, offs = tile(tl.program_id(0) * BLOCKS, BLOCKS, W)
    mask = offs < n
    values = tl.load(values_ptr + row * n + offs, mask=mask, other=0.0)
    store_state4(codes_ptr + row * row_bytes, scale_ptr + row * row_blocks, halves,
                 rows, offs, values, mask, n, SIGNED, False)


@triton.jit
def _dequantize_kernel(codes_ptr, scale_ptr, qmap_ptr, out_ptr, n, row_bytes, row_blocks, SIGNED: tl.constexpr,
                       BLOCKS: tl.constexpr):
    row = tl.program_id(1)
    _, halves, rows, offs = tile(tl.program_id(0) * BLOCKS, BLOCKS, W)
    mask = offs < n
    values = load_state4(codes_ptr + row * row_bytes, scale_ptr + row * row_blocks,
                         qmap_ptr, halves, rows, offs, mask, n, SIGNED, False)
    tl.store(out_ptr + row * n + offs, values, mask=mask)


def quantize(values: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed codes (rows, ceil(n / 2)) uint8 and scale (rows, ceil(n / 128)) fp32 of fp32 ``values`` (rows, n)."""
    values = values.contiguous()
    rows, n = values.shape
    row_bytes, row_blocks = quant4.packed_length(n), quant4.num_blocks(n)
    codes = torch.empty((rows, row_bytes), dtype=torch.uint8, device=values.device)
    scale = torch.empty((rows, row_blocks), dtype=torch.float32, device=values.device)
    if n and rows:
        grid = (triton.cdiv(row_blocks, 2 * TILE_BLOCKS), rows)
        _quantize_kernel[grid](values, codes, scale, n, row_bytes, row_blocks, SIGNED=bool(signed),
                               BLOCKS=TILE_BLOCKS, **launch_options())
    return codes, scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, qmap: torch.Tensor, n: int | None = None) -> torch.Tensor:
    """fp32 values (rows, n) of packed ``codes`` (rows, ceil(n / 2)) under ``scale`` (rows, ceil(n / 128));
    ``qmap`` is the 16-value map (its signedness picks the decoder)."""
    codes, scale = codes.contiguous(), scale.contiguous()
    rows, row_bytes = codes.shape
    n = 2 * row_bytes if n is None else n
    if quant4.packed_length(n) != row_bytes:
        raise ValueError(f"{row_bytes} bytes of 4-bit codes hold {2 * row_bytes - 1} or {2 * row_bytes} values, "
                         f"not n={n}")
    out = torch.empty((rows, n), dtype=torch.float32, device=codes.device)
    if n and rows:
        row_blocks = quant4.num_blocks(n)
        signed = bool(qmap.min() < 0)
        grid = (triton.cdiv(row_blocks, 2 * TILE_BLOCKS), rows)
        _dequantize_kernel[grid](codes, scale, qmap, out, n, row_bytes, row_blocks, SIGNED=signed,
                                 BLOCKS=TILE_BLOCKS, **launch_options())
    return out
