"""4-bit state rounded stochastically (the ``stochastic4`` format's math), in pure PyTorch.

Why (measured, docs/lab/2026-measurements.md, "4-bit state at 8-bit quality"): an optimizer state is an EMA that is
re-quantized every step, and each step moves it by a small fraction (``1 - beta``: 10% for Adam's ``m``, 0.1% for
``v``) of a quantization gap. Rounded to nearest, such a state sticks to its code (the move never reaches half a gap)
or drifts by the map's rounding bias step after step; both change the run by several percent (``blockwise4``: 3-11%
on the MLP of ``benchmarks/quality/quality4.py``, Lion 4-6%), whatever the map or block size. Rounded stochastically
between its two neighbouring codes, up with probability equal to its position between them, a state is unbiased, so
an EMA keeps its small moves in expectation; the maps below were then chosen for the smallest gap to fp32 state.

Codes, per element, of a value ``x`` in a group of 64 elements with scale ``s`` (the group's absmax):

- signed states (first moments): 15 codes ``0..14``, ``7 + k`` for ``k = -7..7``, magnitudes ``0, 1/16, 2/16, 3/16,
  4/16, 2/4, 3/4, 1`` (times ``s``, with ``k``'s sign): linear in two segments, steps of 1/16 up to 1/4 and of 1/4
  above (exact in fp32); code 15 is never written. Symmetric, so the block maximum is exact for either sign
  (torchao's tree map has +1 but not -1: the largest negative element of a block shrank by 11% at every step), and
  fine near 0, where most of a block's values are: Lion's slowly moving momentum ends 3.7% above fp32 state with it,
  7% with 15 evenly spaced levels (the step 1/7 near 0), 4.2% with a square law ``(k / 7)**2`` (whose encoder needs a
  search for its interval: this one needs a compare). Each segment is a uniform grid, so rounding in it is cheap and
  unbiased.
- unsigned states (second moments): 16 codes, value ``(code + 1) / 16 * s``: the linear map without zero of Li et
  al. (a small ``v`` never becomes 0). Values under ``s / 16`` round up to it.

Rounding: with ``y = x * r``, ``r`` the correctly rounded ``1 / s`` of the group (1 for an all-zero group: one
division per group, none per element), ``t = |y| * 16`` below 1/4 and ``|y| * 4`` from 1/4 on (signed) or ``y * 16``
(unsigned), the map value below ``t`` is number ``floor(t)`` of its segment, and the one above is chosen when ``q >
2 u``, where ``q = floor(frac(t) * 2**17)`` and ``u`` are 16 pseudo-random bits (:func:`sr_bits16`). In integers:
``i = int(t * 2**17)`` (exact: a power-of-two scaling, truncated), ``floor(t) = i >> 17``, ``q = i & (2**17 - 1)``. The
probability is ``ceil(q / 2) / 2**16``, within ``2**-17`` of ``frac(t)`` either way: the rounding is unbiased. (``|y|``
may exceed 1 by an ulp for the largest element: it takes the largest code.) The bits are a hash of ``y``'s fp32
bits and the element's lane in its 256-element block, so every path (per tensor or in multi-tensor chunks, eager,
compiled, Triton) draws the same bits for the same value, and a rerun repeats a run exactly. A value that does not
change (no gradient, a block that only decays) keeps its bits; a value exactly on a map value is stored exactly.
Over 2M values (uniform, or near map values as decaying states are) the rounding's mean error is zero to within the
standard error of truly random bits (``tests/formats/test_stochastic4.py``).

Scales: fp32, one per group of 64 elements (four per 256-element block): measured against 128 (one per half
block, as ``blockwise4``), 64 takes AdamW's and AdEMAMix's gaps to fp32 state from up to +1.4% to within +0.7% and
Lion's from +3.8% to +2.8%, for 1/32 byte more per element (0.5625 bytes per element and slot).

Layout (planar nibbles, for vectorized CPU code): the codes of a 256-element block are 128 bytes; byte ``i`` holds
element ``i`` in its low nibble and element ``128 + i`` in its high nibble, so both halves unpack with one shift or
mask over contiguous bytes. A tensor of ``n`` elements has ``128 * ceil(n / 256)`` bytes of codes and ``4 * ceil(n /
256)`` scales per row (its last block zero-padded: a zero pads as the code of 0.0 when signed and of ``s / 16`` when
unsigned, never read back).

Forms: flat ``(rows, n)`` (per-tensor path; AdEMAMix stacks two rows) or the multi-tensor kernels' block form
``(rows, blocks, 256)`` values with ``(rows, blocks, 128)`` codes and ``(rows, 4 * blocks)`` scales. The Triton twin is
``hf_optim.kernels.triton_path.stochastic4``; inductor compiles this module's operations to vectorized loops (every
index is affine in the block forms ``(rows, blocks, 2, 128)`` of the codes and ``(rows, blocks, 4, 64)`` of the
scales).
"""

from __future__ import annotations

import functools

import torch

from hf_optim.numerics import BLOCK_SIZE, exact_math, padded_blocks

HALF = BLOCK_SIZE // 2
"""Elements per nibble plane of a 256-element block (its codes are ``HALF`` bytes)."""
GROUP = 64
"""Elements per scale."""
GROUPS = BLOCK_SIZE // GROUP
"""Scales per 256-element block."""

SIGNED_ZERO = 7
"""The signed code of 0.0."""

FINE_STEP, COARSE_STEP = 0.0625, 0.25
"""The signed map's segments: magnitudes ``k / 16`` for ``k <= 4`` (up to 1/4), ``(k - 3) / 4`` above."""

SIGNED_LEVELS = 7
UNSIGNED_STEP = 0.0625
FRACTION_BITS = 17
"""Bits of a value's position between its two map values that the rounding compares with the random bits (one more
than the 16 random bits, so that the probability is centred on the position)."""
FRACTION_MASK = (1 << FRACTION_BITS) - 1

# The hash's constants: odd multipliers below 2**15, so every product of a 16-bit value fits in int32 on every path.
MULTIPLIERS = (0x7FEB, 0x6F4D)


def sixteenths(codes: torch.Tensor) -> torch.Tensor:
    """The signed map's value of int32 codes 0..14 in sixteenths (int32, exact): ``k = code - 7`` up to magnitude
    4, and 3 more sixteenths per step beyond (``5 -> 8``, ``6 -> 12``, ``7 -> 16``)."""
    return (codes - SIGNED_ZERO) + 3 * (torch.clamp(codes - 11, min=0) - torch.clamp(3 - codes, min=0))


def signed_value(k: torch.Tensor) -> torch.Tensor:
    """The signed map's value of int32 ``k`` in -7..7, fp32 (without its scale)."""
    return sixteenths(k + SIGNED_ZERO).float() * FINE_STEP


SIGNED_MAP = signed_value(torch.arange(-SIGNED_LEVELS, SIGNED_LEVELS + 1, dtype=torch.int32))
"""The 15 signed map values, sorted (code ``c`` is entry ``c``)."""
UNSIGNED_MAP = (torch.arange(16, dtype=torch.float32) + 1) * UNSIGNED_STEP
"""The 16 unsigned map values (code ``c`` is entry ``c``)."""


@functools.cache
def signed_table(device: torch.device) -> torch.Tensor:
    """The signed map as 16 fp32 entries on ``device`` (code 15, never written, reads 0): the Triton twin's decoder
    reads it (one cached load against six integer operations), cached per device so its address stays valid."""
    return torch.cat([SIGNED_MAP, torch.zeros(1)]).to(device)


def num_blocks(numel: int) -> int:
    """256-element blocks covering ``numel`` elements."""
    return -(-numel // BLOCK_SIZE)


def code_bytes(numel: int) -> int:
    """Bytes of codes per row of ``numel`` elements (whole blocks: 128 per block)."""
    return HALF * num_blocks(numel)


def scale_count(numel: int) -> int:
    """fp32 scales per row of ``numel`` elements (four per block)."""
    return GROUPS * num_blocks(numel)


def sr_bits16(bits: torch.Tensor, lane: torch.Tensor) -> torch.Tensor:
    """16 pseudo-random bits (int32 in [0, 65536)) per element: a hash of int32 ``bits`` (an fp32 value's pattern) and
    its ``lane`` (0..255, broadcastable): the two 16-bit halves and the lane folded by xor, then two multiply-xorshift
    rounds on 16 bits. Every intermediate stays below 2**31: no overflow on any path."""
    a = ((bits ^ (bits >> 16)) ^ lane) & 0xFFFF
    a = (a * MULTIPLIERS[0]) & 0xFFFF
    a = a ^ (a >> 7)
    a = (a * MULTIPLIERS[1]) & 0xFFFF
    return a ^ (a >> 8)


def lanes(device: torch.device) -> torch.Tensor:
    """Lane of each element of a ``(..., 2, 128)`` half-block view, int32 ``(2, 128)``."""
    return torch.arange(BLOCK_SIZE, dtype=torch.int32, device=device).view(2, HALF)


def encode_signed(y: torch.Tensor, random: torch.Tensor) -> torch.Tensor:
    """Signed codes (int32 0..14) of normalized ``y`` (in [-1, 1]), rounded stochastically with ``random`` bits."""
    a = y.abs()
    coarse = a >= COARSE_STEP  # 1/4 and above: steps of 1/4 (codes 4..7), below: steps of 1/16 (codes 0..4)
    position = (a * torch.where(coarse, 4.0 * 2**FRACTION_BITS, 16.0 * 2**FRACTION_BITS)).int()  # exact, then floor
    up = ((position & FRACTION_MASK) > 2 * random).int()
    k = torch.clamp((position >> FRACTION_BITS) + up + torch.where(coarse, 3, 0), max=SIGNED_LEVELS)  # |y| > 1: 7
    return SIGNED_ZERO + torch.where(y < 0, -k, k)


def encode_unsigned(y: torch.Tensor, random: torch.Tensor) -> torch.Tensor:
    """Unsigned codes (int32 0..15) of normalized ``y`` (in [0, 1]), rounded stochastically with ``random`` bits."""
    position = (y * (16.0 * 2**FRACTION_BITS)).int()  # exact, then the floor (y >= 0)
    up = ((position & FRACTION_MASK) > 2 * random).int()
    return torch.clamp((position >> FRACTION_BITS) - 1 + up, 0, 15)


def decode(codes: torch.Tensor, signed: bool) -> torch.Tensor:
    """Map values (fp32) of int32 codes, without a table."""
    if signed:
        return sixteenths(codes).float() * FINE_STEP
    return (codes + 1).float() * UNSIGNED_STEP


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """``(..., 128)`` bytes (uint8 or their int8 view) as int32 codes ``(..., 2, 128)`` (low nibbles, high nibbles)."""
    byte = packed.int() & 255
    return torch.stack([byte & 15, byte >> 4], dim=-2)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """int32 codes ``(..., 2, 128)`` as bytes ``(..., 128)``, int8 bit patterns (inductor narrows to int8 fastest)."""
    return (codes[..., 0, :] | (codes[..., 1, :] << 4)).to(torch.int8)


def quantize_blocks(values: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 packed codes ``(rows, B, 128)``, scales ``(rows, B, 4)``) of fp32 ``(rows, B, 256)`` values."""
    rows, blocks = values.shape[:2]
    groups = values.view(rows, blocks, GROUPS, GROUP)
    scale = groups.abs().amax(dim=-1)
    # An all-zero group has scale 0: its reciprocal is taken as 1, so it encodes the code of 0.0 (decoded as 0).
    inverse = exact_math.div(1.0, torch.where(scale > 0, scale, torch.ones_like(scale)))
    y = (groups * inverse.unsqueeze(-1)).view(rows, blocks, 2, HALF)
    random = sr_bits16(y.view(torch.int32), lanes(values.device))
    codes = encode_signed(y, random) if signed else encode_unsigned(y, random)
    return pack(codes), scale


def quantize_into(values: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, signed: bool) -> None:
    """Quantize fp32 ``values`` (flat ``(rows, n)`` or block form ``(rows, B, 256)``) into ``codes`` (uint8 or int8,
    ``(rows, 128 * blocks)`` or ``(rows, B, 128)``) and ``scale`` (``(rows, 4 * blocks)``)."""
    packed, new_scale = quantize_blocks(padded_blocks(values), signed)
    codes.view(torch.int8).view(packed.shape).copy_(packed)
    scale.view(new_scale.shape).copy_(new_scale)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, signed: bool, n: int | None = None) -> torch.Tensor:
    """fp32 values of ``codes``: block form ``(rows, B, 128)`` gives ``(rows, B, 256)``; flat ``(rows, 128 * blocks)``
    gives ``(rows, n)`` (``n`` default: every element of the blocks)."""
    rows = codes.shape[0]
    blocked = codes.view(rows, -1, HALF)
    groups = decode(unpack(blocked), signed).view(rows, -1, GROUPS, GROUP)
    values = groups * scale.view(rows, -1, GROUPS).unsqueeze(-1)
    if codes.dim() == 3:
        return values.view(rows, codes.shape[1], BLOCK_SIZE)
    flat = values.view(rows, -1)
    return flat if n is None else flat[:, :n]


def quantize(values: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 codes, fp32 scales) of flat fp32 ``values`` ``(rows, n)``: ``(rows, 128 * blocks)`` and ``(rows, 4 *
    blocks)``."""
    if values.dim() != 2:
        raise ValueError(f"4-bit values must be (rows, n), got shape {tuple(values.shape)}")
    rows, n = values.shape
    codes = torch.empty((rows, code_bytes(n)), dtype=torch.uint8, device=values.device)
    scale = torch.empty((rows, scale_count(n)), dtype=torch.float32, device=values.device)
    quantize_into(values, codes, scale, signed)
    return codes, scale
