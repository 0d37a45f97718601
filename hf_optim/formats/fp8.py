"""Blockwise-scaled float8 state: each element a float8 number, one fp32 absmax per 256 elements.

A slot ``stateK`` holds the codes as a float8 tensor in the slot's shape (``(rows, *shape)`` when stacked),
``absmaxK`` one fp32 absmax per block of :data:`BLOCK_SIZE` elements (per row). There is no map: the float8 type is
the code book. Encoding ("saturating", like the hardware's ``satfinite`` conversions): ``q = clamp(x * (FMAX /
absmax), -FMAX, FMAX)``, ``FMAX`` being the type's largest finite value, so the block's largest magnitude maps to
``FMAX``; an all-zero block stores zeros. Signed slots (first moments) round ``q`` to the nearest float8 (ties to
even, what ``Tensor.to(float8)`` does); non-negative slots (second moments) round it stochastically
(:func:`_round_e4m3_stochastically`: up with probability equal to the fraction of a step it drops). Decoding:
``float(q) * (absmax / FMAX)``. The reciprocal and the decode scale are computed once per block in fp32, each by one
correctly rounded division (``exact_math.div``; Triton's ``div_rn``), so every path (eager, inductor, Triton) rounds
the same way.

Both moments are e4m3 (``torch.float8_e4m3fn``: 3 mantissa bits, 448 at most, subnormals down to 2**-9), as in torchao's
``AdamWFp8``. Chosen by measurement (docs/lab/2026-measurements.md#fp8-state-issue-24,
``benchmarks/quality/quality4.py``) over
storing ``sqrt(v)`` in e4m3 (half the dynamic range, but twice the relative step on ``v``) and ``v`` in e5m2 (more
range, 2 mantissa bits): rounded to nearest, on the MLP regression their final losses moved 6-8% off 32-bit AdamW's,
e4m3's 3-4%; on the tiny fine-tune all stay within 0.6%. That gap is the second moment's (with an fp32 ``v`` and an e4m3
``m`` the MLP ends within 0.3%): rounded to nearest, a ``v`` re-rounded to 3 mantissa bits every step cannot take
``beta2``'s 0.1% decrements (``0.999 * v`` rounds back to ``v``), so it stays high after a large gradient. Rounded
stochastically it keeps them in expectation: the MLP ends within 0.3%, at no extra state. Blocks of 128 measured no
better than 256. :func:`variant` builds the other choices for the benchmark.

The stochastic rounding's random bits are a hash of the scaled value's fp32 bits and its lane in the block
(:func:`sr_bits20`), not of the step and element counters that bf16 parameter rounding uses (``rounding``): those
are not passed to a format's ``store``. The bits are still a pure function of the values, so every path
(tensor by tensor or in multi-tensor chunks, eager, compiled, Triton) and every rerun draws the same ones. A scaled
value changes from step to step with its own gradient or with its block's absmax, and so do its bits; it repeats
only if neither moves (a block that only decays keeps its scaled values, and its fp32 absmax carries the decay).
``tests/formats/test_fp8.py`` checks that elements without gradients decay as ``beta2**t`` under a moving block maximum.

Flat buffers are all zero bytes (float8 +0.0), which decode to 0 whatever the absmax. The Triton twin is
:mod:`hf_optim.kernels.triton_path.fp8` (native conversion on sm_89+, bit-exact integer conversion below).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from hf_optim.formats.base import Scales, StateDictError, StateFormat, in_blocks, register_format
from hf_optim.numerics import BLOCK_SIZE as CHUNK_BLOCK
from hf_optim.numerics import exact_math, padded_blocks, rounding

BLOCK_SIZE = 256
"""Elements per scale block: the multi-tensor chunks' block, so block form needs no reshaping (128 measured no
better: docs/lab/2026-measurements.md#quality-and-the-second-moment-choice, the B128 row)."""

FMAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
"""Largest finite value of each float8 type."""

SECOND_MOMENT = "e4m3_sr"
"""How the registered format stores non-negative slots: ``"e4m3_sr"`` (``v`` itself, rounded stochastically), or,
for measurement only (:func:`variant`), ``"e4m3"`` (rounded to nearest), ``"sqrt_e4m3"`` (``sqrt(v)`` in e4m3,
nearest) or ``"e5m2"`` (nearest)."""


SR_SALT = 0x2545F491
"""Mixed into the stochastic rounding's hash (any odd 32-bit constant: keeps value 0 of lane 0 off a fixed point)."""
SUBNORMAL_LIMIT = 2.0**-6
"""Smallest normal e4m3 magnitude; below it the step is 2**-9."""


def sr_bits20(scaled: torch.Tensor) -> torch.Tensor:
    """20 pseudo-random bits (int64 in [0, 2^20)) per element of block-form ``(rows, blocks, 256)`` fp32 ``scaled``:
    a hash of the value's fp32 bits and its lane in the block, so every path draws the same bits."""
    lane = torch.arange(scaled.shape[-1], dtype=torch.int64, device=scaled.device)
    bits = scaled.view(torch.int32).to(torch.int64) & rounding.MASK32
    return rounding.mix32(rounding.mix32(bits ^ SR_SALT) ^ lane) >> 12


def _round_e4m3_stochastically(scaled: torch.Tensor) -> torch.Tensor:
    """Non-negative fp32 ``scaled`` (<= 448, block form) rounded stochastically to e4m3 values (then exact in e4m3):
    up with probability equal to the fraction of a step dropped. Normal range: add 20 random bits to the 20 fp32
    mantissa bits e4m3 drops and truncate them (a carry moves to the next binade, as it should); subnormal range:
    a multiple of 2**-9."""
    random = sr_bits20(scaled)
    bits = scaled.view(torch.int32).to(torch.int64)
    normal = (((bits + random) >> 20) << 20).to(torch.int32).view(torch.float32).clamp_max(448.0)
    steps = scaled * 512.0  # exact: a power-of-two scaling
    whole = torch.floor(steps)
    up = (steps - whole) * 1048576.0 > random.to(torch.float32)  # both sides exact
    subnormal = (whole + up.to(torch.float32)) * (2.0**-9)
    return torch.where(scaled < SUBNORMAL_LIMIT, subnormal, normal)


def _unblocked(blocked: torch.Tensor, like_shape: torch.Size) -> torch.Tensor:
    if len(like_shape) == 3:
        return blocked.reshape(like_shape)
    return blocked.flatten(1)[:, : like_shape[-1]]


class Fp8(StateFormat):
    name, bits, code, width, block_size = "fp8", 8, 4, 2, BLOCK_SIZE
    # rank between blockwise8 (2) and blockwise4 (3): as large as blockwise8, and measured further from 32-bit
    # AdamW (docs/performance.md#quality-of-quantized-state), so tables and the planner put bitsandbytes' format first
    class_suffix, optim_suffix, label, rank, optim_bits = "Fp8", "fp8", "8-bit float (fp8)", 2.5, None
    second_moment = SECOND_MOMENT
    # The Triton branch (kernels/triton_path/fp8.py): bit-exact with this file's math in the interpreter
    # (tests/kernels/test_triton_kernels.py), every configuration compiled for sm_75..sm_90 without spills and at >= 50%
    # occupancy (benchmarks/gpu/gpu_static.py); on an H200 the native sm_89+ conversions and the software ones passed
    # `pytest -m gpu tests/formats/test_fp8.py tests/kernels/test_triton_kernels.py -k Fp8` (docs/performance.md has
    # its speed).
    triton_rows = "hf_optim.kernels.triton_path.fp8:FP8_ROWS"

    def dtype(self, signed: bool) -> torch.dtype:
        """The float8 type of a slot: e4m3, or e5m2 for the ``"e5m2"`` second-moment variant."""
        return torch.float8_e5m2 if not signed and self.second_moment == "e5m2" else torch.float8_e4m3fn

    def rounds_stochastically(self, signed: bool) -> bool:
        """Whether a slot's values are rounded stochastically into e4m3 (non-negative slots of ``"e4m3_sr"``)."""
        return not signed and self.second_moment == "e4m3_sr"

    def stores_root(self, signed: bool) -> bool:
        """Whether a slot holds ``sqrt`` of its values (non-negative slots of the ``"sqrt_e4m3"`` format)."""
        return not signed and self.second_moment == "sqrt_e4m3"

    # -- allocation -------------------------------------------------------------------------------------------
    def init_slot(self, state: dict, spec, param: torch.Tensor, allocate: Callable) -> None:
        shape = tuple(param.shape) if spec.rows == 1 else (spec.rows, *param.shape)
        state[spec.key] = allocate(shape, dtype=self.dtype(spec.signed), device=param.device,
                                   elements=param.numel())
        blocks = self.num_blocks(param.numel())
        state[spec.absmax_key] = self.zero_absmax(spec, blocks, param.device)

    def raw(self, state: dict, spec) -> list[torch.Tensor]:
        return [state[spec.key].view(spec.rows, -1), state[spec.absmax_key].view(spec.rows, -1)]

    def slice_raw(self, raw, start, stop, block_form):
        codes, absmax = raw
        codes = codes[:, start:stop]
        absmax = absmax[:, start // self.block_size : -(-stop // self.block_size)]
        return [codes.reshape(codes.shape[0], -1, CHUNK_BLOCK) if block_form else codes, absmax]

    def flat_buffers(self, rows, total, signed, device, allocate):
        # zero bytes are float8 +0.0 in both types: the padding decodes to exactly 0
        return [allocate((rows, total), dtype=self.dtype(signed), device=device, elements=total),
                torch.zeros((rows, total // self.block_size), dtype=torch.float32, device=device)]

    def kernel_chunk(self, buffers, start, stop, signed, device):
        blocks = buffers[1][:, start // self.block_size : stop // self.block_size]
        return [in_blocks(buffers[0][:, start:stop], CHUNK_BLOCK), blocks]

    def flat_views(self, buffers, offset, numel):
        first = offset // self.block_size
        return [buffers[0][:, offset : offset + numel], buffers[1][:, first : first + self.num_blocks(numel)]]

    def bind(self, state, spec, views, shape):
        codes, absmax = views
        state[spec.key] = codes.view(shape) if spec.rows > 1 else codes[0].view(shape)
        state[spec.absmax_key] = absmax if spec.rows > 1 else absmax[0]

    def main_offset_bytes(self, offset: int) -> int:
        return offset

    def main_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn

    # -- math -------------------------------------------------------------------------------------------------
    def dequantize(self, raw: Sequence[torch.Tensor], signed: bool, n: int | None = None) -> torch.Tensor:
        codes, absmax = raw[:2]
        fmax = FMAX[codes.dtype]
        values = padded_blocks(codes.float(), self.block_size) * exact_math.div(absmax, fmax).unsqueeze(-1)
        if self.stores_root(signed):
            values = values * values
        return _unblocked(values, codes.shape)

    def _stored_values(self, values: torch.Tensor, signed: bool) -> torch.Tensor:
        if self.stores_root(signed):
            return torch.sqrt(values.clamp_min(0.0))  # v >= 0 always; clamp keeps -0.0 and rounding noise out
        return values

    def scales(self, spec, shape):
        return (Scales(spec.absmax_key, self.block_size),)

    def scales_of(self, values, raw, signed):
        return [padded_blocks(self._stored_values(values, signed), self.block_size).abs().amax(dim=-1)]

    def store(self, values: torch.Tensor, raw: Sequence[torch.Tensor], signed: bool, scales=None) -> None:
        codes, absmax = raw[:2]
        fmax = FMAX[codes.dtype]
        values = self._stored_values(values, signed)
        blocked = padded_blocks(values, self.block_size)
        block_max = blocked.abs().amax(dim=-1) if scales is None else scales[0]
        # x * (FMAX / absmax): the largest magnitude maps to FMAX (within an ulp; the clamp saturates it). One
        # division (exact_math.div), as Triton's div_rn: ``fmax / tensor`` would be ``reciprocal() * fmax``, an ulp
        # off for some absmax, which moves values exactly halfway between two float8 numbers (common with bf16
        # gradients) to the other one
        reciprocal = torch.where(block_max > 0, exact_math.div(fmax, torch.where(block_max > 0, block_max, 1.0)), 0.0)
        scaled = (blocked * reciprocal.unsqueeze(-1)).clamp(-fmax, fmax)
        if self.rounds_stochastically(signed):
            scaled = _round_e4m3_stochastically(scaled)
        codes.copy_(_unblocked(scaled, values.shape).to(codes.dtype))
        absmax.copy_(block_max)

    # -- size and checkpoints ---------------------------------------------------------------------------------
    def state_bytes(self, numel: int, rows: int = 1) -> int:
        return rows * (numel + 4 * self.num_blocks(numel))

    def keys(self, spec) -> tuple[str, ...]:
        return (spec.key, spec.absmax_key)

    def recognises(self, state: dict, spec) -> bool:
        value = state.get(spec.key)
        return isinstance(value, torch.Tensor) and value.dtype in FMAX

    def check_loaded(self, param: torch.Tensor, state: dict, spec, where: str) -> None:
        shape = tuple(param.shape) if spec.rows == 1 else (spec.rows, *param.shape)
        self.check_slot_shape(param, state[spec.key], spec, where, shape)
        if state[spec.key].dtype != self.dtype(spec.signed):
            raise StateDictError(f"{where}: fp8 {spec.key} is {state[spec.key].dtype}, this format stores "
                                 f"{self.dtype(spec.signed)} (second moment: {self.second_moment})")
        absmax = state.get(spec.absmax_key)
        if absmax is None:
            raise StateDictError(f"{where}: fp8 {spec.key} has no {spec.absmax_key}")
        blocks = self.num_blocks(param.numel())
        expected = (blocks,) if spec.rows == 1 else (spec.rows, blocks)
        if tuple(absmax.shape) != expected:
            raise StateDictError(f"{where}: {spec.absmax_key} has shape {tuple(absmax.shape)}, expected {expected}")


FP8 = register_format(Fp8())


def variant(second_moment: str, block_size: int = BLOCK_SIZE) -> Fp8:
    """An unregistered fp8 format storing second moments as ``second_moment`` (``"e4m3_sr"``, ``"e4m3"``,
    ``"sqrt_e4m3"``, ``"e5m2"``) with ``block_size``-element blocks (a divisor of 256), for the quality benchmark
    that chose :data:`SECOND_MOMENT` and :data:`BLOCK_SIZE`. PyTorch paths only (the Triton twin is the registered
    format's)."""
    if second_moment not in ("sqrt_e4m3", "e4m3", "e4m3_sr", "e5m2") or CHUNK_BLOCK % block_size:
        raise ValueError(f"no fp8 variant {second_moment!r} with blocks of {block_size}")
    return type("Fp8Variant", (Fp8,), {"second_moment": second_moment, "block_size": block_size})()
