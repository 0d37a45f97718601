"""Stochastic rounding of fp32 results into bf16 parameters, with counter-based random bits (the PyTorch path).

bf16 keeps 8 bits of mantissa, so round-to-nearest drops any update smaller than about 2^-9 of a weight: a pure-bf16
fine-tune at lr 1e-5 loses most of its updates. Stochastic rounding keeps them in expectation: bf16 is the upper
16 bits of an fp32 pattern, so adding 16 uniform random bits to the pattern and truncating rounds away from zero
with probability equal to the discarded fraction (the magnitude grows with the pattern for either sign). Values
that bf16 represents exactly are unchanged; NaN stays NaN; infinities stay infinite.

The random bits are a pure function of ``(seed, step, parameter ordinal, element index)``: a counter-based hash
(two rounds of a 32-bit multiply-xorshift mixer), never torch's global generator, which the Trainer and dropout
also draw from. So a run resumed from a checkpoint draws the same bits as an uninterrupted run, and every path
draws the same bits for an element: tensor by tensor or gathered into multi-tensor chunks, compiled or eager, and
the Triton twin (:mod:`hf_optim.kernels.triton_path.rounding`).

Arithmetic: int64 tensors holding 32-bit values, multipliers below 2^31 (so a product never overflows int64) and
masking to 32 bits after each multiply; no data-dependent control flow, so inductor compiles it into the update.

Counters: an element's counter is ``(ordinal << 32) + index``, its index within the whole parameter (below 2^32)
and the parameter's ordinal within its optimizer (torch's state-dict numbering). Kernels that work in the block
form ``(blocks, 256)`` get one int64 *base* per block (the counter of its first element): a chunk that gathers
pieces of many small tensors carries each block's own base, at 8 bytes per 256 elements, since every 256-element
block of the multi-tensor layout belongs to one tensor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from hf_optim.numerics import BLOCK_SIZE

MASK32 = 0xFFFFFFFF
MULTIPLIER_1 = 0x21F0AAAD
MULTIPLIER_2 = 0x735A2D97
"""The multipliers of a well-tested 32-bit integer hash (C. Wellons' hash prospector); both below 2^31, so a
32-bit value times either fits in int64 on every path."""
KEY_SALT = 0x5BD1E995 & 0x7FFFFFFF
MAX_INDEX = 1 << 32
"""Elements per parameter the counters can number (a 128K x 4K embedding has 2^29)."""
QUIET_NAN = 0x7FC0


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit mixer on int64 tensors holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * MULTIPLIER_1) & MASK32
    x = x ^ (x >> 15)
    x = (x * MULTIPLIER_2) & MASK32
    return x ^ (x >> 15)


def host_mix32(x: int) -> int:
    """:func:`mix32` on a Python int (the step keys are mixed on the host)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * MULTIPLIER_1) & MASK32
    x ^= x >> 15
    x = (x * MULTIPLIER_2) & MASK32
    return x ^ (x >> 15)


def step_key(seed: int, step: int) -> tuple[int, int]:
    """The two 32-bit key words of ``(seed, step)``: distinct steps and seeds give unrelated words."""
    k0 = host_mix32(host_mix32(step & MASK32) ^ (seed & MASK32))
    k1 = host_mix32(k0 ^ KEY_SALT ^ ((step >> 32) & MASK32))
    return k0, k1


def key_tensor(seed: int, step: int) -> torch.Tensor:
    """:func:`step_key` as a ``(2,)`` int64 CPU tensor (a graph input: a new step never recompiles)."""
    return torch.tensor(step_key(seed, step), dtype=torch.int64)


def random_bits16(counters: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """16 uniform random bits (int64 in [0, 65536)) per int64 counter, for the ``(2,)`` key words ``key``."""
    low = counters & MASK32
    high = counters >> 32
    x = mix32(low ^ key[0])
    x = mix32(x ^ high ^ key[1])
    return x >> 16


def element_counters(bases: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Counters of a tile of ``shape``: block form ``(blocks, 256)`` with one base per block, or a flat ``(n,)``
    run with one base (its first element's)."""
    lanes = torch.arange(shape[-1], dtype=torch.int64, device=bases.device)
    if len(shape) == 2:
        return bases.unsqueeze(-1) + lanes
    return bases + lanes


def round_to_bf16(values: torch.Tensor, counters: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """fp32 ``values`` rounded stochastically to bfloat16 (up with probability equal to the discarded fraction)."""
    bits = values.view(torch.int32).to(torch.int64)
    upper = (bits + random_bits16(counters, key)) >> 16  # the bf16 pattern, as a signed 16-bit value
    # A NaN whose payload sits in the low bits would carry into the exponent or sign: NaN becomes the quiet NaN
    # 0x7FC0 (as the Triton kernels store it).
    return torch.where(torch.isnan(values), QUIET_NAN, upper).to(torch.int16).view(torch.bfloat16)


def tensor_bases(ordinal: int, start: int, stop: int, block_form: bool, device: torch.device) -> torch.Tensor:
    """Per-block counter bases of elements ``[start, stop)`` of one parameter: one per 256-element block in block
    form, else the single base of a flat run."""
    first = (ordinal << 32) + start
    if not block_form:
        return torch.tensor([first], dtype=torch.int64, device=device)
    return first + BLOCK_SIZE * torch.arange((stop - start) // BLOCK_SIZE, dtype=torch.int64, device=device)


def write_rounded(param: torch.Tensor, values: torch.Tensor, ordinal: int, key: torch.Tensor,
                  chunk: int = 1 << 18) -> None:
    """``param.copy_(values)`` for a bf16 ``param`` (contiguous or not), rounding the fp32 ``values`` (same shape)
    stochastically, element ``i`` of the flattened parameter with counter ``(ordinal << 32) + i``; in chunks of
    ``chunk`` elements, so the hash's int64 temporaries stay small."""
    flat = values.reshape(-1).float()
    out = torch.empty(flat.shape, dtype=torch.bfloat16, device=param.device)
    key = key.to(param.device)
    for start in range(0, flat.numel(), chunk):
        stop = min(start + chunk, flat.numel())
        counters = (ordinal << 32) + torch.arange(start, stop, dtype=torch.int64, device=param.device)
        out[start:stop] = round_to_bf16(flat[start:stop], counters, key)
    param.copy_(out.view(param.shape))


def check_index_range(numel: int, where: str) -> None:
    """Refuse a parameter too large to number its elements with 32-bit indices."""
    if numel > MAX_INDEX:
        raise ValueError(
            f"bf16_stochastic_round numbers elements with 32-bit indices; {where} has {numel} elements "
            f"(at most {MAX_INDEX})"
        )


@dataclass
class Stream:
    """A step's stochastic rounding: the step's key words and, for a multi-tensor chunk, each member's parameter
    ordinal (``ordinals``) or, for one tensor, its ordinal (``ordinal``)."""

    key: torch.Tensor
    ordinal: int = 0
    ordinals: Mapping[int, int] = field(default_factory=dict)
    cache: dict = field(default_factory=dict)
    """Chunk bases by (chunk, ordinals of its pieces): they depend on the layout only, so they are reused across
    steps when the caller passes the same dict each step."""

    def chunk_bases(self, chunk, device: torch.device) -> torch.Tensor:
        """Per-block bases of a multi-tensor chunk (``multi_tensor.Chunk``: block-aligned pieces of members);
        padding blocks get base 0 (their values are zeros and never written back)."""
        pieces: Sequence = chunk.pieces
        cache_key = (chunk, tuple(self.ordinals[piece.member] for piece in pieces), device)
        found = self.cache.get(cache_key)
        if found is not None:
            return found
        bases = torch.zeros(-(-(chunk.stop - chunk.start) // BLOCK_SIZE), dtype=torch.int64)
        for piece in pieces:
            first, count = piece.at // BLOCK_SIZE, -(-piece.length // BLOCK_SIZE)
            origin = (self.ordinals[piece.member] << 32) + piece.start
            bases[first : first + count] = origin + BLOCK_SIZE * torch.arange(count, dtype=torch.int64)
        bases = bases.to(device)
        self.cache[cache_key] = bases
        return bases
