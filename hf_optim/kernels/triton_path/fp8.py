"""The fp8 state format in Triton: the twin of :mod:`hf_optim.formats.fp8` (same bytes, same absmax), and its Triton
branch (:data:`FP8_ROWS`, see :mod:`rows`).

A row is one e4m3 byte per element and one fp32 absmax per 256-element block (the tile's block). If the format
stores square roots of non-negative rows (``Fp8.stores_root``; the registered format does not), decoded values of
such rows are squared and stored ones square-rooted first.

Two conversions, chosen at compile time (``NATIVE``):

- native (sm_89 and later): ``.to(tl.float8e4nv)``, the hardware's ``cvt.rn.satfinite.e4m3x2.f32`` (round to nearest
  even, from fp32 directly) and its widening back;
- software (every other target, the interpreter included): integer arithmetic on the fp32 bits, equal bit for bit.
  Triton 3.9 refuses ``float8e4nv`` below sm_89 (``benchmarks/gpu/gpu_static.py``-style compiles for sm_75/80/86 fail:
  "type fp8e4nv not supported in this architecture"), so those targets need it.

Encoding follows the PyTorch twin: ``q = clamp(x * (448 / absmax), -448, 448)`` with the reciprocal computed once per
block (0 for an all-zero block), then the nearest e4m3 value, ties to even. Decoding: ``float(q) * (absmax / 448)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_optim.formats import fp8 as fp8_format
from hf_optim.formats.fp8 import FP8
from hf_optim.kernels.triton_path.rounding import mix32
from hf_optim.kernels.triton_path.rows import FusedConfigLike, TritonRows
from hf_optim.kernels.triton_path.tile import (
    SM_64_WARPS,
    TRITON_VERSION,
    block_max,
    launch_options,
    masked_load,
    pointer,
    store_per_block,
    zero_outside,
)

FMAX: tl.constexpr = tl.constexpr(448.0)
SUBNORMAL_LIMIT: tl.constexpr = tl.constexpr(2.0**-6)
"""Smallest normal e4m3 magnitude; below it the step is 2**-9."""
ROOT_UNSIGNED: tl.constexpr = tl.constexpr(FP8.stores_root(False))
"""Whether non-negative rows hold square roots."""
SR_UNSIGNED: tl.constexpr = tl.constexpr(FP8.rounds_stochastically(False))
"""Whether non-negative rows are rounded stochastically (:func:`round_e4m3_stochastically`)."""
SR_SALT: tl.constexpr = tl.constexpr(fp8_format.SR_SALT)
EXPONENT_REBIAS: tl.constexpr = tl.constexpr((127 - 7) << 3)
"""fp32 and e4m3 exponent biases (127, 7), in units of e4m3's 3 mantissa bits."""


@triton.jit
def decode_e4m3(codes, NATIVE: tl.constexpr):
    """fp32 values of e4m3 bytes (uint8). Every byte but the NaNs (0x7F, 0xFF: never stored) is exact in fp32."""
    if NATIVE:
        values = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        bits = codes.to(tl.int32)
        exponent = (bits >> 3) & 0xF
        mantissa = bits & 7
        normal = ((exponent << 3 | mantissa) + EXPONENT_REBIAS) << 20
        magnitude = tl.where(exponent == 0, mantissa.to(tl.float32) * (2.0**-9), normal.to(tl.float32, bitcast=True))
        # the sign goes in as a bit, not by negation: compiled for a GPU, ``where(negative, -m, m)`` gave +0.0 for
        # code 0x80 (-0.0) on an H200
        sign = (bits & 0x80).to(tl.uint32) << 24
        values = (magnitude.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return values


@triton.jit
def encode_e4m3(scaled, NATIVE: tl.constexpr):
    """e4m3 bytes (uint8) nearest to fp32 ``scaled`` in [-448, 448], ties to even, as ``Tensor.to(float8_e4m3fn)``."""
    if NATIVE:
        codes = scaled.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        bits = scaled.to(tl.int32, bitcast=True)
        sign = (bits >> 24) & 0x80
        magnitude_bits = bits & 0x7FFFFFFF
        # normal: round the fp32 mantissa to 3 bits (add just under half, plus the kept lowest bit: ties to even);
        # a carry into the exponent is the next binade's code, as it should be
        rounded = magnitude_bits + 0x7FFFF + ((magnitude_bits >> 20) & 1)
        normal = (rounded >> 20) - EXPONENT_REBIAS
        # subnormal: the nearest multiple of 2**-9 (k in 0..8; 8 is the code of 2**-6), ties to even
        steps = tl.abs(scaled) * 512.0  # exact: a power-of-two scaling
        whole = steps.to(tl.int32)  # truncation
        fraction = steps - whole.to(tl.float32)  # exact
        up = (fraction > 0.5) | ((fraction == 0.5) & ((whole & 1) == 1))
        subnormal = whole + up.to(tl.int32)
        magnitude = tl.where(tl.abs(scaled) < SUBNORMAL_LIMIT, subnormal, normal)
        codes = (sign | magnitude).to(tl.uint8)
    return codes


@triton.jit
def round_e4m3_stochastically(scaled, lane):
    """Twin of ``formats.fp8._round_e4m3_stochastically``: non-negative fp32 ``scaled`` (<= 448) rounded to e4m3
    values, up with probability equal to the dropped fraction, from 20 bits hashed from the value's bits and its
    ``lane`` in its 256-element block (uint32 arithmetic: the PyTorch twin's masked int64 values)."""
    bits = scaled.to(tl.uint32, bitcast=True)
    random = mix32(mix32(bits ^ SR_SALT) ^ lane.to(tl.uint32)) >> 12
    normal = tl.minimum((((bits + random) >> 20) << 20).to(tl.float32, bitcast=True), FMAX)
    steps = scaled * 512.0  # exact: a power-of-two scaling
    whole = tl.floor(steps)
    up = (steps - whole) * 1048576.0 > random.to(tl.float32)  # both sides exact
    subnormal = (whole + up.to(tl.float32)) * (2.0**-9)
    return tl.where(scaled < SUBNORMAL_LIMIT, subnormal, normal)


@triton.jit
def load_state_fp8(codes_ptr, absmax_ptr, blocks, offs, mask, block_mask, SIGNED: tl.constexpr, NATIVE: tl.constexpr):
    """fp32 values of an fp8 row (squared when the row holds square roots)."""
    codes = masked_load(codes_ptr + offs, mask, 0)
    absmax = masked_load(absmax_ptr + blocks, block_mask, 0.0)
    values = decode_e4m3(codes, NATIVE) * tl.div_rn(absmax, FMAX)[:, None, None, None]
    if ROOT_UNSIGNED and not SIGNED:
        values = values * values
    return values


@triton.jit
def quantize_fp8(values, offs, mask, SIGNED: tl.constexpr, NATIVE: tl.constexpr):
    """(e4m3 bytes, absmax per 256-block) of fp32 tile ``values`` (their square roots for a non-negative row of a
    format storing them; rounded stochastically for a non-negative row of a format doing so, ``offs`` being the
    elements' indices in their tensor, whose blocks start at multiples of 256); lanes outside ``mask`` count as
    0."""
    if ROOT_UNSIGNED and not SIGNED:
        values = tl.sqrt_rn(tl.maximum(values, 0.0))
    values = zero_outside(values, mask)
    absmax = block_max(tl.abs(values))
    reciprocal = tl.where(absmax > 0.0, tl.div_rn(FMAX, tl.where(absmax > 0.0, absmax, 1.0)), 0.0)
    scaled = tl.clamp(values * reciprocal[:, None, None, None], -FMAX, FMAX)
    if SR_UNSIGNED and not SIGNED:
        scaled = round_e4m3_stochastically(scaled, offs & 255)
    return encode_e4m3(scaled, NATIVE), absmax


@triton.jit
def load_fp8(address, absmax_address, qmap, blocks, halves, rows, offs, mask, n, SIGNED: tl.constexpr,
             ALIGNED: tl.constexpr, NATIVE: tl.constexpr):
    """fp32 values of an fp8 row (the :mod:`rows` signature; no map)."""
    block_mask = None if mask is None else blocks * 256 < n
    return load_state_fp8(pointer(address, tl.uint8, ALIGNED), absmax_address.to(tl.pointer_type(tl.float32)),
                          blocks, offs, mask, block_mask, SIGNED, NATIVE)


@triton.jit
def store_fp8(address, absmax_address, encoder, blocks, halves, rows, offs, values, mask, n, SIGNED: tl.constexpr,
              ALIGNED: tl.constexpr, NATIVE: tl.constexpr):
    """Re-encode fp32 ``values`` into an fp8 row against their new block absmax (no encoder table)."""
    block_mask = None if mask is None else blocks * 256 < n
    codes, absmax = quantize_fp8(values, offs, mask, SIGNED, NATIVE)
    tl.store(pointer(address, tl.uint8, ALIGNED) + offs, codes, mask=mask)
    store_per_block(absmax_address.to(tl.pointer_type(tl.float32)), blocks, rows, absmax, block_mask)


def native_fp8(arch: int) -> bool:
    """The hardware's float8 conversions: sm_89 and later have them (Triton refuses ``float8e4nv`` below)."""
    return arch >= 89


def narrow_tile_fp8(config: FusedConfigLike) -> bool:
    """4 elements per thread where 8 take more than 64 registers on the SMs of 64 warps (50% occupancy): with the
    integer conversions (sm_80), 80-85 registers at 8 with 16-bit parameters; on sm_90 in two rows with stochastic
    rounding, AdamW takes 71 registers at 8, a 4-byte spill with a limit of 64, and 48 at 4. Triton 3.8 (torch
    2.14's) also on sm_90 in two rows: AdamW bf16 spills 68-72 bytes at 8 under the limit of 64 and takes 84-94
    registers (31% occupancy) without it; 54-56 registers at 4, no spill."""
    two_rows = len(config.formats) == 2
    if config.arch in SM_64_WARPS and not native_fp8(config.arch):
        return True
    return config.arch == 90 and two_rows and (config.stochastic or TRITON_VERSION < (3, 9))


def register_limit_fp8(config: FusedConfigLike) -> int | None:
    """64 for whole tiles of width 8 on sm_90: RMSprop with fp8 state takes 67 registers there without a limit (fp16
    parameters) and 69 (bf16, stochastic rounding), none spilled with it; the other fp8 configurations of width 8
    stay at or under 64 with it, a few registers lower."""
    return 64 if config.arch == 90 and config.full and config.whole_tile_width == 8 else None


FP8_ROWS = TritonRows("fp8", load_fp8, store_fp8, narrow_tile=narrow_tile_fp8, register_limit=register_limit_fp8,
                      native=native_fp8)
"""``FP8.triton_rows``."""


@triton.jit
def _convert_kernel(values_ptr, out_ptr, n, ENCODE: tl.constexpr, NATIVE: tl.constexpr, STOCHASTIC: tl.constexpr,
                    BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if ENCODE:
        values = tl.load(values_ptr + offs, mask=mask, other=0.0)
        if STOCHASTIC:
            values = round_e4m3_stochastically(values, offs & 255)
        tl.store(out_ptr + offs, encode_e4m3(values, NATIVE), mask=mask)
    else:
        tl.store(out_ptr + offs, decode_e4m3(tl.load(values_ptr + offs, mask=mask, other=0), NATIVE), mask=mask)


def convert(values: torch.Tensor, encode: bool, native: bool = False, stochastic: bool = False) -> torch.Tensor:
    """The element conversions alone over a flat tensor, for tests and the GPU check: fp32 values in [-448, 448] to
    e4m3 bytes (``encode``; with ``stochastic``, values in [0, 448] rounded as non-negative slots are, element ``i``
    in lane ``i % 256``), or e4m3 bytes (uint8) to fp32."""
    values = values.contiguous()
    out = torch.empty(values.shape, dtype=torch.uint8 if encode else torch.float32, device=values.device)
    block = 1024
    if values.numel():
        _convert_kernel[(triton.cdiv(values.numel(), block),)](values, out, values.numel(), ENCODE=encode,
                                                               NATIVE=native, STOCHASTIC=stochastic, BLOCK=block,
                                                               **launch_options())
    return out

