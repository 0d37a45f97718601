"""The tile every hf_optim elementwise Triton kernel works on, and its precision helpers: the one place where Triton
kernels handle parameter and gradient dtypes.

A program works on ``BLOCKS`` consecutive 256-element blocks of one tensor, as offsets shaped
``(BLOCKS, 2, ROWS, W)``: each 256-element block (an 8-bit quantization block) is two halves of 128 elements (4-bit
quantization blocks), each half ``ROWS = 128 / W`` rows of ``W`` consecutive elements, and a row is what one thread
holds. The shape is the design:

- a row is one vector access per thread (``W`` bf16 values are 16 bytes), and the ``W`` codes of a row of a 4-bit
  state are one 16- or 32-bit word, unpacked with shifts inside the thread (no byte-by-byte access, no reshape
  through shared memory);
- a block's or half's absmax is a reduction over axes the compiler maps to one warp (warp shuffles, no barrier);
- per-block values (absmax, scale) are the tile's own slices (``x[:, None, None, None]`` broadcasts them), so no
  layout conversion is needed between a block's values and its elements.

Every choice that used to be a run-time branch (dtype, state format, whole or partial tile, stochastic rounding) is a
``tl.constexpr`` of the kernel, chosen on the host, so each compiled binary holds one straight path. Whole tiles
pass ``mask=None``: no predicates at all; a tensor's last, partial tile passes ``offs < n``.

bf16 is loaded by shifting its bits into an fp32 and stored rounding to nearest even, as torch does
(:func:`fp32_to_bf16`).
"""

from __future__ import annotations

import os
import re

import torch
import triton
import triton.language as tl

FP32: tl.constexpr = tl.constexpr(0)
BF16: tl.constexpr = tl.constexpr(1)
FP16: tl.constexpr = tl.constexpr(2)
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
"""Compile-time dtype codes of :func:`load_values` / :func:`store_values`."""
DTYPE_NAMES = {0: "fp32", 1: "bf16", 2: "fp16"}

HALF: tl.constexpr = tl.constexpr(128)


def dtype_code(dtype: torch.dtype) -> int:
    if dtype not in DTYPE_CODES:
        raise TypeError(f"hf_optim's Triton kernels take float32, bfloat16 or float16 tensors, got {dtype}")
    return DTYPE_CODES[dtype]


@triton.jit
def tile(first_block, BLOCKS: tl.constexpr, W: tl.constexpr):
    """``(blocks (BLOCKS,), halves (BLOCKS, 2), rows (BLOCKS, 2, ROWS), offs (BLOCKS, 2, ROWS, W))`` of the tile
    starting at 256-element block ``first_block``: block, half-block and row indices in the tensor, and element
    offsets."""
    blocks = first_block + tl.arange(0, BLOCKS)
    halves = blocks[:, None] * 2 + tl.arange(0, 2)[None, :]
    rows = halves[:, :, None] * (HALF // W) + tl.arange(0, HALF // W)[None, None, :]
    offs = rows[:, :, :, None] * W + tl.arange(0, W)[None, None, None, :]
    return blocks, halves, rows, offs


@triton.jit
def _max_with_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def half_max(x):
    """Per-128-half max (``(BLOCKS, 2)``) of a tile-shaped tensor, NaN-propagating as torch's ``amax``."""
    return tl.reduce(tl.reduce(x, 3, _max_with_nan), 2, _max_with_nan)


@triton.jit
def block_max(x):
    """Per-256-block max of a tile-shaped tensor, NaN-propagating as torch's ``amax``."""
    return tl.reduce(half_max(x), 1, _max_with_nan)


@triton.jit
def per_block(values):
    """A ``(BLOCKS,)`` per-block value broadcast over the tile."""
    return values[:, None, None, None]


@triton.jit
def store_per_block(ptr, blocks, rows, values, block_mask):
    """``ptr[blocks] = values`` (``(BLOCKS,)``), written by each block's first thread. The store is shaped like the
    tile's rows (one lane per thread, lane ``i`` of a block addressing ``ptr[block + i]``, all but the first masked
    off), so the compiler gives it the tile's own layout and the values stay where the block reduction left them;
    a ``(BLOCKS,)``-shaped store would get a layout of its own and a round trip through shared memory."""
    # rows are non-negative and a block has a power-of-two number of them: a mask, not a signed remainder
    tl.static_assert((rows.shape[2] & (rows.shape[2] - 1)) == 0, "rows per half must be a power of two")
    lane = rows & (2 * rows.shape[2] - 1)
    first = lane == 0
    if block_mask is not None:
        first = first & block_mask[:, None, None]
    tl.store(ptr + blocks[:, None, None] + lane, tl.broadcast_to(values[:, None, None], rows.shape), mask=first)


@triton.jit
def tile_sum(x):
    """Sum of a tile-shaped tensor (LAMB's and Adafactor's per-tile partial sums)."""
    return tl.sum(tl.sum(tl.sum(tl.sum(x, axis=3), axis=2), axis=1), axis=0)


@triton.jit
def masked_load(pointers, mask, other):
    """``tl.load`` of a whole tile (``mask`` None: no predicates) or a partial one (lanes outside read ``other``)."""
    if mask is None:
        values = tl.load(pointers)
    else:
        values = tl.load(pointers, mask=mask, other=other)
    return values


@triton.jit
def zero_outside(values, mask):
    """``values`` with lanes outside ``mask`` set to 0 (a whole tile: unchanged)."""
    if mask is not None:
        values = tl.where(mask, values, 0.0)
    return values


@triton.jit
def pointer(address, TYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """A typed pointer from an integer address; ``ALIGNED`` promises 16-byte alignment (the host checked), which
    with whole tiles lets the compiler use vector loads and stores."""
    ptr = address.to(tl.pointer_type(TYPE))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def bf16_to_fp32(bits):
    return (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)


INTERPRETED: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))
"""Whether the kernels run in Triton's CPU interpreter (read when this module is imported, as Triton reads it)."""


@triton.jit
def fp32_to_bf16(values):
    """bf16 bit patterns (uint16) of fp32 ``values``, rounded to nearest even as torch converts on the same device.

    Compiled: the hardware conversion (``cvt.rn.bf16.f32``, one instruction per two values from sm_80), what torch's
    CUDA kernels use. The interpreter's cast truncates, so there the same rounding is spelled out with integer
    operations, as torch's CPU conversion computes it. Both round every number identically; a NaN becomes the
    device's canonical quiet NaN (0x7FFF on CUDA, 0x7FC0 in torch's CPU code)."""
    if INTERPRETED:
        bits = values.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        out = tl.where(values != values, 0x7FC0, rounded).to(tl.uint16)
    else:
        out = values.to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.uint16, bitcast=True)
    return out


@triton.jit
def load_values(address, offs, mask, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """fp32 values of a float tensor of dtype code ``DTYPE`` at integer ``address``."""
    if DTYPE == BF16:
        values = bf16_to_fp32(masked_load(pointer(address, tl.uint16, ALIGNED) + offs, mask, 0))
    elif DTYPE == FP16:
        values = masked_load(pointer(address, tl.float16, ALIGNED) + offs, mask, 0.0).to(tl.float32)
    else:
        values = masked_load(pointer(address, tl.float32, ALIGNED) + offs, mask, 0.0)
    return values


@triton.jit
def store_values(address, offs, values, mask, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """Store fp32 ``values`` into a float tensor of dtype code ``DTYPE``, rounding to nearest even."""
    if DTYPE == BF16:
        tl.store(pointer(address, tl.uint16, ALIGNED) + offs, fp32_to_bf16(values), mask=mask)
    elif DTYPE == FP16:
        tl.store(pointer(address, tl.float16, ALIGNED) + offs, values.to(tl.float16), mask=mask)
    else:
        tl.store(pointer(address, tl.float32, ALIGNED) + offs, values, mask=mask)


TRITON_VERSION = tuple(int(part) for part in re.findall(r"\d+", triton.__version__)[:2])
"""(major, minor) of the installed Triton: the launch plans were measured on 3.9, and 3.8 allocates registers
differently in a few configurations (``FusedConfig.whole_tile_width``, the formats' ``TritonRows.narrow_tile``,
``AdafactorConfig.launch_options``)."""

SM_64_WARPS = frozenset({80, 90, 100})
"""Compute capabilities whose SMs hold 64 warps (A100, H100, B200): 50% occupancy at 4 warps per program needs at
most 64 registers per thread (sm_86, sm_89, sm_120 hold 48, sm_75 32)."""


def launch_options(num_warps: int = 4) -> dict:
    """Options every hf_optim kernel launch passes: no floating-point contraction (each multiply and add rounds on
    its own, as torch's separate eager operations do; explicit ``tl.fma`` stays), set explicitly rather than left
    to Triton's default (which changes in Triton 3.10), and the configuration's ``num_warps``. The interpreter
    ignores both."""
    return {"enable_fp_fusion": False, "num_warps": num_warps}
