"""bf16 stochastic rounding in Triton: the twin of :mod:`hf_optim.numerics.rounding`, the same bits for every
element.

Same counter-based hash, same counters ``(ordinal << 32) + index in the parameter``, same key words (read from a
device tensor, so they are int64 whatever their value and a new step never recompiles). The PyTorch path computes
on int64 values held in 32 bits and masks after each multiply (torch has no uint32 arithmetic); here the hash runs
on uint32, whose multiply keeps exactly those low 32 bits (a product modulo 2^32 depends only on its factors
modulo 2^32), and whose shifts are the same on values below 2^32: the same bits for a third of the instructions.
(Every value hashed is below 2^32: element indices by ``rounding.MAX_INDEX``, ordinals by the parameter count.)
Kernels store parameters through :func:`store_param`, which rounds stochastically only where asked (``SR``, a
compile-time constant the host sets only for bf16 parameters).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_optim.kernels.triton_path.tile import BF16, launch_options, pointer, store_values
from hf_optim.numerics import rounding

MULTIPLIER_1: tl.constexpr = tl.constexpr(rounding.MULTIPLIER_1)
MULTIPLIER_2: tl.constexpr = tl.constexpr(rounding.MULTIPLIER_2)
ROUND_BLOCK = 1024
"""Elements per program of the standalone :func:`round_to_bf16`."""


@triton.jit
def mix32(x):
    """:func:`rounding.mix32` on uint32 values (the multiplies wrap modulo 2^32, as the PyTorch path's masks do)."""
    x = x ^ (x >> 16)
    x = x * MULTIPLIER_1
    x = x ^ (x >> 15)
    x = x * MULTIPLIER_2
    return x ^ (x >> 15)


@triton.jit
def random_bits16(index, ordinal, k0, k1):
    """16 random bits (uint32) for element ``index`` (< 2^32) of the parameter with ``ordinal``; ``k0``, ``k1``:
    the step's key words (int64 holding 32-bit values)."""
    x = mix32(index.to(tl.uint32) ^ k0.to(tl.uint32))
    x = mix32(x ^ ordinal.to(tl.uint32) ^ k1.to(tl.uint32))
    return x >> 16


@triton.jit
def round_to_bf16_bits(values, index, ordinal, k0, k1):
    """bf16 bit patterns (uint16) of fp32 ``values``, rounded stochastically (NaN stays the quiet NaN 0x7FC0). The
    upper half of ``bits + random`` modulo 2^32: the PyTorch path's int64 sum shifted and masked to 16 bits."""
    bits = values.to(tl.uint32, bitcast=True)
    rounded = (bits + random_bits16(index, ordinal, k0, k1)) >> 16
    return tl.where(values != values, 0x7FC0, rounded).to(tl.uint16)


@triton.jit
def store_param(address, offs, values, mask, ordinal, key, DTYPE: tl.constexpr, SR: tl.constexpr,
                ALIGNED: tl.constexpr):
    """``store_values`` of fp32 ``values`` into a parameter of dtype code ``DTYPE``; with ``SR`` (bf16 only) it is
    rounded stochastically, ``offs`` being the elements' indices in it and ``key`` the address of the two key
    words."""
    if SR:
        tl.static_assert(DTYPE == BF16, "stochastic rounding stores into bf16 parameters only")
        bits = round_to_bf16_bits(values, offs, ordinal, tl.load(key), tl.load(key + 1))
        tl.store(pointer(address, tl.uint16, ALIGNED) + offs, bits, mask=mask)
    else:
        store_values(address, offs, values, mask, DTYPE, ALIGNED)


@triton.jit
def _round_kernel(values_ptr, out_ptr, n, start, ordinal, key, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    values = tl.load(values_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, round_to_bf16_bits(values, start + offs, ordinal, tl.load(key), tl.load(key + 1)),
             mask=mask)


def round_to_bf16(values: torch.Tensor, ordinal: int, key: torch.Tensor, start: int = 0) -> torch.Tensor:
    """Standalone twin of :func:`rounding.round_to_bf16` for flat fp32 ``values`` that are elements ``start...`` of
    the parameter with ``ordinal`` (for tests and tools)."""
    values = values.contiguous().view(-1)
    out = torch.empty(values.shape, dtype=torch.int16, device=values.device)
    if values.numel():
        _round_kernel[(triton.cdiv(values.numel(), ROUND_BLOCK),)](
            values, out, values.numel(), start, torch.tensor(ordinal, dtype=torch.int64).item(),
            key.to(values.device), BLOCK=ROUND_BLOCK, **launch_options(),
        )
    return out.view(torch.bfloat16)


def device_key(seed: int, step: int, device: torch.device) -> torch.Tensor:
    """The step's two key words as an int64 device tensor."""
    return rounding.key_tensor(seed, step).to(device)
