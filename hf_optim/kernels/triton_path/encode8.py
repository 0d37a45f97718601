"""Exact 8-bit blockwise quantization helpers for Triton kernels: no 48 KiB table, no per-element division.

Same codes as :mod:`hf_optim.formats.dynamic_map`'s reference encoder (the nearest map value of ``rn(s /
absmax)``, exact ties to the code nearer zero, bitsandbytes' sign fix) for every finite input; the method is described
in :mod:`hf_optim.formats.encode8` (which also holds the table and the PyTorch twin) and proved by
``benchmarks/proofs/encoder8_proof.py``. Per element: two gathers from one 10 KiB table (16 bytes: a pair of lines keyed
by the value's sign and exponent; 8 bytes: the guessed code pair's midpoint), two multiplies, four fmas and a few
integer operations; per block: about 8 instructions, one of them ``MUFU.RSQ`` (``benchmarks/proofs/encoder8_sass.py``
measures the encoder against ``div_rn`` and the table encoder).

Compiled, a few operations are spelled in PTX (``tl.inline_asm_elementwise``; the interpreter runs the same
arithmetic in Triton): table addresses as ``mul.wide.u32`` (one ``IMAD.WIDE.U32`` with the add to the base, where
Triton's own spelling costs a 64-bit add in two instructions), the 16-byte line load (in Triton it would need a
tensor with an extra axis, a layout conversion through shared memory in the fused kernels' tile layout), and the
block scale's exponent complement (LLVM rewrites the xor into a subtraction and a negation).

How to call. ``tables`` is an int32 pointer to ``encode8.encoder8_tables(signed, device)`` (one per map: it
carries the signedness, so no SIGNED argument); ``qmap`` the map's fp32 pointer (``dynamic_map``); codes are uint8.

- ``codes, absmax = quantize8_tile(values, mask, tables)``: a ``(BLOCKS, 256)`` fp32 tile, one block per row; lanes
  outside ``mask`` count as 0 (``None``: a whole tile); absmax propagates NaN, as ``torch.amax``.
- Any other tile shape, e.g. the fused kernels' ``(BLOCKS, 2, ROWS, W)``: compute the per-block absmax as usual,
  then ``scale, norm, reciprocal = quantize8_params(absmax)`` on the ``(BLOCKS,)`` vector and
  ``codes = quantize8(values, scale_b, norm_b, reciprocal_b, tables)`` with the three broadcast to the tile
  (``x[:, None, None, None]``). Broadcast after ``quantize8_params``, so that its work is done once per block.
- ``codes = encode8(normalized, tables)``: values already divided by their absmax (exact for every fp32 in [-1, 1]).
- ``dequantize8(codes, absmax_b, qmap)``: ``qmap[code] * absmax`` (absmax broadcast to the codes' shape), and
  ``dequantize8_tile(codes_ptr, absmax_ptr, qmap, blocks, offs, mask, block_mask)`` for a ``(BLOCKS, 256)`` tile.
  (A byte extract, the address in one wide multiply-add, one gather from the 1 KiB map, one multiply.)

Inputs that are not finite: a block whose absmax is NaN divides by 1, as the reference does; an infinite absmax
gives its finite values the codes of +-0, as the reference's ``s / inf``. Only a value whose quotient is NaN
(``+-inf / inf``, or a NaN or infinite value in a NaN block) gets an unspecified code; such blocks dequantize to
NaN or inf whatever the codes, and no input can index outside the table.

The reciprocal is ``rsqrt(norm) ** 2`` (``rsqrt.approx``: a compile check that forbids ``sqrt.approx`` by
substring must allow ``rsqrt.approx``); the encoder tolerates any reciprocal within 2**-17 relative error.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hf_optim.formats import encode8 as e8
from hf_optim.kernels.triton_path.tile import INTERPRETED

LINE_BYTES: tl.constexpr = tl.constexpr(e8.LINE_BYTES)
ENTRIES_AT: tl.constexpr = tl.constexpr(e8.ENTRIES_AT)
SCALE_BIAS: tl.constexpr = tl.constexpr(e8.SCALE_BIAS)
MIN_SCALE_BITS: tl.constexpr = tl.constexpr(e8.MIN_SCALE_BITS)
ENTRY_MASK: tl.constexpr = tl.constexpr(e8.ENTRY_MASK)


@triton.jit
def wide_offset(index, STRIDE: tl.constexpr):
    """int64 byte offset ``index * STRIDE`` of a uint32 ``index`` (below 2**31), spelled as PTX's
    ``mul.wide.u32``: ptxas folds it and the add to the table's address into one ``IMAD.WIDE.U32``. Written in
    Triton, LLVM proves such an index non-negative and emits a shift, and ptxas then adds 64 bits in two
    instructions (``IADD3`` and ``IMAD.X``, or ``LEA`` and ``LEA.HI.X``). ``STRIDE``: 1 (a byte offset), 4 or 16."""
    if INTERPRETED:
        offset = index.to(tl.int64) * STRIDE
    elif STRIDE == 16:
        offset = tl.inline_asm_elementwise("mul.wide.u32 $0, $1, 16;", "=l,r", [index], dtype=tl.int64,
                                           is_pure=True, pack=1)
    elif STRIDE == 1:
        offset = tl.inline_asm_elementwise("mul.wide.u32 $0, $1, 1;", "=l,r", [index], dtype=tl.int64,
                                           is_pure=True, pack=1)
    else:
        tl.static_assert(STRIDE == 4, "wide_offset: STRIDE must be 1, 4 or 16")
        offset = tl.inline_asm_elementwise("mul.wide.u32 $0, $1, 4;", "=l,r", [index], dtype=tl.int64,
                                           is_pure=True, pack=1)
    return offset


@triton.jit
def _words(table_bytes, byte_offset):
    """The two int32 words at ``byte_offset`` (an int64 tensor, multiple of 8) of the table, as fp32 bits: one
    8-byte load."""
    pair = tl.load((table_bytes + byte_offset).to(tl.pointer_type(tl.int64)))
    return (pair & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True), (pair >> 32).to(tl.int32).to(
        tl.float32, bitcast=True)


@triton.jit
def _line_pair(table_bytes, byte_offset):
    """The four words (two lines) at ``byte_offset`` (multiple of 16) of the table, as fp32 bits. Compiled: one
    16-byte load in PTX (in Triton a 16-byte row would need a tensor with an extra axis, which costs a layout
    conversion through shared memory in the fused kernels' tile layout)."""
    if INTERPRETED:
        slope1, intercept1 = _words(table_bytes, byte_offset)
        slope2, intercept2 = _words(table_bytes, byte_offset + 8)
    else:
        slope1, intercept1, slope2, intercept2 = tl.inline_asm_elementwise(
            "ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", [table_bytes + byte_offset],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
    return slope1, intercept1, slope2, intercept2


@triton.jit
def settle8(guess, scaled, norm, tables):
    """uint8 codes of ``scaled / norm``, where ``guess`` approximates that quotient (relative error below
    2**-17 + 2**-23) and ``scaled``, ``norm`` are a value and its block's divisor multiplied by the same power of
    two (:func:`quantize8_params`). Guess: two lines from the guess's sign and exponent, their minimum's bits give
    the code pair's entry; settle: the pair's upper code where the fma below has its sign bit set."""
    table_bytes = tables.to(tl.pointer_type(tl.uint8))
    lines = wide_offset(guess.to(tl.uint32, bitcast=True) >> 23, LINE_BYTES)
    slope1, intercept1, slope2, intercept2 = _line_pair(table_bytes, lines)
    position = tl.minimum(tl.fma(guess, slope1, intercept1), tl.fma(guess, slope2, intercept2))
    bits = position.to(tl.uint32, bitcast=True)
    # the entry's byte offset (one LOP3; the address then one IMAD.WIDE.U32 by 1, no shift and mask)
    mu, hu = _words(table_bytes + ENTRIES_AT, wide_offset(bits & ENTRY_MASK, 1))
    # -(scaled - norm * (mu + hu)), exact in sign; its sign bit is 1 where the pair settles on its upper code
    below = tl.fma(norm, hu, tl.fma(norm, mu, -scaled))
    # entry index + 1 where settling up; bits >> 3 holds the index in its low byte, which the uint8 cast keeps
    return ((bits >> 3) + (below.to(tl.uint32, bitcast=True) >> 31)).to(tl.uint8)


@triton.jit
def encode8(normalized, tables):
    """uint8 codes of fp32 ``normalized`` values (exact for every value in [-1, 1])."""
    return settle8(normalized, normalized, 1.0, tables)


@triton.jit
def _exponent_complement(x):
    """int32 ``0x7F800000 - e`` for the exponent field ``e = bits(x) & 0x7F800000``, as ``e ^ 0x7F800000`` (``e``
    has no bit outside the mask): mask and xor are one ``LOP3`` where the subtraction takes a negation more. In PTX,
    because LLVM rewrites the xor back into the subtraction."""
    if INTERPRETED:
        complement = (x.to(tl.int32, bitcast=True) & 0x7F800000) ^ 0x7F800000
    else:
        complement = tl.inline_asm_elementwise(
            "{ .reg .b32 e; and.b32 e, $1, 0x7F800000; xor.b32 $0, e, 0x7F800000; }", "=r,r", [x], dtype=tl.int32,
            is_pure=True, pack=1)
    return complement


@triton.jit
def quantize8_params(absmax):
    """``(scale, norm, reciprocal)`` of blocks with this absmax (any shape; compute them per block, then
    broadcast). The reference divides by ``d = absmax if absmax > 0 else 1``; ``scale = 2**(126 - exponent(d))``,
    at least 2**-126, so ``norm = d * scale`` is in [0.5, 1) (a subnormal d: [2**-23, 0.5); d from 2**126 up:
    [1, 4); an infinite absmax: inf), and ``reciprocal`` approximates ``1 / norm`` (about 2**-21; 0 for inf)."""
    divisor = tl.where(absmax > 0.0, absmax, 1.0)
    scale = tl.maximum(_exponent_complement(divisor) + (SCALE_BIAS - 0x7F800000), MIN_SCALE_BITS)
    scale = scale.to(tl.float32, bitcast=True)
    norm = divisor * scale
    root = tl.rsqrt(norm)  # one special-function instruction; the guess needs only ~20 correct bits
    return scale, norm, root * root


@triton.jit
def quantize8(values, scale, norm, reciprocal, tables):
    """uint8 codes of fp32 ``values`` against their blocks' :func:`quantize8_params` (broadcast to the values'
    shape)."""
    scaled = values * scale
    return settle8(scaled * reciprocal, scaled, norm, tables)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def quantize8_tile(values, mask, tables):
    """``(codes, absmax)`` of fp32 ``values`` ``(BLOCKS, 256)``, one quantization block per row; lanes outside
    ``mask`` (None: none) count as 0."""
    if mask is not None:
        values = tl.where(mask, values, 0.0)
    absmax = tl.reduce(tl.abs(values), 1, _max_nan)
    scale, norm, reciprocal = quantize8_params(absmax)
    return quantize8(values, scale[:, None], norm[:, None], reciprocal[:, None], tables), absmax


@triton.jit
def dequantize8(codes, absmax, qmap):
    """fp32 ``qmap[code] * absmax`` for uint8 ``codes`` (absmax broadcast to the codes' shape)."""
    return lookup(qmap, codes) * absmax


@triton.jit
def lookup(qmap, codes):
    """fp32 ``qmap[code]`` for integer ``codes`` (below 2**31), the address in one wide multiply-add."""
    return tl.load((qmap.to(tl.pointer_type(tl.uint8)) + wide_offset(codes.to(tl.uint32), 4)).to(
        tl.pointer_type(tl.float32)))


@triton.jit
def dequantize8_tile(codes_ptr, absmax_ptr, qmap, blocks, offs, mask, block_mask):
    """fp32 values of the 8-bit codes at ``codes_ptr + offs`` (``(BLOCKS, 256)``) with their blocks' absmax."""
    if mask is None:
        codes = tl.load(codes_ptr + offs)
        absmax = tl.load(absmax_ptr + blocks)
    else:
        codes = tl.load(codes_ptr + offs, mask=mask, other=0)
        absmax = tl.load(absmax_ptr + blocks, mask=block_mask, other=0.0)
    return dequantize8(codes, absmax[:, None], qmap)
