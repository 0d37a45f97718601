"""The arithmetic 8-bit encoder's table and its PyTorch twin (the model of the Triton code that the proof and the
tests run).

The encoder (:mod:`hf_optim.kernels.triton_path.encode8`) returns the codes of the reference encoder of
:mod:`hf_optim.formats.dynamic_map` (round to nearest against the map's fp32 midpoints, exact ties to the code
nearer zero, bitsandbytes' sign fix) without its 48 KiB table and without dividing by the block's absmax: it guesses
a pair of neighbouring codes from a piecewise-linear position function, then settles the pair with one exact
comparison. Everything below is built from the map itself; ``benchmarks/proofs/encoder8_proof.py`` proves the result.

**Guess.** In decade ``i`` (magnitudes ``[10**(i-7), 10**(i-6))``) the map holds ``n_i`` evenly spaced codes (signed
``2**i``, unsigned ``2**(i+1)``), so the fractional code index of a magnitude ``q`` is the line ``P_i(q) = base_i +
n_i * (q / 10**(i-6) - 0.1) / 0.9``: code ``m`` sits at ``m + 0.5``, the midpoint between codes ``m - 1`` and ``m``
near ``m``. Neighbouring decades' lines meet at ``10**(i-6)`` and the slopes fall fivefold per decade, so the
position is concave, the minimum of the lines; a binade ``[2**e, 2**(e+1))`` meets at most two decades. So each
(sign, exponent) key of :func:`line_table` holds two lines, and ``G = floor(min(line1, line2) - 0.5)`` is the
nearest magnitude code or the one below it. Intercepts carry ``MAGIC``: the fp32 result lies in ``[MAGIC, MAGIC +
256)``, whose ulp is 1/8, so its bit pattern's low bits are ``8 * (code pair index) + fraction`` and ``bits & 0x7F8``
is the byte offset of the pair's entry (8-byte rows). Any bit pattern masks to an offset inside the table.

Pairs are indexed in signed code order: the pair ``(k, k + 1)`` of codes, entry ``k`` holding the map midpoint
``mu`` between them (the reference's ``(qmap[k] + qmap[k+1]) * 0.5``). A positive magnitude guess ``G`` is pair
``zero + G``; a negative value (signed map) is pair ``126 - G``, which its row's lines give directly: they are
stored negated (``-(MAGIC + 127.5 - P)``), so their minimum is minus the maximum of the mirrored lines, and a
constant line in the top binades caps the pair at 0 (``-1.0`` encodes as code 0). Unsigned maps send every
negative value to pair 0 (code 0).

**Settling.** The code is ``k + 1`` when the quotient ``x = s / absmax``, rounded to fp32, is above ``mu`` (above or
equal for a negative ``mu``: ties go toward zero); that is ``x > mu + hu`` with ``hu`` half an ulp of ``mu``, signed
like ``mu`` (``x`` never equals the bound exactly). With ``a`` the block's absmax and ``s`` the value, scaled by the
same power of two, this is the sign of ``d = fma(-a, hu, fma(-a, mu, s))``: the inner fma is exact whenever ``|s -
a*mu| < 2 * a * ulp(mu)``, and elsewhere its sign alone decides. So the quotient itself is never needed: an
approximate reciprocal feeds the guess. Entry 126 of a signed map never moves up (the sign fix: a negative value,
-0.0 included, never encodes as the 0.0 code 127); entry 255 is never reached by a finite input.

Twin: :func:`fma32` is an exact fp32 fused multiply-add on CPU tensors (float64 and an error-free transformation);
:func:`encode_twin` and :func:`quantize_twin` repeat the Triton arithmetic operation by operation.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from hf_optim.formats.dynamic_map import ZERO_CODE_SIGNED, create_dynamic_map
from hf_optim.numerics import BLOCK_SIZE

MAGIC = 2.0**20
"""In every line's intercept: positions 0..256 share the binade ``[2**20, 2**21)``, whose ulp is 1/8."""
ENTRY_MASK = 0x7F8
"""``bits(position) & ENTRY_MASK`` is 8 times the entry index: the entry's byte offset."""
LINE_KEYS = 512
"""Rows of :func:`line_table`, keyed by an fp32 value's top 9 bits (sign and exponent)."""
ENTRIES = 256
"""Rows of :func:`entry_table`."""
LINE_BYTES = 16
ENTRY_BYTES = 8
ENTRIES_AT = LINE_KEYS * LINE_BYTES
"""Byte offset of the entries in :func:`encoder8_tables`."""
TOP_PAIR = 254
"""The last pair (codes 254 and 255)."""
NEVER_UP = (2.0, 2.0)
"""``(mu, hu)`` of an entry whose pair always settles on its lower code: ``fma(norm, 2, fma(norm, 2, -s))`` is
positive for every ``|s| <= norm`` (and for an infinite norm: no ``inf * 0``)."""
CAPPED_EXPONENT = 126
"""Rows from this exponent up (magnitudes 0.5 and above) carry the cap line: no pair past the map's end."""
SCALE_BIAS = 253 << 23
"""Block scale bits ``max(SCALE_BIAS - exponent bits of the divisor, MIN_SCALE_BITS)``: ``2**(126 - exponent)``,
at least ``2**-126``: the scaled divisor ``norm`` is in [0.5, 1) for a normal divisor below 2**126, [2**-23, 0.5)
for a subnormal one, [1, 4) from 2**126 up, and infinite for an infinite absmax (whose reciprocal, 0, turns every
finite value's guess into +-0, its reference code)."""
MIN_SCALE_BITS = 1 << 23
RECIPROCAL_TOLERANCE = 2.0**-17
"""Relative error of the block reciprocal under which the proof shows every code exact (PTX's ``rsqrt.approx.f32``,
squared, is within about 2**-21)."""


def _decade_lines(signed: bool) -> list[tuple[float, float]]:
    """(slope, intercept) in float64 of each decade's position line ``P_i``."""
    lines, base = [], 1
    for decade in range(7):
        count = 2**decade if signed else 2 ** (decade + 1)
        lines.append((count / (0.9 * 10.0 ** (decade - 6)), base - count / 9))
        base += count
    return lines


def _decade_of(value: float) -> int:
    """Decade whose line is the position at ``value`` (neighbouring lines cross at 1e-6, 1e-5, ..., 0.1)."""
    decade = 0
    while decade < 6 and value >= 10.0 ** (decade - 6):
        decade += 1
    return decade


def _build_lines(signed: bool) -> torch.Tensor:
    decade_lines = _decade_lines(signed)
    zero = ZERO_CODE_SIGNED if signed else 0
    rows = torch.zeros(LINE_KEYS, 4, dtype=torch.float64)
    for key in range(LINE_KEYS):
        negative, exponent = key >> 8, key & 255
        if negative and not signed:
            rows[key] = torch.tensor([0.0, MAGIC + 0.5] * 2)  # pair 0: every negative value encodes as code 0
            continue
        if exponent >= 128:  # magnitudes of 2 and above (only where a NaN absmax passes values through)
            pair = [None, None]
        elif exponent >= CAPPED_EXPONENT:
            pair = [decade_lines[6], None]
        else:
            first = _decade_of(2.0 ** (exponent - 127))
            pair = [decade_lines[first], decade_lines[min(first + 1, 6)]]
        for column, line in zip((0, 2), pair):
            if negative:  # -(MAGIC + 127.5 - P(|q|)) with P(|q|) = -slope * q + intercept, or the cap at pair 0
                slope, intercept = (0.0, -(MAGIC + 0.5)) if line is None else (-line[0], -(MAGIC + 127.5 - line[1]))
            else:
                slope, intercept = (0.0, MAGIC + TOP_PAIR + 0.5) if line is None else (line[0],
                                                                                        MAGIC + zero + line[1] - 0.5)
            rows[key, column], rows[key, column + 1] = slope, intercept
    return rows.float()  # the fp32 roundings of these constants are the encoder's: the proof runs on them


def _half_ulp(x: torch.Tensor) -> torch.Tensor:
    """Half the fp32 spacing next to nonzero normal fp32 ``x``, away from zero, signed like ``x``."""
    return (torch.nextafter(x, torch.copysign(torch.tensor(float("inf")), x)) - x) * 0.5


def _build_entries(signed: bool) -> torch.Tensor:
    qmap = create_dynamic_map(signed)
    mu = (qmap[1:] + qmap[:-1]) * 0.5  # the reference's fp32 midpoints, pairs 0..254
    hu = _half_ulp(mu)
    mu, hu = torch.cat([mu, torch.tensor([NEVER_UP[0]])]), torch.cat([hu, torch.tensor([NEVER_UP[1]])])
    if signed:  # sign fix: pair (126, 127) always settles on 126 (only negative values reach it)
        mu[ZERO_CODE_SIGNED - 1], hu[ZERO_CODE_SIGNED - 1] = NEVER_UP
    return torch.stack([mu, hu], dim=1)


@functools.cache
def _tables_cpu(signed: bool) -> torch.Tensor:
    lines = _build_lines(signed).view(torch.int32).flatten()
    entries = _build_entries(signed).view(torch.int32).flatten()
    return torch.cat([lines, entries]).contiguous()


@functools.cache
def _tables_on(signed: bool, device: torch.device) -> torch.Tensor:
    return _tables_cpu(signed).to(device)


def encoder8_tables(signed: bool, device: torch.device | str = "cpu") -> torch.Tensor:
    """The encoder's table for the signed or unsigned map on ``device`` (cached): 2560 int32 (10 KiB), the
    :func:`line_table` rows (16 bytes each) then the :func:`entry_table` rows (8 bytes each) from byte
    ``ENTRIES_AT``."""
    return _tables_on(signed, torch.device(device))


def line_table(signed: bool) -> torch.Tensor:
    """fp32 ``(512, 4)``: per key (an fp32 value's sign and exponent bits) two lines ``(slope, intercept)``."""
    return _tables_cpu(signed)[: LINE_KEYS * 4].view(torch.float32).view(LINE_KEYS, 4)


def entry_table(signed: bool) -> torch.Tensor:
    """fp32 ``(256, 2)``: per code pair ``(k, k + 1)`` the map midpoint ``mu`` and its signed half ulp ``hu``."""
    return _tables_cpu(signed)[LINE_KEYS * 4:].view(torch.float32).view(ENTRIES, 2)


# ------------------------------------------------------------------------------------------------------------
# The twin: the Triton arithmetic in exact fp32 on CPU tensors.
def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a * b + c`` rounded once to fp32 (to nearest even), elementwise for fp32 tensors, as a hardware fma.

    The product of two fp32 values is exact in float64, and TwoSum gives the float64 sum with its exact error.
    Rounding that sum to fp32 is correct unless the sum lies exactly halfway between two fp32 values while the exact
    result does not (nonzero error): then the error's sign picks the side.
    """
    a, b, c = torch.broadcast_tensors(a.double(), b.double(), c.double())
    product = a * b
    total = product + c
    back = total - product
    error = (product - (total - back)) + (c - back)
    nearest = total.float()
    residual = total - nearest.double()
    other = torch.nextafter(nearest, torch.where(residual > 0, float("inf"), float("-inf")).float())
    tie = (residual != 0) & (other.double() - total == total - nearest.double()) & (error != 0)
    result = torch.where(tie & ((error > 0) == (residual > 0)), other, nearest)
    return torch.where(torch.isfinite(total), result, (product + c).float())


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


Fma = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def guess_pairs(guess: torch.Tensor, signed: bool, fma: Fma = fma32) -> torch.Tensor:
    """Pair index (0..255, int64) the Triton code derives from the fp32 ``guess`` values (``fma``: an exact fp32
    fused multiply-add, default :func:`fma32`)."""
    lines = line_table(signed)[((_bits(guess) >> 23) & (LINE_KEYS - 1)).long()]
    position = torch.fmin(fma(guess, lines[..., 0], lines[..., 1]), fma(guess, lines[..., 2], lines[..., 3]))
    return ((_bits(position) & ENTRY_MASK) >> 3).long()


def settle(pairs: torch.Tensor, scaled: torch.Tensor, norm: torch.Tensor, signed: bool, fma: Fma = fma32
           ) -> torch.Tensor:
    """uint8 codes: each pair's upper code where ``fma(norm, hu, fma(norm, mu, -scaled))`` has its sign bit set."""
    entry = entry_table(signed)[pairs]
    below = fma(norm, entry[..., 1], fma(norm, entry[..., 0], -scaled))
    return (pairs + (_bits(below) < 0).long()).to(torch.uint8)


def encode_twin(normalized: torch.Tensor, signed: bool, fma: Fma = fma32) -> torch.Tensor:
    """The Triton ``encode8`` on CPU: uint8 codes of fp32 values (the reference's for every value in [-1, 1])."""
    normalized = normalized.float()
    one = torch.ones((), dtype=torch.float32)
    return settle(guess_pairs(normalized, signed, fma), normalized, one, signed, fma)


def block_params(absmax: torch.Tensor, reciprocal_ulps: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(scale, norm, reciprocal)`` per block, as the Triton ``quantize8_params``. The reciprocal here is the
    correctly rounded ``1 / norm`` moved by ``reciprocal_ulps`` ulps (the GPU's ``rsqrt(norm)**2`` is within about
    2 ulps of it; the proof checks that every reciprocal within ``RECIPROCAL_TOLERANCE`` gives the same codes)."""
    absmax = absmax.float()
    divisor = torch.where(absmax > 0, absmax, 1.0)  # the reference divides by 1 where ``absmax > 0`` fails
    scale = (SCALE_BIAS - (_bits(divisor) & 0x7F800000)).clamp(min=MIN_SCALE_BITS).view(torch.float32)
    norm = divisor * scale
    reciprocal = 1.0 / norm
    direction = torch.tensor(float("inf") if reciprocal_ulps > 0 else float("-inf"))
    for _ in range(abs(reciprocal_ulps)):
        reciprocal = torch.nextafter(reciprocal, direction)
    return scale, norm, reciprocal


def quantize_twin(values: torch.Tensor, signed: bool, reciprocal_ulps: int = 0, fma: Fma = fma32
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes (rows, blocks, 256), absmax (rows, blocks))`` of fp32 ``values`` ``(rows, blocks, 256)`` as the
    Triton ``quantize8`` computes them (``reciprocal_ulps``: see :func:`block_params`; ``fma``: as
    :func:`guess_pairs`)."""
    absmax = values.abs().amax(dim=-1)
    scale, norm, reciprocal = (p.unsqueeze(-1) for p in block_params(absmax, reciprocal_ulps))
    scaled = values * scale
    return settle(guess_pairs(scaled * reciprocal, signed, fma), scaled, norm, signed, fma), absmax


assert BLOCK_SIZE == 256 and ENTRY_MASK == (ENTRIES - 1) * ENTRY_BYTES


def nudge(x: torch.Tensor, steps: int) -> torch.Tensor:
    """``x`` moved ``steps`` fp32 ulps up (``steps > 0``) or down: the values next to a rounding boundary, which the
    encoder's exactness tests and proof probe."""
    direction = torch.tensor(float("inf") if steps > 0 else float("-inf"))
    for _ in range(abs(steps)):
        x = torch.nextafter(x, direction)
    return x
