"""Rank-1 normalized 4-bit quantization of a second moment: the math of the best setting of "Memory Efficient
Optimizers with 4-bit States" (Li, Chen, Zhu 2023, arXiv 2309.01507, "Rank-1/Linear"), in pure PyTorch.

The second moment ``v`` of a parameter seen as a matrix ``(R, C)`` (see :func:`matrix_shape`) is stored as

- ``row[i] = max_j |v[i, j]|`` and ``col[j] = max_i |v[i, j]|``, fp32 (the rank-1 statistics);
- for each element the 4-bit index of the value of the linear map without zero (``k / 16``, ``k = 1..16``,
  :func:`hf_optim.formats.quant4.qmap4` ``(False)``) nearest to ``v[i, j] / min(row[i], col[j])``, two per
  byte in :mod:`~hf_optim.formats.quant4`'s order (element ``2i`` in the high nibble);
- dequantization is ``qmap[code] * min(row[i], col[j])``.

Why: block-wise scaling (one absmax per 128 consecutive elements) gives every element of a block the same scale,
so the many small entries of a block that holds one large entry land on the map's smallest values, where the
linear map's relative error is large. The rank-1 scale ``min(row, col)`` follows both the row's and the column's
magnitude, so most elements are divided by a scale near their own size (``|v| <= min(row, col)`` always holds, so
the ratio stays in ``[0, 1]``). The paper reports this as its best second-moment setting; torchao does not
implement it. The scales cost ``4 * (R + C)`` bytes per slot row: 2 KiB for a 256 x 256 weight.

Exactness: nearest code by the exact thresholds of :mod:`~hf_optim.formats.quant4` (ties go up); a zero
row/column scale encodes its elements as code 0 and decodes them to exactly 0 (``qmap[0] * 0``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hf_optim.formats.quant4 import encode_eager, pack, packed_length, unpack

LINE = 128
"""Row length of the matrix a 1-D tensor is seen as (:func:`matrix_shape`)."""


def matrix_shape(shape: tuple[int, ...] | torch.Size) -> tuple[int, int]:
    """The ``(R, C)`` matrix whose rows and columns the scales follow, for a parameter of ``shape``.

    A tensor of 2 or more dimensions is ``(shape[0], numel / shape[0])`` (a Linear weight: output rows, input
    columns; a convolution: output channels, the rest). A 1-D tensor of ``n`` elements is cut into rows of
    :data:`LINE` elements, ``(ceil(n / 128), 128)``, the last row zero-padded (or ``(1, n)`` when ``n <= 128``).
    """
    numel = math.prod(shape)
    if len(shape) >= 2:  # no rows (an empty shard of a matrix) keeps the matrix's columns
        return int(shape[0]), math.prod(shape[1:])
    if numel <= LINE:
        return 1, numel
    return -(-numel // LINE), LINE


def scale_count(shape: tuple[int, ...] | torch.Size) -> int:
    """fp32 scales of one slot row: ``R + C`` of :func:`matrix_shape`."""
    rows, cols = matrix_shape(shape)
    return rows + cols


def _as_matrix(values: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``(slots, n)`` zero-padded to ``(slots, rows, cols)``."""
    pad = rows * cols - values.shape[-1]
    return (F.pad(values, (0, pad)) if pad else values).view(values.shape[0], rows, cols)


def _element_scale(row: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
    return torch.minimum(row.unsqueeze(-1), col.unsqueeze(-2))


def scales(values: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row scales ``(slots, rows)``, column scales ``(slots, cols)``) of fp32 ``values`` ``(slots, n)``: what
    :func:`quantize` stores."""
    magnitude = _as_matrix(values, rows, cols).abs()
    return magnitude.amax(dim=2), magnitude.amax(dim=1)


def quantize(values: torch.Tensor, rows: int, cols: int, thresholds: torch.Tensor,
             given: tuple[torch.Tensor, torch.Tensor] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed uint8 codes ``(slots, ceil(n / 2))``, row scales ``(slots, rows)``, column scales
    ``(slots, cols)``) of non-negative fp32 ``values`` ``(slots, n)``, ``n <= rows * cols``.

    ``thresholds``: the map's encoder thresholds (:func:`hf_optim.formats.quant4.encoder_thresholds` of the
    unsigned map). ``given``: the (row, column) scales to encode against (a whole matrix's, for part of it)
    instead of the values' own."""
    if values.dim() != 2:
        raise ValueError(f"rank-1 4-bit values must be (slots, n), got shape {tuple(values.shape)}")
    n = values.shape[-1]
    if n and not (rows - 1) * cols < n <= rows * cols:  # every row but the last is full
        raise ValueError(f"{n} values do not fill a {rows} x {cols} matrix up to its last row")
    matrix = _as_matrix(values, rows, cols)
    row, col = scales(values, rows, cols) if given is None else given
    scale = _element_scale(row, col)
    normalized = (matrix / torch.where(scale > 0, scale, torch.ones_like(scale))).flatten(1)[:, :n]
    codes = encode_eager(normalized, thresholds)
    if n % 2:  # the padding nibble holds code 0, what a zero encodes to
        codes = F.pad(codes, (0, 1))
    return pack(codes).view(torch.uint8), row, col


def quantize_into(values: torch.Tensor, thresholds: torch.Tensor, codes: torch.Tensor, row: torch.Tensor,
                  col: torch.Tensor, given: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """:func:`quantize` written into ``codes`` (uint8 or its int8 view), ``row`` and ``col`` (their shapes give
    the matrix); ``given``: as :func:`quantize`."""
    packed, new_row, new_col = quantize(values, row.shape[-1], col.shape[-1], thresholds, given)
    codes.view(torch.uint8).copy_(packed)
    row.copy_(new_row)
    col.copy_(new_col)


def dequantize(codes: torch.Tensor, row: torch.Tensor, col: torch.Tensor, qmap: torch.Tensor,
               n: int | None = None) -> torch.Tensor:
    """fp32 values ``(slots, n)`` of packed ``codes`` ``(slots, ceil(n / 2))`` under ``row`` ``(slots, R)`` and
    ``col`` ``(slots, C)`` scales. ``n`` (default ``min(R * C, 2 * bytes)``) is needed for an odd count."""
    if codes.dim() != 2:
        raise ValueError(f"rank-1 4-bit codes must be (slots, bytes), got shape {tuple(codes.shape)}")
    rows, cols = row.shape[-1], col.shape[-1]
    n = min(rows * cols, 2 * codes.shape[-1]) if n is None else n
    if packed_length(n) != codes.shape[-1] or n > rows * cols:
        raise ValueError(f"{codes.shape[-1]} bytes of codes under a {rows} x {cols} scale do not hold n={n} values")
    values = torch.ops.aten._unsafe_index(qmap, [unpack(codes)])[:, :n]  # codes are 0..15: always in range
    return (_as_matrix(values, rows, cols) * _element_scale(row, col)).flatten(1)[:, :n]
