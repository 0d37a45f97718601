"""Blockwise 4-bit quantization in pure PyTorch: the math of "Memory Efficient Optimizers with 4-bit States"
(Li, Chen, Zhu 2023, arXiv 2309.01507) as torchao's ``AdamW4bit`` applies it, and the reference of the Triton
twin (:mod:`hf_optim.kernels.triton_path.quant4`).

Format of one state row of ``n`` values:

- blocks of :data:`BLOCK_SIZE` = 128 elements (torchao's 4-bit default); ``scale[b]`` is the fp32 largest
  magnitude in block ``b``, exactly (an all-zero block has scale 0 and dequantizes to exact zeros);
- each element stores the 4-bit index of the map value nearest to ``value / scale``, two per byte: element
  ``2i`` in the high nibble of byte ``i``, element ``2i + 1`` in the low nibble (torchao's order). An odd ``n``
  leaves the last low nibble as padding, holding the code of 0.0;
- dequantization is ``qmap[code] * scale[block]``.

Maps (16 sorted fp32 values, equal bit for bit to torchao's): the first moment uses the signed dynamic ("tree")
map with 3 exponent bits in 4 total bits, built exactly like bitsandbytes' ``create_dynamic_map`` (see
:func:`tree_map`); the second moment the unsigned linear map without zero, ``linspace(0, 1, 17)[1:]``, so a small
``v`` never becomes 0 and ``1 / sqrt(v)`` stays bounded (the paper's zero-point problem).

Nearest code, exactly: a value goes to the upper of two neighbouring codes when it is at or above their midpoint
computed exactly in real arithmetic (ties go up, towards +inf). That is torchao's rule (``residual >= gap / 2``),
which computes residual and gap in fp32; for these two maps the rounding never changes a code (the tests check
every fp32 within 64 ulps of each midpoint), so the codes equal torchao's. It is implemented as a count of 15
fp32 thresholds, each the smallest fp32 at or above an exact midpoint: ``code = #{t : value >= t}``. It is
branch-free, with no data-dependent control flow and no ``.item()``, so the elementwise rule compiles with
inductor; NaN compares false everywhere and encodes as code 0.

Differences from torchao, on purpose: torchao clips the scale to at least 1e-12, so blocks whose values are all
below 1e-12 (a second moment of gradients near 1e-7) lose their resolution; here the scale is the exact absmax,
as in the 8-bit format. Non-finite input makes its block's scale non-finite; the elementwise layer masks
non-finite gradients before states are quantized, so this never happens in an optimizer step.

Shapes follow :mod:`hf_optim.formats.quant8`: ``(rows, n)`` views (AdEMAMix stacks two rows, each with its own
scale row) or the multi-tensor kernels' block-aligned ``(rows, blocks, 128)``, whose codes are
``(rows, blocks, 64)``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

BLOCK_SIZE = 128
"""Elements per quantization block (torchao's ``AdamW4bit`` default)."""

CODES = 16
"""Entries in a 4-bit map."""


def tree_map(signed: bool, exponent_bits: int, total_bits: int) -> torch.Tensor:
    """The sorted fp32 dynamic (tree) map of ``2**total_bits`` values, built as bitsandbytes'
    ``create_dynamic_map(signed, max_exponent_bits, total_bits)`` without its zero padding to 256 entries.

    Decade ``i`` (``i < exponent_bits``) holds the midpoints of ``linspace(0.1, 1, k + 1)`` scaled by
    ``10**(i - exponent_bits + 1)``, with both signs when signed, where ``k`` is ``2**(i + total_bits - 1 -
    exponent_bits)``, doubled for unsigned maps; fraction bits left over add one more linear group at the top
    decade's scale; then 0 and 1. The fp32 steps are bitsandbytes', so the values match it (and torchao, which
    copies it) bit for bit. With ``(7, 8)`` this is the 8-bit map of :mod:`hf_optim.formats.dynamic_map`.
    """
    if not 1 <= exponent_bits < total_bits:
        raise ValueError(
            f"exponent_bits must be in 1..{total_bits - 1} for total_bits={total_bits}, got {exponent_bits}"
        )
    fraction_bits = total_bits - 1 - exponent_bits
    parts = []
    for decade in range(exponent_bits):
        groups = 2 ** (decade + fraction_bits + (0 if signed else 1))
        parts.extend(_scaled_midpoints(groups, 10 ** (decade - exponent_bits + 1), signed))
    extra = 2**fraction_bits - 1  # values of the all-zero exponent with no indicator bit
    if extra > 0:  # bitsandbytes scales them as its last decade, by 10**0
        parts.extend(_scaled_midpoints(extra, 1, signed))
    parts.append(torch.tensor([0.0, 1.0], dtype=torch.float32))
    values = torch.cat(parts).sort().values
    if values.numel() != 2**total_bits:
        raise ValueError(
            f"a tree map with exponent_bits={exponent_bits}, total_bits={total_bits}, signed={signed} has "
            f"{values.numel()} values, not {2**total_bits} (bitsandbytes' construction fills an unsigned map only "
            f"with exponent_bits = total_bits - 1 = {total_bits - 1})"
        )
    return values


def _scaled_midpoints(count: int, scale: float, signed: bool) -> list[torch.Tensor]:
    bounds = torch.linspace(0.1, 1, count + 1, dtype=torch.float32)
    means = (bounds[:-1] + bounds[1:]) / 2.0
    return [scale * means, -scale * means] if signed else [scale * means]


def _build_map(signed: bool) -> torch.Tensor:
    if signed:
        return tree_map(True, exponent_bits=3, total_bits=4)
    return torch.linspace(0, 1, CODES + 1, dtype=torch.float32)[1:]  # k/16 exactly: no zero


def _build_thresholds(qmap: torch.Tensor) -> torch.Tensor:
    """For each pair of neighbours, the smallest fp32 at or above their exact midpoint (computed in float64,
    where the sum of two fp32 map values is exact)."""
    mids = (qmap[:-1].double() + qmap[1:].double()) / 2
    nearest = mids.float()
    return torch.where(nearest.double() < mids, torch.nextafter(nearest, torch.tensor(float("inf"))), nearest)


# Built eagerly at import (32 small tensors' worth of work): a compiled step then reads them as constants, and
# inductor never re-derives the map's fp32 arithmetic its own way.
_MAPS = {signed: _build_map(signed) for signed in (True, False)}
_THRESHOLDS = {signed: _build_thresholds(qmap) for signed, qmap in _MAPS.items()}
_SIGNED_VALUES = _MAPS[True].tolist()  # Python floats, each exactly its fp32 map value


def qmap4(signed: bool, device: torch.device | str = "cpu") -> torch.Tensor:
    """The signed (first moment) or unsigned (second moment) 16-value map on ``device``, as a fresh tensor
    that callers may keep in optimizer state."""
    return _MAPS[signed].to(device, copy=True)


@functools.cache
def _thresholds_on(signed: bool, device: torch.device) -> torch.Tensor:
    return _THRESHOLDS[signed].to(device)


def encoder_thresholds(signed: bool, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 15 fp32 encoding thresholds of a map (see the module docstring), cached per device."""
    return _thresholds_on(signed, torch.device(device))


def num_blocks(numel: int) -> int:
    """Number of 128-element blocks that cover ``numel`` elements."""
    return -(-numel // BLOCK_SIZE)


def packed_length(numel: int) -> int:
    """Bytes of packed codes for ``numel`` elements (two codes per byte)."""
    return -(-numel // 2)


def bytes_per_element(numel: int) -> float:
    """Storage of a ``numel``-element 4-bit state (codes and fp32 scales), per element: 0.53125 for whole blocks."""
    return (packed_length(numel) + 4 * num_blocks(numel)) / numel if numel else 0.0


def encode(normalized: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    """Nearest 4-bit code (int32, 0..15) of values in [-1, 1]: the number of ``thresholds`` at or below each.

    Fifteen compares fuse into one vectorized loop under inductor; in eager mode this costs 15 passes (see
    :func:`encode_eager` for the one-pass form used outside compiled code)."""
    codes = torch.zeros(normalized.shape, dtype=torch.int32, device=normalized.device)
    for index in range(CODES - 1):
        codes = codes + (normalized >= thresholds[index]).int()
    return codes


def encode_eager(normalized: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    """:func:`encode` in one pass for eager mode: ``bucketize(right=True)`` counts the thresholds at or below a
    value, the same number; NaN, which bucketize would place at the top, is sent to code 0 as in :func:`encode`."""
    codes = torch.bucketize(normalized, thresholds, out_int32=True, right=True)
    return torch.where(normalized.isnan(), 0, codes)


def _encode(normalized: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    return encode(normalized, thresholds) if torch.compiler.is_compiling() else encode_eager(normalized, thresholds)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """Pairs of codes (last dimension even) into bytes, as int8 bit patterns (element ``2i`` high nibble).
    int8 because inductor's CPU code narrows int32 to int8 much faster than to uint8 (see ``quant8``)."""
    pairs = codes.view(*codes.shape[:-1], codes.shape[-1] // 2, 2)  # no -1: empty tensors must work too
    return ((pairs[..., 0] << 4) | pairs[..., 1]).to(torch.int8)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """Bytes (uint8, or their int8 view) into int32 codes 0..15, twice as many along the last dimension."""
    byte = packed.int() & 255
    return torch.stack([byte >> 4, byte & 15], dim=-1).flatten(-2)


def _blocked(x: torch.Tensor) -> torch.Tensor:
    """``(rows, n)`` as ``(rows, blocks, 128)``, zero-padded; a 3-D block-aligned tensor is returned as it is."""
    if x.dim() == 3:
        return x
    rows, n = x.shape
    blocks = num_blocks(n)
    pad = blocks * BLOCK_SIZE - n
    if pad:
        x = F.pad(x, (0, pad))
    return x.view(rows, blocks, BLOCK_SIZE)


def _check_2d_or_3d(x: torch.Tensor, what: str) -> None:
    if x.dim() not in (2, 3) or (x.dim() == 3 and x.shape[-1] != BLOCK_SIZE):
        raise ValueError(
            f"4-bit {what} must be (rows, n) or (rows, blocks, {BLOCK_SIZE}), got shape {tuple(x.shape)}"
        )


def block_scales(values: torch.Tensor) -> torch.Tensor:
    """The scale (rows, blocks) :func:`quantize` stores for fp32 ``values``: each 128-block's largest magnitude."""
    return _blocked(values).abs().amax(dim=-1)


def _quantized_blocks(values: torch.Tensor, thresholds: torch.Tensor, scale: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed int8 codes (rows, blocks, 64), scale (rows, blocks)) of fp32 ``values``; ``scale``: the blocks' own
    (computed) when None."""
    blocks = _blocked(values)
    if scale is None:
        scale = blocks.abs().amax(dim=-1)
    # An all-zero block has scale 0: divide by 1 so it encodes the code of 0.0, which dequantizes to exact 0.
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)
    return pack(_encode(blocks / divisor, thresholds)), scale


def _trimmed(packed_blocks: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return packed_blocks if values.dim() == 3 else packed_blocks.flatten(1)[:, : packed_length(values.shape[-1])]


def quantize(values: torch.Tensor, thresholds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 codes, fp32 scale) of fp32 ``values``.

    ``(rows, n)`` gives codes ``(rows, ceil(n / 2))`` and scale ``(rows, ceil(n / 128))``; ``(rows, blocks, 128)``
    gives codes ``(rows, blocks, 64)`` and scale ``(rows, blocks)``. ``thresholds`` picks the map
    (:func:`encoder_thresholds`)."""
    _check_2d_or_3d(values, "values")
    packed, scale = _quantized_blocks(values, thresholds)
    return _trimmed(packed, values).contiguous().view(torch.uint8), scale  # contiguous: callers keep it as state


def quantize_into(values: torch.Tensor, thresholds: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                  scales: torch.Tensor | None = None) -> None:
    """:func:`quantize` written into ``codes`` (uint8, or the int8 view kernels pass: a dtype view inside a
    compiled graph is a slow bitcast, outside it is free) and ``scale``; ``scales``: the scale to encode against
    (a whole tensor's, for part of it) instead of the blocks' own."""
    packed, new_scale = _quantized_blocks(values, thresholds, scales)
    codes.view(torch.int8).copy_(_trimmed(packed, values))
    scale.copy_(new_scale)


def zero_code(signed: bool) -> int:
    """The code a zero value encodes to (what pads an odd last nibble): the signed map's 0, the unsigned map's
    smallest value (it has no 0)."""
    return int((_THRESHOLDS[signed] <= 0).sum())


def pack_codes(codes: torch.Tensor, signed: bool) -> torch.Tensor:
    """uint8 bytes ``(rows, ceil(n / 2))`` of per-element codes ``(rows, n)`` (0..15), an odd last element's pair
    padded with :func:`zero_code`, as :func:`quantize` pads it."""
    codes = codes.int()
    if codes.shape[-1] % 2:
        codes = F.pad(codes, (0, 1), value=zero_code(signed))
    return pack(codes).view(torch.uint8)


def unpack_codes(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` per-element codes (uint8 ``(rows, n)``) of packed bytes ``(rows, bytes)``."""
    return unpack(packed)[..., :n].to(torch.uint8)


def decode(codes: torch.Tensor, signed: bool) -> torch.Tensor:
    """fp32 map values of int32 codes 0..15 without reading the map (so inductor's CPU code vectorizes): the signed
    map by selects among its 16 constants, the unsigned map as ``(code + 1) * 0.0625`` (exact). Equal to
    ``qmap4(signed)[codes]`` bit for bit; the Triton twin (``triton_path.quant4.decode4``) selects the same
    constants."""
    if not signed:
        return (codes + 1).float() * 0.0625
    values = torch.zeros(codes.shape, dtype=torch.float32, device=codes.device)
    for code, value in enumerate(_SIGNED_VALUES):
        values = torch.where(codes == code, value, values)
    return values


def dequantize(codes: torch.Tensor, scale: torch.Tensor, qmap: torch.Tensor | bool, n: int | None = None
               ) -> torch.Tensor:
    """fp32 values of packed ``codes`` under per-block ``scale``: ``qmap`` a 16-value map tensor (read) or, for the
    two maps of this module, its signedness (:func:`decode`, no read; the optimizers' path).

    ``codes`` ``(rows, ceil(n / 2))`` needs ``n`` when it is odd (``None`` means ``2 * codes.shape[-1]``) and
    gives ``(rows, n)``; ``(rows, blocks, 64)`` gives ``(rows, blocks, 128)``."""
    if codes.dim() == 3:
        values = _values(unpack(codes), qmap)
        return values * scale.unsqueeze(-1)
    if codes.dim() != 2:
        raise ValueError(f"4-bit codes must be (rows, bytes) or (rows, blocks, 64), got shape {tuple(codes.shape)}")
    n = 2 * codes.shape[-1] if n is None else n
    if packed_length(n) != codes.shape[-1]:
        raise ValueError(f"{codes.shape[-1]} bytes of 4-bit codes hold {2 * codes.shape[-1] - 1} or "
                         f"{2 * codes.shape[-1]} values, not n={n}")
    values = _values(unpack(codes), qmap)
    return (_blocked(values) * scale.unsqueeze(-1)).flatten(1)[:, :n]


def _values(codes: torch.Tensor, qmap: torch.Tensor | bool) -> torch.Tensor:
    if isinstance(qmap, bool):
        return decode(codes, qmap)
    return torch.ops.aten._unsafe_index(qmap, [codes])  # codes are 0..15: always in range
