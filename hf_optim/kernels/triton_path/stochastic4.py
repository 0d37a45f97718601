"""The ``stochastic4`` state format in Triton: the twin of :mod:`hf_optim.formats.quant4_sr` (same codes, same
scales, same random bits), and its Triton branch (:data:`STOCHASTIC4_ROWS`, see :mod:`rows`).

In a :mod:`tile` tile ``(BLOCKS, 2, ROWS, W)`` a 256-element block's halves are ``[:, 0]`` and ``[:, 1]``; in the
format's planar layout both halves of a row ``r`` live in the same ``W`` bytes (``block * 128 + r * W + j``: element
``j`` of half 0 in the low nibble, of half 1 in the high nibble). Loading, the threads of both halves read those
bytes as words (32-bit, 16-bit for the partial tiles' rows of 2) and keep their own nibble. Storing, each half shifts
its codes into its nibble and a sum over the halves axis (a warp shuffle: the halves of a row are in one warp) joins
them into the words, which one thread writes. A tensor's last, partial tile masks by block: every byte and scale of a
block the tensor reaches is written, padding included, as the PyTorch path writes them.

Same rules as the PyTorch path: the scale is the exact absmax of a group of 64 elements (half a half's rows;
NaN-propagating; an all-zero group gets the reciprocal 1), its reciprocal is one ``div_rn`` (correctly rounded, as
torch), and the codes and the hash of the random bits are the same integer and fp32 operations in the same order (the
launches disable floating-point contraction).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_optim.formats import quant4_sr
from hf_optim.kernels.triton_path.rows import FusedConfigLike, TritonRows
from hf_optim.kernels.triton_path.tile import BF16, FP16, masked_load, pointer, zero_outside

FINE_STEP: tl.constexpr = tl.constexpr(quant4_sr.FINE_STEP)
COARSE_STEP: tl.constexpr = tl.constexpr(quant4_sr.COARSE_STEP)
LEVELS: tl.constexpr = tl.constexpr(quant4_sr.SIGNED_LEVELS)
SIGNED_ZERO: tl.constexpr = tl.constexpr(quant4_sr.SIGNED_ZERO)
FRACTION_BITS: tl.constexpr = tl.constexpr(quant4_sr.FRACTION_BITS)
FRACTION_MASK: tl.constexpr = tl.constexpr(quant4_sr.FRACTION_MASK)
FINE_SCALE: tl.constexpr = tl.constexpr(16.0 * 2**quant4_sr.FRACTION_BITS)
COARSE_SCALE: tl.constexpr = tl.constexpr(4.0 * 2**quant4_sr.FRACTION_BITS)
M0: tl.constexpr = tl.constexpr(quant4_sr.MULTIPLIERS[0])
M1: tl.constexpr = tl.constexpr(quant4_sr.MULTIPLIERS[1])
HALF: tl.constexpr = tl.constexpr(quant4_sr.HALF)
assert len(quant4_sr.MULTIPLIERS) == 2


@triton.jit
def sr_bits16(bits, lane):
    """``quant4_sr.sr_bits16``: 16 random bits (int32) from int32 ``bits`` and ``lane`` (0..255)."""
    a = ((bits ^ (bits >> 16)) ^ lane) & 0xFFFF
    a = (a * M0) & 0xFFFF
    a = a ^ (a >> 7)
    a = (a * M1) & 0xFFFF
    return a ^ (a >> 8)


@triton.jit
def sixteenths(codes):
    """``quant4_sr.sixteenths``: the signed map's value of codes 0..14 in sixteenths (int32)."""
    return (codes - SIGNED_ZERO) + 3 * (tl.maximum(codes - 11, 0) - tl.maximum(3 - codes, 0))


@triton.jit
def encode_sr4(y, lane, SIGNED: tl.constexpr):
    """Codes (int32) of normalized ``y``, rounded stochastically (``quant4_sr.encode_signed`` / ``encode_unsigned``
    with ``sr_bits16`` of ``y``'s bits and ``lane``)."""
    twice_random = 2 * sr_bits16(y.to(tl.int32, bitcast=True), lane)
    if SIGNED:
        a = tl.abs(y)
        coarse = a >= COARSE_STEP
        position = (a * tl.where(coarse, COARSE_SCALE, FINE_SCALE)).to(tl.int32)  # exact, then the floor
        up = ((position & FRACTION_MASK) > twice_random).to(tl.int32)
        k = tl.minimum((position >> FRACTION_BITS) + up + tl.where(coarse, 3, 0), LEVELS)
        codes = SIGNED_ZERO + tl.where(y < 0, -k, k)
    else:
        position = (y * FINE_SCALE).to(tl.int32)  # exact, then the floor (y >= 0)
        up = ((position & FRACTION_MASK) > twice_random).to(tl.int32)
        codes = tl.minimum(tl.maximum((position >> FRACTION_BITS) - 1 + up, 0), 15)
    return codes


@triton.jit
def decode_sr4(codes, table, SIGNED: tl.constexpr):
    """Map values of int32 codes: signed ones read from ``table`` (``quant4_sr.signed_table``, 16 fp32 values: one
    cached load instead of the six integer operations of ``sixteenths``; the same values), unsigned ones computed."""
    if SIGNED:
        values = tl.load(table + codes)
    else:
        values = (codes + 1).to(tl.float32) * 0.0625
    return values


@triton.jit
def _nibble_shift(blocks, halves):
    """0 for the first half of each block, 4 for the second, ``(BLOCKS, 2, 1)``."""
    return ((halves - 2 * blocks[:, None]) * 4)[:, :, None]


@triton.jit
def _max_with_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _groups(halves, rows):
    """Each row's scale group (64 elements: half of a half's rows), ``(BLOCKS, 2, ROWS)``, and whether the row is the
    group's first (the one that writes its scale)."""
    ROWS: tl.constexpr = rows.shape[2]
    within = rows & (ROWS - 1)  # the row's place in its half (rows per half: a power of two)
    second = (within >= ROWS // 2).to(tl.int32)
    return halves[:, :, None] * 2 + second, (within & (ROWS // 2 - 1)) == 0


@triton.jit
def group_max(values, rows):
    """Per-row maximum of ``values``' group of 64 elements (tile-shaped in, ``(BLOCKS, 2, ROWS)`` out),
    NaN-propagating within its group as torch's ``amax``: the row maxima, then one masked reduction over each half's
    rows per group (warp shuffles)."""
    BLOCKS: tl.constexpr = rows.shape[0]
    ROWS: tl.constexpr = rows.shape[2]
    row_max = tl.reduce(values, 3, _max_with_nan)
    grouped = tl.reduce(tl.reshape(row_max, (BLOCKS, 4, ROWS // 2)), 2, _max_with_nan)
    return tl.reshape(tl.broadcast_to(grouped[:, :, None], (BLOCKS, 4, ROWS // 2)), (BLOCKS, 2, ROWS))


@triton.jit
def _word_pointer(address, W: tl.constexpr, ALIGNED: tl.constexpr):
    """A row's codes as words: ``W`` bytes are ``W / 4`` 32-bit words, or one 16-bit word for ``W = 2`` (the
    partial tiles' rows)."""
    if W == 2:
        ptr = pointer(address, tl.uint16, ALIGNED)
    else:
        ptr = pointer(address, tl.uint32, ALIGNED)
    return ptr


@triton.jit
def load_stochastic4(address, absmax_address, qmap, blocks, halves, rows, offs, mask, n, SIGNED: tl.constexpr,
                     ALIGNED: tl.constexpr, NATIVE: tl.constexpr):
    """fp32 values of a ``stochastic4`` row (the :mod:`rows` signature; ``qmap``: the signed decoding table)."""
    W: tl.constexpr = offs.shape[3]
    WORD: tl.constexpr = 2 if W == 2 else 4  # bytes per word
    j = tl.arange(0, W)[None, None, None, :]
    shift = _nibble_shift(blocks, halves)
    # each row's W bytes as words (both halves load them), then the half's nibble of each code; a partial tile
    # reads the blocks the tensor reaches (all their bytes exist)
    within = rows & (rows.shape[2] - 1)
    words = _word_pointer(address, W, ALIGNED) + (blocks[:, None, None] * (HALF // WORD) + within * (W // WORD))
    row_mask = None if mask is None else (blocks * 256 < n)[:, None, None] & (within >= 0)
    first = (masked_load(words, row_mask, 0).to(tl.int32) >> shift)[:, :, :, None]
    if W == 8:
        second = (masked_load(words + 1, row_mask, 0).to(tl.int32) >> shift)[:, :, :, None]
        first = tl.where(j < 4, first, second)
    codes = (first >> ((j % 4) * 8)) & 15
    group, _ = _groups(halves, rows)
    scale_mask = None if mask is None else (blocks * 256 < n)[:, None, None] & (group >= 0)
    scale = masked_load(absmax_address.to(tl.pointer_type(tl.float32)) + group, scale_mask, 0.0)
    return decode_sr4(codes, qmap, SIGNED) * scale[:, :, :, None]


@triton.jit
def store_stochastic4(address, absmax_address, encoder, blocks, halves, rows, offs, values, mask, n,
                      SIGNED: tl.constexpr, ALIGNED: tl.constexpr, NATIVE: tl.constexpr):
    """Quantize fp32 ``values`` (tile-shaped) against their new group scales into a ``stochastic4`` row."""
    W: tl.constexpr = offs.shape[3]
    WORD: tl.constexpr = 2 if W == 2 else 4
    ROWS: tl.constexpr = rows.shape[2]
    values = zero_outside(values, mask)
    scale = group_max(tl.abs(values), rows)
    # one correctly rounded reciprocal per group (1 for an all-zero group), as the PyTorch twin
    inverse = tl.div_rn(1.0, tl.where(scale > 0, scale, 1.0))
    y = values * inverse[:, :, :, None]
    # each group's scale, written by the thread of its first row (first: its registers are free for the codes)
    group, writes = _groups(halves, rows)
    if mask is not None:
        writes = writes & (blocks * 256 < n)[:, None, None]
    tl.store(absmax_address.to(tl.pointer_type(tl.float32)) + group, scale, mask=writes)
    codes = encode_sr4(y, offs & 255, SIGNED)
    shift = _nibble_shift(blocks, halves)
    # a row's codes into words in the thread, each half's into its nibble, then the two halves' words joined by a sum
    # over the halves axis (disjoint bits; a warp shuffle) and stored as words: every byte of the blocks the tensor
    # reaches, padding included, as the PyTorch twin writes them
    j = tl.arange(0, W)[None, None, None, :]
    placed = codes << ((j % 4) * 8)
    first = tl.sum(tl.where(j < 4, placed, 0), axis=3) << shift
    words = _word_pointer(address, W, ALIGNED) + (blocks[:, None] * (HALF // WORD)
                                                  + tl.arange(0, ROWS)[None, :] * (W // WORD))
    row_mask = None if mask is None else (blocks * 256 < n)[:, None] & (tl.arange(0, ROWS)[None, :] >= 0)
    if W == 2:
        tl.store(words, tl.sum(first, axis=1).to(tl.uint16), mask=row_mask)
    else:
        tl.store(words, tl.sum(first, axis=1).to(tl.uint32, bitcast=True), mask=row_mask)
    if W == 8:
        second = tl.sum(tl.where(j >= 4, placed, 0), axis=3) << shift
        tl.store(words + 1, tl.sum(second, axis=1).to(tl.uint32, bitcast=True), mask=row_mask)


def maps_sr4(signed: bool, device: torch.device) -> tuple[torch.Tensor | None, None]:
    """The signed rows' decoding table (``quant4_sr.signed_table``); no encoder table."""
    return (quant4_sr.signed_table(torch.device(device)) if signed else None), None


def narrow_tile_sr4(config: FusedConfigLike) -> bool:
    """4 elements per thread where 8 need more registers than 50% occupancy allows and a limit spills (measured with
    ``python -m hf_optim.gpu_static``, Triton 3.9):

    - sm_80, two rows, bf16 parameters: 88-90 registers at 8 (31%), 16 bytes spilled with a limit of 80; at 4, 56
      registers, 56%, for 15% more instructions per element (fp16 parameters fit 80 at 8: :func:`register_limit_sr4`);
    - sm_90, stochastic rounding of bf16 parameters: 72-75 registers at 8, 8 bytes spilled with a limit of 64;
    - sm_90, RMSprop with fp16 parameters: 71 registers at 8, 24 bytes spilled with a limit of 64 (Lion, the other
      one-row rule, takes 54 there and stays at 8).
    """
    if config.arch == 90:
        return config.stochastic or (config.algorithm == "rmsprop" and config.param_dtype == FP16.value)
    return config.arch == 80 and len(config.formats) == 2 and config.param_dtype == BF16.value


def register_limit_sr4(config: FusedConfigLike) -> int | None:
    """The ``ptxas`` register limit for 50% occupancy or close to it, where it spills nothing (measured): 64 for every
    whole tile on sm_90 (AdamW with bf16 parameters takes 66 without it); on sm_80, 80 for whole tiles of width 8 in
    two rows (fp16 parameters: 37.5%, 85-88 registers without it) and 72 for three rows (AdEMAMix) with stochastic
    rounding (44%), where the fused kernel's limit of 64 for three rows spills 16 bytes."""
    if config.arch == 90 and config.full:
        return 64
    if config.arch != 80 or not config.full:
        return None
    if len(config.formats) == 2 and config.whole_tile_width == 8:
        return 80
    return 72 if len(config.formats) > 2 and config.stochastic else None


STOCHASTIC4_ROWS = TritonRows("4-bit SR", load_stochastic4, store_stochastic4, maps=maps_sr4,
                              narrow_tile=narrow_tile_sr4, register_limit=register_limit_sr4)
"""``STOCHASTIC4.triton_rows``."""
