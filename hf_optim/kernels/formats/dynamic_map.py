"""The 8-bit dynamic quantization maps of bitsandbytes, and the lookup tables that encode against them.

A map is 256 sorted fp32 values in [-1, 1] (signed) or [0, 1] (unsigned). It is built from 7 decades,
10^-6 .. 10^0: in decade ``i`` the signed map holds the midpoints of ``linspace(0.1, 1, 2**i + 1)`` scaled by
``10**(i - 6)`` with both signs, the unsigned map the midpoints of ``linspace(0.1, 1, 2**(i + 1) + 1)``; 0 and 1
are appended. The arithmetic below follows the same fp32 steps as bitsandbytes' ``create_dynamic_map`` so that
the two maps are equal bit for bit (a test checks this against the real bitsandbytes).

Encoding (value -> nearest code) uses one lookup table keyed by the top bits of the fp32 pattern of the normalized
value: sign, exponent and ``MANTISSA_BITS`` mantissa bits. Each key covers a range of relative width
2**-MANTISSA_BITS, narrower than the closest pair of midpoints, so a key's range contains at most one midpoint.
Beyond that midpoint the value moves one code further from zero. Every value in a range shares its top bits with
the midpoint, and positive fp32 values order like their bit patterns, so comparing the low ``KEY_SHIFT`` bits
decides exactly which side a value is on. An entry therefore packs ``code << KEY_SHIFT | midpoint low bits`` (the
low bits are all ones when the range holds no midpoint, which no value exceeds): a single lookup per value.
Only the ``BINADES`` binades below 1.0 are kept (smaller magnitudes clamp into the first key, which holds no
midpoint), so the table (48 KiB) stays in cache. The result is exact round-to-nearest, with exact ties going to
the code nearer zero. Signed maps apply bitsandbytes' sign fix: a value with the sign bit set (negative values
and -0.0, as CUDA's ``signbit``) never encodes as the 0.0 code but as the smallest negative one.
"""

from __future__ import annotations

import functools

import torch

BLOCK_SIZE = 256
"""Elements per quantization block (bitsandbytes >= 0.44)."""

MANTISSA_BITS = 8
"""Mantissa bits in the lookup key; 2**-8 = 0.39% is finer than the closest relative midpoint spacing (0.7%)."""

BINADES = 23
"""Binades of magnitude kept below 1.0: the smallest map midpoint (2.75e-7) lies above 2**-23 (1.2e-7)."""

KEY_SHIFT = 23 - MANTISSA_BITS
KEYS_PER_SIGN = (BINADES + 1) << MANTISSA_BITS  # magnitudes [2**-BINADES, 2), 1.0 included
KEY_OFFSET = (127 - BINADES) << MANTISSA_BITS  # magnitude key of 2**-BINADES
ZERO_CODE_SIGNED = 127


def create_dynamic_map(signed: bool = True) -> torch.Tensor:
    """Return the 256-entry fp32 dynamic map, equal bit for bit to bitsandbytes' ``create_dynamic_map``.

    Tensor operations only (no ``.tolist()``), so ``torch.compile`` traces it without a graph break when a compiled
    step creates 8-bit state; the fp32 values and their sorted order are those of bitsandbytes' list-based build.
    """
    parts = []
    for decade in range(7):
        items = 2**decade + 1 if signed else 2 ** (decade + 1) + 1
        bounds = torch.linspace(0.1, 1, items, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        scale = 10 ** (decade - 6)
        parts.append(scale * means)
        if signed:
            parts.append(-scale * means)
    parts.append(torch.tensor([0.0, 1.0], dtype=torch.float32))
    return torch.cat(parts).sort().values


_built: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}


def _build_maps(signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    qmap = create_dynamic_map(signed)
    _built[signed] = qmap, _build_encoder(qmap, signed)
    return _built[signed]


# Traced into a compiled step (dynamo inlines functools.cache wrappers too), Inductor would recompute the map's
# fp32 linspace arithmetic its own way and the map would no longer equal bitsandbytes' bit for bit: under
# torch.compile the build runs outside the graph. (torch._disable_dynamo imports dynamo only when first called.)
_build_maps_eagerly = torch._disable_dynamo(_build_maps)


def _maps_cpu(signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(map, encoder table) on CPU, built once per process. A compiled step that finds them built reads them as
    constants (a dict lookup, no graph break); only the very first build breaks the graph."""
    maps = _built.get(signed)
    if maps is not None:
        return maps
    return _build_maps_eagerly(signed) if torch.compiler.is_compiling() else _build_maps(signed)


def dynamic_map(signed: bool, device: torch.device | str = "cpu") -> torch.Tensor:
    """The signed or unsigned dynamic map on ``device`` (a fresh tensor: callers may store it in state)."""
    return _maps_cpu(signed)[0].to(device, copy=True)


@functools.cache
def _encoder_on(signed: bool, device: torch.device) -> torch.Tensor:
    return _maps_cpu(signed)[1].to(device)


def encoder_table(signed: bool, device: torch.device | str) -> torch.Tensor:
    """The packed int32 encoder table, indexed by :func:`encoder_keys`, cached per device."""
    return _encoder_on(signed, torch.device(device))


def _nearest_codes(values: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """Reference encoder: the code whose value is nearest; an exact tie (a value equal to an fp32 midpoint
    ``(qmap[i] + qmap[i+1]) * 0.5``) goes to the code nearer zero, so encoding is symmetric in sign."""
    mids = (qmap[1:] + qmap[:-1]) * 0.5
    toward_zero_up = torch.bucketize(values, mids, right=True)  # negative ties: the upper (nearer-zero) code
    toward_zero_down = torch.bucketize(values, mids, right=False)  # positive ties: the lower code
    return torch.where(values < 0, toward_zero_up, toward_zero_down)


def encoder_keys(bits: torch.Tensor) -> torch.Tensor:
    """Table index for fp32 bit patterns (int32): magnitude key clamped to the kept binades, plus the sign half."""
    magnitude_key = ((bits & 0x7FFFFFFF) >> KEY_SHIFT) - KEY_OFFSET
    return magnitude_key.clamp(0, KEYS_PER_SIGN - 1) + torch.where(bits < 0, KEYS_PER_SIGN, 0)


LOW_MASK = (1 << KEY_SHIFT) - 1


def _key_ranges() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(is negative, low end |value|, top end |value|) of every key's range."""
    index = torch.arange(2 * KEYS_PER_SIGN, dtype=torch.int64)
    negative = index >= KEYS_PER_SIGN
    magnitude_key = index % KEYS_PER_SIGN
    low_bits = ((magnitude_key + KEY_OFFSET) << KEY_SHIFT).to(torch.int32)
    top_bits = low_bits | ((1 << KEY_SHIFT) - 1)
    low = torch.where(magnitude_key == 0, 0.0, low_bits.view(torch.float32))  # key 0 also holds every tinier value
    return negative, low.clamp(max=1.0), top_bits.view(torch.float32).clamp(max=1.0)


def _codes_at(magnitude: torch.Tensor, negative: torch.Tensor, qmap: torch.Tensor, signed: bool) -> torch.Tensor:
    codes = _nearest_codes(torch.where(negative, -magnitude, magnitude), qmap)
    if signed:
        # Sign fix: a negative value never encodes as +0 (the 0.0 code); it takes the smallest negative code.
        return torch.where(negative & (codes == ZERO_CODE_SIGNED), ZERO_CODE_SIGNED - 1, codes)
    return torch.where(negative, 0, codes)


def _build_encoder(qmap: torch.Tensor, signed: bool) -> torch.Tensor:
    negative, low, top = _key_ranges()
    codes = _codes_at(low, negative, qmap, signed)

    # The midpoint (as |value|) beyond which the nearest code is the next one further from zero.
    mids_abs = ((qmap[1:] + qmap[:-1]) * 0.5).abs()
    inf = torch.tensor([float("inf")])
    up = torch.cat([mids_abs, inf])  # for codes whose value is >= 0: next code is +1
    down = torch.cat([inf, mids_abs])  # for codes whose value is < 0: next code is -1
    threshold = torch.where(qmap >= 0, up, down)[codes]
    inside = (threshold >= low) & (threshold <= top)
    if not signed:
        inside &= ~negative  # negatives clamp to code 0
    threshold_low = torch.where(inside, threshold.view(torch.int32) & LOW_MASK, LOW_MASK)
    table = (codes.to(torch.int32) << KEY_SHIFT) | threshold_low

    # Prove the one-midpoint-per-key property: the top of every key range encodes as the table predicts.
    step = 1 if not signed else torch.where(negative, -1, 1)
    predicted = codes + torch.where(top > torch.where(inside, threshold, float("inf")), step, 0)
    if not torch.equal(predicted, _codes_at(top, negative, qmap, signed)):
        raise AssertionError("dynamic-map encoder table is not exact; MANTISSA_BITS is too small")
    return table.contiguous()
