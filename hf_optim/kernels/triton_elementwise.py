"""The fused multi-tensor elementwise update in Triton: the twin of :func:`hf_optim.kernels.elementwise.update`.

One launch runs an algorithm's rule (:mod:`triton_rules`) over every tensor of a group: each program loads a
tile of parameter and gradient (any float dtype), loads its state rows (fp32 or 8-bit, per tensor), applies the
non-finite-gradient rule, runs the rule and stores everything back. The rule of the PyTorch path applies:
an element whose gradient is NaN or +-Inf keeps its parameter and state values (8-bit state is re-encoded
against its block's new absmax) and its direction output is 0.

With ``NORMS`` each program also writes the sums of squares of its parameter and output tile to
``partials[2 * program]`` and ``[2 * program + 1]`` (LAMB's norm pass reduces them per tensor).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from hf_optim.kernels import triton_guard
from hf_optim.kernels import triton_multi_tensor as mt
from hf_optim.kernels.blockwise4 import encoder_thresholds
from hf_optim.kernels.dynamic_map import encoder_table
from hf_optim.kernels.formats.blockwise4 import shared_map as shared_map4
from hf_optim.kernels.formats.blockwise8 import shared_map as shared_map8
from hf_optim.kernels.triton_blockwise import (
    load_state,
    load_values,
    pointer,
    store_state,
    tile_offsets,
)
from hf_optim.kernels.triton_rounding import store_param

TILE_BLOCKS = 4
"""Quantization blocks (of 256 elements) per program."""


FULL_TILE_BOUND: tl.constexpr = tl.constexpr(1 << 30)
"""Mask bound of tiles that lie wholly inside their tensor: a compile-time bound gives the mask a known
structure, so (with aligned addresses) loads and stores vectorize; only each tensor's last tile is masked by n."""


@triton.jit
def _load_row(row, r: tl.constexpr, maps, blocks, offs, mask, block_mask, SIGNED: tl.constexpr,
              ALIGNED: tl.constexpr):
    """State row ``r`` of a tensor's meta ``row``; ``maps`` is the table of :func:`maps_table` (addresses)."""
    kind = 0 if SIGNED else 1
    return load_state(tl.load(row + mt.VALUES + r), tl.load(row + mt.ABSMAX + r), tl.load(row + mt.FORMAT + r),
                      tl.load(maps + MAP8 + kind).to(tl.pointer_type(tl.float32)),
                      tl.load(maps + MAP4 + kind).to(tl.pointer_type(tl.float32)), blocks, offs, mask, block_mask,
                      ALIGNED)


@triton.jit
def _store_row(row, r: tl.constexpr, maps, blocks, offs, values, mask, block_mask, SIGNED: tl.constexpr,
               ALIGNED: tl.constexpr):
    kind = 0 if SIGNED else 1
    store_state(tl.load(row + mt.VALUES + r), tl.load(row + mt.ABSMAX + r), tl.load(row + mt.FORMAT + r),
                tl.load(maps + TABLE8 + kind).to(tl.pointer_type(tl.int32)),
                tl.load(maps + THRESHOLDS4 + kind).to(tl.pointer_type(tl.float32)), blocks, offs, values, mask,
                block_mask, SIGNED, ALIGNED)


@triton.jit
def _update_tile(
    row, program, partials, maps, h, blocks, offs, mask,
    block_mask, ordinal, key, RULE: tl.constexpr, ROWS: tl.constexpr, SIGNED0: tl.constexpr, SIGNED1: tl.constexpr,
    SIGNED2: tl.constexpr, WRITE_OUT: tl.constexpr, NORMS: tl.constexpr, ALIGNED: tl.constexpr, SR: tl.constexpr,
):
    param_address, param_dtype = tl.load(row + 0), tl.load(row + 4)
    p = load_values(param_address, param_dtype, offs, mask, ALIGNED)
    g = load_values(tl.load(row + 1), tl.load(row + 5), offs, mask, ALIGNED)
    finite = (g == g) & (tl.abs(g) != float("inf"))
    g = tl.where(finite, g, 0.0)

    s0 = _load_row(row, 0, maps, blocks, offs, mask, block_mask, SIGNED0, ALIGNED)
    s1 = tl.zeros_like(p)
    s2 = tl.zeros_like(p)
    if ROWS > 1:
        s1 = _load_row(row, 1, maps, blocks, offs, mask, block_mask, SIGNED1, ALIGNED)
    if ROWS > 2:
        s2 = _load_row(row, 2, maps, blocks, offs, mask, block_mask, SIGNED2, ALIGNED)

    out, n0, n1, n2 = RULE(p, g, s0, s1, s2, h)

    _store_row(row, 0, maps, blocks, offs, tl.where(finite, n0, s0), mask, block_mask, SIGNED0, ALIGNED)
    if ROWS > 1:
        _store_row(row, 1, maps, blocks, offs, tl.where(finite, n1, s1), mask, block_mask, SIGNED1, ALIGNED)
    if ROWS > 2:
        _store_row(row, 2, maps, blocks, offs, tl.where(finite, n2, s2), mask, block_mask, SIGNED2, ALIGNED)

    if WRITE_OUT:
        out = tl.where(finite & mask, out, 0.0)
        tl.store(pointer(tl.load(row + 2), tl.float32, ALIGNED) + offs, out, mask=mask)
    else:
        store_param(param_address, param_dtype, offs, tl.where(finite, out, p), mask, ordinal, key, SR, ALIGNED)
    if NORMS:
        tl.store(partials + 2 * program, tl.sum(tl.sum(p * p, axis=1), axis=0))
        tl.store(partials + 2 * program + 1, tl.sum(tl.sum(out * out, axis=1), axis=0))


@triton.jit
def _fused_update_kernel(
    meta, tiles, partials, maps, h, ordinals, key,
    RULE: tl.constexpr, ROWS: tl.constexpr, SIGNED0: tl.constexpr, SIGNED1: tl.constexpr,
    SIGNED2: tl.constexpr, WRITE_OUT: tl.constexpr, NORMS: tl.constexpr, BLOCKS: tl.constexpr,
    COLS: tl.constexpr, ALIGNED: tl.constexpr, SR: tl.constexpr,
):
    program = tl.program_id(0)
    tensor = tl.load(tiles + 2 * program)
    row = meta + tensor.to(tl.int64) * COLS
    first_block = tl.load(tiles + 2 * program + 1)
    blocks, offs = tile_offsets(first_block, BLOCKS)
    n = tl.load(row + 3)
    ordinal = tl.load(ordinals + tensor) if SR else 0  # bf16 stochastic rounding: the parameter's ordinal
    if (first_block + BLOCKS) * 256 <= n:
        _update_tile(row, program, partials, maps, h, blocks, offs, offs < FULL_TILE_BOUND,
                     blocks < FULL_TILE_BOUND, ordinal, key, RULE, ROWS, SIGNED0, SIGNED1, SIGNED2, WRITE_OUT, NORMS,
                     ALIGNED, SR)
    else:
        _update_tile(row, program, partials, maps, h, blocks, offs, offs < n, blocks * 256 < n, ordinal, key, RULE,
                     ROWS, SIGNED0, SIGNED1, SIGNED2, WRITE_OUT, NORMS, ALIGNED, SR)


MAP8: tl.constexpr = tl.constexpr(0)
TABLE8: tl.constexpr = tl.constexpr(2)
MAP4: tl.constexpr = tl.constexpr(4)
THRESHOLDS4: tl.constexpr = tl.constexpr(6)
"""Columns of :func:`maps_table` (each followed by its unsigned twin)."""


def maps_table(device: torch.device) -> torch.Tensor:
    """Addresses of every format's maps on ``device``, for the kernels (one int64 table instead of eight pointer
    arguments): 8-bit signed/unsigned map, their encoder tables, 4-bit signed/unsigned map, their thresholds.
    The tensors are cached per device by their modules, so the addresses stay valid."""
    return _maps_table(torch.device(device))


@functools.cache
def _maps_table(device: torch.device) -> torch.Tensor:
    tensors = [shared_map8(True, device), shared_map8(False, device), encoder_table(True, device),
               encoder_table(False, device), shared_map4(True, device), shared_map4(False, device),
               encoder_thresholds(True, device), encoder_thresholds(False, device)]
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=device)


def launch_kwargs(device) -> dict:
    """Launch options shared by every hf_optim kernel: no floating-point contraction on CUDA and ROCm, so each
    multiply and add rounds on its own, as torch's separate eager operations do (explicit ``tl.fma`` stays)."""
    return {"enable_fp_fusion": False} if device is not None and device.type == "cuda" else {}


def fused_update(
    rule,
    rows: int,
    signed: tuple[bool, bool, bool],
    launch: mt.Launch,
    maps: tuple,
    hyper: tuple[float, ...],
    *,
    write_out: bool = False,
    partials=None,
    device=None,
    stochastic=None,
) -> None:
    """Launch the fused update over ``launch``'s tensors.

    Args:
        rule: a ``@triton.jit`` rule of :mod:`triton_rules`.
        rows: how many state rows the rule reads (1 to 3).
        signed: per state row, whether its 8-bit map is signed.
        launch: the multi-tensor tables (:class:`triton_multi_tensor.Launch`).
        maps: the int64 table of map addresses on the device (:func:`maps_table`).
        hyper: the rule's scalars: the algorithm's ``hyper`` named tuple of floats (the rule reads them by name).
        write_out (default False): write the rule's output to each tensor's ``OUT`` address instead of the
            parameter.
        partials (default None): an fp32 tensor of ``2 * launch.num_tiles`` to receive per-tile sums of squares.
        device (default None): the tensors' device (for the launch options).
        stochastic (default None): ``(ordinals, key)``, int64 device tensors (each tensor's parameter ordinal,
            the step's two key words): round bf16 parameters stochastically (:mod:`triton_rounding`).
    """
    if launch.num_tiles == 0:
        return
    norms = partials is not None
    ordinals, key = stochastic if stochastic is not None else (launch.meta, launch.meta)
    triton_guard.launch(
        _fused_update_kernel, (launch.num_tiles,),
        launch.meta, launch.tiles, partials if norms else launch.meta, maps, hyper, ordinals, key,
        RULE=rule, ROWS=rows, SIGNED0=signed[0], SIGNED1=signed[1], SIGNED2=signed[2], WRITE_OUT=write_out,
        NORMS=norms, BLOCKS=TILE_BLOCKS, COLS=mt.META_COLS, ALIGNED=launch.aligned, SR=stochastic is not None,
        **launch_kwargs(device),
    )


# The kernel reads the meta table by column number; keep it in step with triton_multi_tensor's layout.
assert (mt.PARAM, mt.GRAD, mt.OUT, mt.NUMEL, mt.PARAM_DTYPE, mt.GRAD_DTYPE) == (0, 1, 2, 3, 4, 5)
assert (mt.VALUES, mt.ABSMAX, mt.FORMAT, mt.FIRST_TILE) == (6, 9, 12, 15)
