"""The 8-bit dynamic quantization maps of bitsandbytes, and the lookup tables that encode against them.

A map is 256 sorted fp32 values in [-1, 1] (signed) or [0, 1] (unsigned). It is built from 7 decades,
10^-6 .. 10^0: in decade ``i`` the signed map holds the midpoints of ``linspace(0.1, 1, 2**i + 1)`` scaled by
``10**(i - 6)`` with both signs, the unsigned map the midpoints of ``linspace(0.1, 1, 2**(i + 1) + 1)``; 0 and 1
are appended. The arithmetic below follows the same fp32 steps as bitsandbytes' ``create_dynamic_map`` so that
the two maps are equal bit for bit (a test checks this against the real bitsandbytes).

Encoding (value -> nearest code) uses a lookup table keyed by the top bits of the fp32 pattern of the
normalized value: sign, exponent and ``MANTISSA_BITS`` mantissa bits. Each key covers a range of relative width
2**-MANTISSA_BITS, narrower than the closest pair of midpoints, so a key's range contains at most one midpoint:
the table gives the code for the low end of the range, and one comparison against that code's "next" threshold
decides whether to move one code further from zero. The result is exact round-to-nearest, with exact ties
going to the code nearer zero. Signed maps apply bitsandbytes' sign fix: a value with the sign bit set (negative
values and -0.0, as CUDA's ``signbit``) never encodes as the 0.0 code but as the smallest negative one.
"""

from __future__ import annotations

import functools

import torch

BLOCK_SIZE = 256
"""Elements per quantization block (bitsandbytes >= 0.44)."""

MANTISSA_BITS = 8
"""Mantissa bits in the lookup key; 2**-8 = 0.39% is finer than the closest relative midpoint spacing (0.7%)."""

KEY_SHIFT = 23 - MANTISSA_BITS
KEY_MASK = (1 << (9 + MANTISSA_BITS)) - 1  # sign + 8 exponent bits + mantissa bits
ZERO_CODE_SIGNED = 127


def create_dynamic_map(signed: bool = True) -> torch.Tensor:
    """Return the 256-entry fp32 dynamic map, equal bit for bit to bitsandbytes' ``create_dynamic_map``."""
    values: list[float] = []
    for decade in range(7):
        items = 2**decade + 1 if signed else 2 ** (decade + 1) + 1
        bounds = torch.linspace(0.1, 1, items, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        scale = 10 ** (decade - 6)
        values += (scale * means).tolist()
        if signed:
            values += (-scale * means).tolist()
    values += [0.0, 1.0]
    values.sort()
    return torch.tensor(values, dtype=torch.float32)


@functools.cache
def _maps_cpu(signed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(map, code table, threshold table) on CPU, built once per process."""
    qmap = create_dynamic_map(signed)
    table, thresholds = _build_encoder(qmap, signed)
    return qmap, table, thresholds


def dynamic_map(signed: bool, device: torch.device | str = "cpu") -> torch.Tensor:
    """The signed or unsigned dynamic map on ``device`` (a fresh tensor: callers may store it in state)."""
    return _maps_cpu(signed)[0].to(device, copy=True)


@functools.cache
def _encoder_on(signed: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    _, table, thresholds = _maps_cpu(signed)
    return table.to(device), thresholds.to(device)


def encoder_tables(signed: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(code table indexed by key, |value| threshold per code) for the map, cached per device."""
    return _encoder_on(signed, torch.device(device))


def _nearest_codes(values: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """Reference encoder: the code whose value is nearest; an exact tie (a value equal to an fp32 midpoint
    ``(qmap[i] + qmap[i+1]) * 0.5``) goes to the code nearer zero, so encoding is symmetric in sign."""
    mids = (qmap[1:] + qmap[:-1]) * 0.5
    toward_zero_up = torch.bucketize(values, mids, right=True)  # negative ties: the upper (nearer-zero) code
    toward_zero_down = torch.bucketize(values, mids, right=False)  # positive ties: the lower code
    return torch.where(values < 0, toward_zero_up, toward_zero_down)


def _build_encoder(qmap: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    keys = torch.arange(KEY_MASK + 1, dtype=torch.int64)
    negative = (keys >> (8 + MANTISSA_BITS)).bool()
    low_bits = ((keys & ((1 << (8 + MANTISSA_BITS)) - 1)) << KEY_SHIFT).to(torch.int32)
    magnitude = low_bits.view(torch.float32).clamp(max=1.0)
    low_end = torch.where(negative, -magnitude, magnitude)
    codes = _nearest_codes(low_end, qmap)
    if signed:
        # Sign fix: a negative value never encodes as +0 (the 0.0 code); it takes the smallest negative code.
        codes = torch.where(negative & (codes == ZERO_CODE_SIGNED), ZERO_CODE_SIGNED - 1, codes)
    else:
        codes = torch.where(negative, 0, codes)

    # Threshold on |value| beyond which the nearest code is the next one further from zero.
    mids_abs = ((qmap[1:] + qmap[:-1]) * 0.5).abs()
    inf = torch.tensor([float("inf")])
    up = torch.cat([mids_abs, inf])  # for codes whose value is >= 0: next code is +1
    down = torch.cat([inf, mids_abs])  # for codes whose value is < 0: next code is -1
    thresholds = torch.where(qmap >= 0, up, down)

    _check_encoder(codes, thresholds, magnitude, negative, qmap, signed)
    return codes.to(torch.uint8), thresholds.contiguous()


def _check_encoder(codes, thresholds, magnitude, negative, qmap, signed) -> None:
    """Prove the one-midpoint-per-key property: the top of every key range encodes as the table predicts."""
    top_bits = magnitude.view(torch.int32) | ((1 << KEY_SHIFT) - 1)
    top = top_bits.view(torch.float32).clamp(max=1.0)
    top_signed = torch.where(negative, -top, top)
    expected = _nearest_codes(top_signed, qmap)
    if signed:
        expected = torch.where(negative & (expected == ZERO_CODE_SIGNED), ZERO_CODE_SIGNED - 1, expected)
    else:
        expected = torch.where(negative, 0, expected)
    step = torch.where(negative, -1 if signed else 0, 1)
    predicted = codes + torch.where(top > thresholds[codes], step, 0)
    if not torch.equal(predicted, expected):
        raise AssertionError("dynamic-map encoder table is not exact; MANTISSA_BITS is too small")
