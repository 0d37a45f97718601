"""The 8-bit dynamic maps as arithmetic: decode and encode without a table (the PyTorch reference of that arithmetic).

Research, not part of the library: proven, and on no optimizer's path. The CPU path and the Triton kernels decode
and encode through the map and the encoder table, which measured faster: compiled by inductor for an AVX2 CPU, this
decode took 1.4x the map lookup's time and this encode 3.5x the table's (``benchmarks/performance/cpu_codec.py``;
the arithmetic is 25-60 vector operations per element against a lookup's eight scalar loads, while the fp32/int32
reinterpretations cost nothing measurable), and a Triton twin raised the 8-bit AdamW kernel from 98 to 312
instructions per element (docs/benchmarks.md).

The maps of :mod:`hf_optim.formats.dynamic_map` hold, per decade ``e`` (0..6), the fp32 midpoints of ``linspace(0.1,
1, n + 1)`` (``n = 2**e`` signed, ``2**(e + 1)`` unsigned) times ``10**(e - 6)``. Their values are reproduced bit
for bit by fp32 arithmetic from a handful of constants (``benchmarks/proofs/test_codebook8.py`` checks all 256 codes
of each map, ``benchmarks/proofs/encoder8_proof.py`` prints the check):

**Magnitude codes.** A signed code ``c`` has magnitude code ``a = |c - 127|`` (0..128; 128 is the code of 1.0, which
only positive values have) and the sign of ``c - 127``; an unsigned code is its own magnitude code. Let ``j = a``
(signed) or ``a + 1`` (unsigned): then ``j = 2**E + k`` with ``0 <= k < 2**E`` and ``E = e`` (signed) or ``e + 1``
(unsigned), so the fp32 number ``float(j) = 2**E * (1 + t)`` carries the decade in its exponent and the bin's
position ``t = k / 2**E`` in its mantissa, exactly. ``m = 1 + t`` is ``float(j)`` with its exponent set to 0 and
``m' = float(j + 1) / 2**E`` (an exponent subtraction) is the next bin's, up to 2.0.

**Values.** ``linspace``'s element at fraction ``t`` is ``fma(step, t - 1 + 1, 0.1f)`` below the middle and
``fma(step, t - 1, 1.0f)`` from it, with ``step = 1.0f - 0.1f`` (torch's CPU linspace rounds each element once, from
the nearer end; its step ``(1 - 0.1) / n`` is ``step / n`` exactly, and ``(step / n) * k = step * t``): with ``m =
1 + t``, :func:`_linspace_at` is ``fma(STEP, m - 1, 0.1f)`` for ``m < 1.5`` and ``fma(STEP, m - 2, 1.0f)`` from 1.5
on. The map value is ``rn(rn(L(m) + L(m')) * H[e])``, ``H[e] = fp32(10**(e - 6)) / 2`` (bitsandbytes' ``(lo + hi) /
2`` then ``* scale``; halving is exact). Decade 7 (only the magnitude code of 1.0 reaches it) gets the constant
whose product with its sum rounds to 1.0, and a zero magnitude code has no decade: ``H = 0``.

**Encode** (nearest map value, exact ties toward zero, bitsandbytes' sign fix, as ``dynamic_map``'s reference): the
position of a magnitude ``q`` on the code axis is, in decade ``e``, the line ``P_e(q) = base_e + n_e * (q / 10**(e -
6) - 0.1) / 0.9`` (code ``g`` sits at ``g + 0.5``); the lines meet at the decade bounds with slopes falling fivefold,
so the position is their minimum. ``G = trunc(min(min_e(q * SLOPE_e + CUT_e), G_max))`` (``CUT_e`` includes the
``-0.5``; fp32 multiply then add, each rounded) is the nearest magnitude code or the one below it (the proof shows it
for every fp32), and one compare settles it: up when ``q`` is not at or below the reference's midpoint ``rn(rn(v_G
+ v_{G+1}) * 0.5)``, computed from the two decoded values exactly as the reference computes its midpoints. ``G_max``
(127 positive, 126 negative, 254 unsigned) keeps the pair inside the map; values past 1 (a NaN block's absmax
divides by 1) and NaN (``not <=``) go to the end code, as the table encoder did.

Machine independence: every fp32 operation here is one IEEE rounding. The fma of :func:`_linspace_at` is computed
in float64, where ``STEP * (m - off) + c`` is exact (31 significant bits of product, 35 bits of span), so the one
rounding to fp32 is the fma's whether or not a compiler contracts the float64 operations. Inductor compiles
without contraction (``exact_math``); the Triton twin uses ``tl.fma``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hf_optim.formats.dynamic_map import ZERO_CODE_SIGNED

DECADES = 7
ONE_BITS = 0x3F800000
EXPONENT_MASK = 0x7F800000
MANTISSA_MASK = 0x007FFFFF


def _f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


START = _f32(0.1)
"""linspace's start, 0.1 in fp32."""
STEP = _f32(1.0 - START)
"""linspace's span ``1.0f - 0.1f``, rounded to fp32 (0.89999998)."""


def _sum_at_top(signed: bool) -> float:
    """``rn(L(m) + L(m'))`` of the magnitude code of 1.0 (decade 7)."""
    top = torch.tensor([128 if signed else 256], dtype=torch.int32)
    m, m_next, _ = _fractions(top)
    return float(_linspace_at(m) + _linspace_at(m_next))


def _top_factor(signed: bool) -> float:
    """The smallest fp32 factor whose product with the decade-7 sum rounds to 1.0 or more (for the unsigned map no
    fp32 factor gives exactly 1.0: the value is then capped at 1.0, which no other code reaches)."""
    total = torch.tensor(_sum_at_top(signed), dtype=torch.float32)
    factor = torch.tensor(1.0, dtype=torch.float32) / total
    down, up = torch.tensor(float("-inf")), torch.tensor(float("inf"))
    while float(total * factor) >= 1.0:
        factor = torch.nextafter(factor, down)
    while float(total * factor) < 1.0:
        factor = torch.nextafter(factor, up)
    return float(factor)


def _fractions(j: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(m, m', E)`` of positive int32 ``j`` (see the module docstring): ``m`` = ``float(j)`` with exponent 0,
    ``m'`` = ``float(j + 1) / 2**E``, ``E`` = the exponent of ``float(j)`` (int32)."""
    bits = j.float().view(torch.int32)
    exponent = (bits >> 23) - 127
    m = ((bits & MANTISSA_MASK) | ONE_BITS).view(torch.float32)
    m_next = ((j + 1).float().view(torch.int32) - (exponent << 23)).view(torch.float32)
    return m, m_next, exponent


def _linspace_at(m: torch.Tensor) -> torch.Tensor:
    """fp32 ``linspace(0.1, 1, n + 1)`` at fraction ``m - 1`` (``m`` in [1, 2], a multiple of ``1 / n``), as torch's
    CPU kernel rounds it: ``fma(STEP, m - 1, 0.1f)`` below the middle, ``fma(STEP, m - 2, 1.0f)`` from it; the fma in
    float64, where it is exact."""
    low = m < 1.5
    offset = torch.where(low, 1.0, 2.0)
    end = torch.where(low, START, 1.0)
    return ((m - offset).double() * STEP + end.double()).float()


def _half_scales(signed: bool) -> list[float]:
    """``H[e]`` for decades 0..7 (see the module docstring)."""
    return [_f32(10.0 ** (e - 6)) * 0.5 for e in range(DECADES)] + [_top_factor(signed)]


HALF_SCALES = {signed: _half_scales(signed) for signed in (True, False)}
"""Per map, ``H[0..7]``: fp32 constants (each an exact fp32 number)."""


def _decade_factor(decade: torch.Tensor, signed: bool) -> torch.Tensor:
    """``H[decade]`` (0.0 outside 0..7), by compares against constants (a register select on the GPU)."""
    factor = torch.zeros(decade.shape, dtype=torch.float32, device=decade.device)
    for e, h in enumerate(HALF_SCALES[signed]):
        factor = torch.where(decade == e, h, factor)
    return factor


def decode_magnitude(magnitude: torch.Tensor, signed: bool) -> torch.Tensor:
    """fp32 map values of int32 magnitude codes (signed: 0..128, 128 being 1.0; unsigned: the codes 0..255)."""
    j = magnitude if signed else magnitude + 1
    m, m_next, exponent = _fractions(j)
    decade = exponent if signed else exponent - 1
    # magnitude code 0 (signed: j = 0) has exponent -127 and unsigned code 0 decade -1: no factor, value 0.0
    value = (_linspace_at(m) + _linspace_at(m_next)) * _decade_factor(decade, signed)
    return torch.clamp_max(value, 1.0)  # the code of 1.0 (decade 7) rounds to 1.0 or one ulp above


def decode(codes: torch.Tensor, signed: bool) -> torch.Tensor:
    """fp32 map values of codes (any integer dtype, or the int8 view of uint8 codes): ``dynamic_map(signed)[code]``
    bit for bit, without reading the map."""
    codes = codes.int() & 255
    if not signed:
        return decode_magnitude(codes, False)
    centred = codes - ZERO_CODE_SIGNED
    value = decode_magnitude(centred.abs(), True)
    return torch.where(centred < 0, -value, value)


def _lines(signed: bool) -> list[tuple[float, float]]:
    """(SLOPE_e, CUT_e) per decade, fp32 numbers: ``P_e(q) - 0.5 = q * SLOPE_e + CUT_e``."""
    lines, base = [], 1  # both maps: decade 0 starts at magnitude code 1
    for e in range(DECADES):
        count = 2**e if signed else 2 ** (e + 1)
        lines.append((_f32(count / (0.9 * 10.0 ** (e - 6))), _f32(base - count / 9 - 0.5)))
        base += count
    return lines


LINES = {signed: _lines(signed) for signed in (True, False)}
TOP_PAIR = {True: 127, False: 254}
"""The largest pair (its lower magnitude code) a positive value guesses."""


def guess(magnitude: torch.Tensor, signed: bool, top: torch.Tensor | int) -> torch.Tensor:
    """int32 ``G``: the nearest magnitude code of fp32 ``magnitude`` (>= 0, or NaN) or the one below it, at most
    ``top`` (see the module docstring)."""
    position = None
    for slope, cut in LINES[signed]:
        line = magnitude * slope + cut
        position = line if position is None else torch.minimum(position, line)
    top = torch.as_tensor(top, dtype=torch.float32) if not isinstance(top, torch.Tensor) else top.float()
    return torch.where(position < top, position, top).int()  # NaN: the top pair


def midpoint(pair: torch.Tensor, signed: bool) -> torch.Tensor:
    """The reference's fp32 midpoint ``rn(rn(v_G + v_{G+1}) * 0.5)`` between magnitude codes ``G`` and ``G + 1``."""
    return (decode_magnitude(pair, signed) + decode_magnitude(pair + 1, signed)) * 0.5


def encode(normalized: torch.Tensor, signed: bool) -> torch.Tensor:
    """int32 codes (0..255) of fp32 values: nearest map value, exact ties toward zero, bitsandbytes' sign fix (a value
    with the sign bit set, -0.0 included, never takes the 0.0 code of the signed map); the reference's codes for
    every fp32 in [-1, 1] and every finite value beyond."""
    return encode_with(normalized, signed, midpoint)


def encode_with(normalized: torch.Tensor, signed: bool, midpoint_of: Callable[[torch.Tensor, bool], torch.Tensor]
                ) -> torch.Tensor:
    """:func:`encode` with the pair's midpoint from ``midpoint_of(pair, signed)`` (the proof passes a lookup of the
    midpoints it has shown equal to :func:`midpoint` for every pair)."""
    normalized = normalized.float()
    negative = normalized.view(torch.int32) < 0
    magnitude = normalized.abs()
    if signed:
        top = torch.where(negative, TOP_PAIR[True] - 1, TOP_PAIR[True])
    else:
        top = TOP_PAIR[False]
    pair = guess(magnitude, signed, top)
    settled = pair + (~(magnitude <= midpoint_of(pair, signed))).int()  # NaN goes up
    if not signed:
        return torch.where(negative, 0, settled)
    settled = torch.maximum(settled, negative.int())  # sign fix: a negative magnitude code is at least 1
    return ZERO_CODE_SIGNED + torch.where(negative, -settled, settled)
