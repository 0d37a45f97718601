"""Adafactor's passes in Triton: the twin of ``adafactor_update`` in ``hf_optim/optim/adafactor/__init__.py``.

:func:`step` is Adafactor's Triton plan (``ADAFACTOR.triton_plan``); it takes the step's host scalars (the
algorithm's ``AdafactorHyper``) and its first-moment slot from the description, never from the optimizer.

Every pass is one launch over all Adafactor tensors of a group that share a step counter and a kernel group
(parameter and gradient dtype, first-moment format: compile-time constants, see ``step.kernel_group``), with
a per-tensor ``meta`` table of addresses, sizes and offsets, and a program-to-tensor table built with
:func:`hf_optim.kernels.triton_path.multi_tensor.unit_table`; the passes that treat factored and unfactored tensors
differently (finalize, update, apply) are compiled for one kind and launched once per kind present. So a step
costs six to nine launches whatever the group's size:

1. row statistics: row sums of ``g*g + eps1`` and of ``p*p`` (one program per block of rows of one tensor);
2. column statistics of factored (>= 2-D) tensors: column sums of ``g*g + eps1`` (one program per block of
   columns of one matrix of one tensor); sums run in a fixed order (no atomics);
3. finalize (one program per matrix of a factored tensor, one per unfactored tensor): ``RMS(p)`` and the step's
   learning rate, the row and column EMAs and the factors ``rsqrt(R / mean R)`` and ``rsqrt(C)`` of
   ``1/sqrt(V)``;
4. update: ``u = g / sqrt(V)`` (updating the unfactored ``V`` in place) and per-tile sums of ``u*u``;
5. clip (one program per tensor): the clipping denominator ``max(1, RMS(u) / clip_threshold)``;
6. apply: recomputes ``u``, clips and scales it, runs the optional first moment (fp32 or 8-bit per tensor,
   through the shared 8-bit helpers) and updates the parameter.

Non-finite gradients count as zero in every statistic and the element is skipped, as on the PyTorch path.
Per-tensor device scalars (learning rate, clipping denominator) stay in device buffers: no host sync.
Means and divisions by Python numbers multiply by the fp32 reciprocal, as torch does on CUDA (its CPU kernels
divide: an ulp apart). Sums run in another order than torch's ``mean``/``norm``, so statistics differ from the
PyTorch path's in the last bits, and parameters agree within an ulp rather than bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hf_optim.core.algorithm import Algorithm, kernel_scalars
from hf_optim.core.state_store import slot_format
from hf_optim.formats import BLOCKWISE8, FP32, StateFormat, formats_by_rank
from hf_optim.formats.quant8 import num_blocks
from hf_optim.kernels.triton_path import guard as triton_guard
from hf_optim.kernels.triton_path import multi_tensor as mt
from hf_optim.kernels.triton_path.configs import BF16 as BF16_CODE
from hf_optim.kernels.triton_path.configs import DTYPES, LaunchSpec, as_formats
from hf_optim.kernels.triton_path.elementwise import FusedConfig
from hf_optim.kernels.triton_path.rounding import store_param
from hf_optim.kernels.triton_path.rows import TritonRows, kernel_maps, rows_for_code
from hf_optim.kernels.triton_path.tile import (
    BF16,
    DTYPE_NAMES,
    TRITON_VERSION,
    dtype_code,
    launch_options,
    load_values,
    pointer,
    tile,
    tile_sum,
)

TILE_BLOCKS = 4
W: tl.constexpr = tl.constexpr(8)
NO_MOMENT = -1
"""``M_FORMAT`` of tensors without a first moment (``beta1`` None)."""

ROWS_PER_PROGRAM = 16
COLS_PER_PROGRAM = 256
REDUCE_CHUNK = 1024

# Columns of the per-tensor ``meta`` table (int64).
PARAM: tl.constexpr = tl.constexpr(0)
GRAD: tl.constexpr = tl.constexpr(1)
NUMEL: tl.constexpr = tl.constexpr(2)
PARAM_DTYPE: tl.constexpr = tl.constexpr(3)
GRAD_DTYPE: tl.constexpr = tl.constexpr(4)
ROWS: tl.constexpr = tl.constexpr(5)
"""``numel // COLS``: rows of the tensor seen as (rows, last dimension)."""
COLS: tl.constexpr = tl.constexpr(6)
HEIGHT: tl.constexpr = tl.constexpr(7)
"""Second-to-last dimension of a factored tensor (``ROWS // HEIGHT`` matrices)."""
FACTORED: tl.constexpr = tl.constexpr(8)
SQ: tl.constexpr = tl.constexpr(9)
"""``exp_avg_sq_row`` of a factored tensor, ``exp_avg_sq`` of an unfactored one."""
SQ_COL: tl.constexpr = tl.constexpr(10)
RMS: tl.constexpr = tl.constexpr(11)
M_VALUES: tl.constexpr = tl.constexpr(12)
M_ABSMAX: tl.constexpr = tl.constexpr(13)
M_FORMAT: tl.constexpr = tl.constexpr(14)
ROW_OFFSET: tl.constexpr = tl.constexpr(15)
"""Offset of the tensor's rows in the row scratch buffers (row sums, ``p*p`` sums, row factors)."""
COL_OFFSET: tl.constexpr = tl.constexpr(16)
"""Offset of the tensor's columns in the column scratch buffers (column sums, column factors)."""
FIRST_TILE: tl.constexpr = tl.constexpr(17)
META_COLS = 18


@triton.jit
def _finite_grad(address, offs, mask, DTYPE: tl.constexpr):
    g = load_values(address, offs, mask, DTYPE, False)
    return tl.where(tl.abs(g) < float("inf"), g, 0.0)  # the compare is false for NaN and +-inf


@triton.jit
def _tensor_row(meta, units, NCOLS: tl.constexpr):
    """(meta row, first unit) of this program."""
    program = tl.program_id(0)
    tensor = tl.load(units + 2 * program)
    return meta + tensor.to(tl.int64) * NCOLS, tl.load(units + 2 * program + 1)


@triton.jit
def _row_stats_kernel(meta, units, row_sums, param_sq, eps1, BR: tl.constexpr, BC: tl.constexpr,
                      NCOLS: tl.constexpr, PARAM_DTYPE: tl.constexpr, GRAD_DTYPE: tl.constexpr):
    row, unit = _tensor_row(meta, units, NCOLS)
    rows, cols = tl.load(row + ROWS), tl.load(row + COLS)
    grad, param = tl.load(row + GRAD), tl.load(row + PARAM)
    r = unit.to(tl.int64) * BR + tl.arange(0, BR)
    row_ok = r < rows
    acc = tl.zeros([BR], dtype=tl.float32)
    acc_p = tl.zeros([BR], dtype=tl.float32)
    for start in range(0, cols, BC):
        c = start + tl.arange(0, BC)
        offs = r[:, None] * cols + c[None, :]
        mask = row_ok[:, None] & (c < cols)[None, :]
        g = _finite_grad(grad, offs, mask, GRAD_DTYPE)
        p = load_values(param, offs, mask, PARAM_DTYPE, False)
        acc += tl.sum(tl.where(mask, g * g + eps1, 0.0), axis=1)
        acc_p += tl.sum(p * p, axis=1)
    offset = tl.load(row + ROW_OFFSET)
    tl.store(row_sums + offset + r, acc, mask=row_ok)
    tl.store(param_sq + offset + r, acc_p, mask=row_ok)


@triton.jit
def _col_stats_kernel(meta, units, col_sums, eps1, BR: tl.constexpr, BC: tl.constexpr, NCOLS: tl.constexpr,
                      GRAD_DTYPE: tl.constexpr):
    row, unit = _tensor_row(meta, units, NCOLS)
    height, cols = tl.load(row + HEIGHT), tl.load(row + COLS)
    grad = tl.load(row + GRAD)
    col_blocks = tl.cdiv(cols, BC)
    batch = unit.to(tl.int64) // col_blocks
    c = (unit % col_blocks) * BC + tl.arange(0, BC)
    col_ok = c < cols
    acc = tl.zeros([BC], dtype=tl.float32)
    for start in range(0, height, BR):
        r = start + tl.arange(0, BR)
        offs = batch * height * cols + r[:, None].to(tl.int64) * cols + c[None, :]
        mask = (r < height)[:, None] & col_ok[None, :]
        g = _finite_grad(grad, offs, mask, GRAD_DTYPE)
        acc += tl.sum(tl.where(mask, g * g + eps1, 0.0), axis=0)
    tl.store(col_sums + tl.load(row + COL_OFFSET) + batch * cols + c, acc, mask=col_ok)


@triton.jit
def _inverse(count):
    """fp32 reciprocal of an integer count: torch's CUDA ``mean`` and its division by a Python number multiply by
    it."""
    return tl.div_rn(1.0, count.to(tl.float32))


@triton.jit
def _ema(state, sums, count, beta2t, one_minus_beta2t, index, mask):
    """``state.mul_(b2t).add_(sums.mean(), alpha=1-b2t)`` as torch computes it on CUDA (the mean multiplies by
    ``1/count``; the add with alpha is one fused multiply-add), stored and returned."""
    mean = tl.load(sums + index, mask=mask, other=1.0) * _inverse(count)  # other=1: no rsqrt(0) in masked lanes
    old = tl.load(state + index, mask=mask, other=1.0)
    new = tl.fma(mean, tl.zeros_like(mean) + one_minus_beta2t, old * beta2t)
    tl.store(state + index, new, mask=mask)
    return new


@triton.jit
def _finalize_kernel(meta, units, row_sums, param_sq, col_sums, row_factor, col_factor, lrs, step_size, eps2, beta2t,
                     one_minus_beta2t, SCALE: tl.constexpr, CHUNK: tl.constexpr, NCOLS: tl.constexpr,
                     FACTORED: tl.constexpr):
    """One program per matrix of a factored tensor (one per unfactored tensor); a tensor's first program also
    computes its RMS and learning rate."""
    tensor = tl.load(units + 2 * tl.program_id(0))
    row, batch = _tensor_row(meta, units, NCOLS)
    n, rows, cols = tl.load(row + NUMEL), tl.load(row + ROWS), tl.load(row + COLS)
    row_offset = tl.load(row + ROW_OFFSET)
    if batch == 0:
        acc = tl.zeros([CHUNK], dtype=tl.float32)
        for start in range(0, rows, CHUNK):
            index = start + tl.arange(0, CHUNK)
            acc += tl.load(param_sq + row_offset + index, mask=index < rows, other=0.0)
        rms = tl.sqrt_rn(tl.sum(acc, axis=0)) * tl.div_rn(1.0, tl.sqrt_rn(n.to(tl.float32)))  # norm / sqrt(n)
        tl.store(pointer(tl.load(row + RMS), tl.float32, False), rms)
        if SCALE:
            lr = tl.maximum(rms, eps2) * step_size
        else:
            lr = rms * 0.0 + step_size
        tl.store(lrs + tensor, lr)
    if FACTORED:
        height = tl.load(row + HEIGHT)
        sq_row = pointer(tl.load(row + SQ), tl.float32, False)
        sq_col = pointer(tl.load(row + SQ_COL), tl.float32, False)
        first = batch.to(tl.int64) * height  # this matrix's rows: their mean normalizes them
        total = tl.zeros([CHUNK], dtype=tl.float32)
        for start in range(0, height, CHUNK):
            index = first + start + tl.arange(0, CHUNK)
            mask = index < first + height
            new = _ema(sq_row, row_sums + row_offset, cols, beta2t, one_minus_beta2t, index, mask)
            total += tl.where(mask, new, 0.0)
        mean = tl.sum(total, axis=0) * _inverse(height)
        for start in range(0, height, CHUNK):
            index = first + start + tl.arange(0, CHUNK)
            mask = index < first + height
            value = tl.load(sq_row + index, mask=mask, other=1.0)
            tl.store(row_factor + row_offset + index, tl.rsqrt(tl.div_rn(value, mean)), mask=mask)
        col_offset = tl.load(row + COL_OFFSET)
        for start in range(0, cols, CHUNK):
            index = batch.to(tl.int64) * cols + start + tl.arange(0, CHUNK)
            mask = start + tl.arange(0, CHUNK) < cols
            new = _ema(sq_col, col_sums + col_offset, height, beta2t, one_minus_beta2t, index, mask)
            tl.store(col_factor + col_offset + index, tl.rsqrt(new), mask=mask)


@triton.jit
def _direction(row, g, offs, mask, row_factor, col_factor, beta2t, one_minus_beta2t, eps1,
               UPDATE_SQ: tl.constexpr, FACTORED: tl.constexpr):
    """``u = g / sqrt(V)``: factored ``(rsqrt(R/mean R) * rsqrt(C)) * g``, else ``rsqrt(V) * g`` where the
    unfactored ``V`` is updated and stored first when ``UPDATE_SQ`` (the update pass), read as is otherwise."""
    if FACTORED:
        cols = tl.load(row + COLS)
        rows_cols = tl.load(row + HEIGHT) * cols
        factor_row = offs // cols + tl.load(row + ROW_OFFSET)
        factor_col = (offs // rows_cols) * cols + offs % cols + tl.load(row + COL_OFFSET)
        factor = (tl.load(row_factor + factor_row, mask=mask, other=1.0)
                  * tl.load(col_factor + factor_col, mask=mask, other=1.0))
        u = factor * g
    else:
        sq = pointer(tl.load(row + SQ), tl.float32, False)
        new = tl.load(sq + offs, mask=mask, other=1.0)
        if UPDATE_SQ:
            squared = g * g + eps1
            # torch: sq.mul_(b2t).add_(squared, alpha=1-b2t); its add with alpha is one fused multiply-add
            new = tl.fma(squared, tl.zeros_like(squared) + one_minus_beta2t, new * beta2t)
            tl.store(sq + offs, new, mask=mask)
        u = tl.rsqrt(new) * g
    return u


@triton.jit
def _update_sq_kernel(meta, tiles, row_factor, col_factor, partials, beta2t, one_minus_beta2t, eps1,
                      BLOCKS: tl.constexpr, NCOLS: tl.constexpr, GRAD_DTYPE: tl.constexpr, FACTORED: tl.constexpr):
    row, first_block = _tensor_row(meta, tiles, NCOLS)
    _, _, _, offs = tile(first_block, BLOCKS, W)
    mask = offs < tl.load(row + NUMEL)
    g = _finite_grad(tl.load(row + GRAD), offs, mask, GRAD_DTYPE)
    u = _direction(row, g, offs, mask, row_factor, col_factor, beta2t, one_minus_beta2t, eps1, True, FACTORED)
    u = tl.where(mask, u, 0.0)
    tl.store(partials + tl.load(row + FIRST_TILE) + first_block // BLOCKS, tile_sum(u * u))


@triton.jit
def _clip_kernel(meta, partials, clip_denominators, inverse_clip_threshold, CHUNK: tl.constexpr, BLOCKS: tl.constexpr,
                 NCOLS: tl.constexpr):
    tensor = tl.program_id(0)
    row = meta + tensor.to(tl.int64) * NCOLS
    n, first = tl.load(row + NUMEL), tl.load(row + FIRST_TILE)
    count = tl.cdiv(tl.cdiv(n, 256), BLOCKS)
    acc = tl.zeros([CHUNK], dtype=tl.float32)
    for start in range(0, count, CHUNK):
        index = start + tl.arange(0, CHUNK)
        acc += tl.load(partials + first + index, mask=index < count, other=0.0)
    update_rms = tl.sqrt_rn(tl.sum(acc, axis=0)) * tl.div_rn(1.0, tl.sqrt_rn(n.to(tl.float32)))
    tl.store(clip_denominators + tensor, tl.maximum(update_rms * inverse_clip_threshold, 1.0))


@triton.jit
def _apply_kernel(meta, tiles, row_factor, col_factor, clip_denominators, lrs, eps1, negative_decay, qmap, table,
                  beta1, one_minus_beta1, ordinals, sr_key, M_FORMAT: tl.constexpr, M_LOAD: tl.constexpr,
                  M_STORE: tl.constexpr, HAS_DECAY: tl.constexpr, BLOCKS: tl.constexpr, NCOLS: tl.constexpr,
                  SR: tl.constexpr, PARAM_DTYPE: tl.constexpr, GRAD_DTYPE: tl.constexpr, FACTORED: tl.constexpr):
    program = tl.program_id(0)
    tensor = tl.load(tiles + 2 * program)
    row = meta + tensor.to(tl.int64) * NCOLS
    blocks, halves, rows, offs = tile(tl.load(tiles + 2 * program + 1), BLOCKS, W)
    n = tl.load(row + NUMEL)
    mask = offs < n
    g = load_values(tl.load(row + GRAD), offs, mask, GRAD_DTYPE, False)
    finite = tl.abs(g) < float("inf")  # false for NaN and +-inf: one compare
    g = tl.where(finite, g, 0.0)
    u = _direction(row, g, offs, mask, row_factor, col_factor, 0.0, 0.0, eps1, False, FACTORED)
    u = tl.div_rn(u, tl.load(clip_denominators + tensor))
    lr = tl.load(lrs + tensor)
    u = u * lr
    if M_FORMAT != NO_MOMENT_CODE:
        m_values, m_absmax = tl.load(row + M_VALUES), tl.load(row + M_ABSMAX)
        # the first moment's format's row I/O (rows.TritonRows): a signed slot, unaligned, no native conversions
        old = M_LOAD(m_values, m_absmax, qmap, blocks, halves, rows, offs, mask, n, True, False, False)
        m = tl.where(finite, old * beta1 + u * one_minus_beta1, old)
        M_STORE(m_values, m_absmax, table, blocks, halves, rows, offs, m, mask, n, True, False, False)
        u = m
    param = tl.load(row + PARAM)
    p = load_values(param, offs, mask, PARAM_DTYPE, False)
    new = p
    if HAS_DECAY:
        new = new + new * (negative_decay * lr)
    new = new - u
    ordinal = tl.load(ordinals + tensor) if SR else 0
    store_param(param, offs, tl.where(finite, new, p), mask, ordinal, sr_key, PARAM_DTYPE, SR, False)


NO_MOMENT_CODE: tl.constexpr = tl.constexpr(NO_MOMENT)


@dataclass(frozen=True)
class AdafactorConfig:
    """What Adafactor's passes are specialized on: parameter and gradient dtype, the first moment's format
    (:data:`NO_MOMENT` without ``beta1``), and the step's switches (``scale_parameter``, weight decay, stochastic
    rounding). Factored and unfactored tensors get their own launches of the passes that differ."""

    param_dtype: int
    grad_dtype: int
    moment_format: int
    scale: bool
    decay: bool
    stochastic: bool = False

    num_warps = 4

    def warps(self, name: str) -> int:
        """Warps per program of pass ``name``: 8 for the column statistics (a 16 x 256 tile: at 4 warps a thread
        holds 32 gradients and ptxas spills 16 bytes on sm_80 at 80 registers; at 8, 30 registers), else
        :attr:`num_warps`."""
        return 8 if name == "col-stats" else self.num_warps

    def launch_options(self, name: str, factored: bool | None = None) -> dict:
        """Launch options of pass ``name`` (``factored``: the launch's tensors, for the passes that differ):
        :func:`tile.launch_options` at :meth:`warps`, and with Triton 3.8 a register limit of 72 for the apply pass
        of unfactored tensors with an 8-bit first moment: without one, ptxas held it to 64 registers with an 8-byte
        spill on sm_90 (bf16 and fp16); with 72, none spills on sm_75, sm_80 or sm_90. The factored apply pass
        needs more than 72 and spills 12-96 bytes under that limit, so it keeps none (:mod:`hf_optim.gpu_static`).
        Triton 3.9 needs no limit."""
        options = launch_options(self.warps(name))
        if (name == "apply" and factored is False and self.moment_format == BLOCKWISE8.code
                and TRITON_VERSION < (3, 9)):
            options["maxnreg"] = 72
        return options

    @property
    def moment_code(self) -> int:
        """The format whose Triton branch reads and writes the first moment (fp32's without one: never called)."""
        return FP32.code if self.moment_format == NO_MOMENT else self.moment_format

    @property
    def moment_rows(self) -> TritonRows:
        return rows_for_code(self.moment_code)

    @property
    def key(self) -> tuple:
        return ("adafactor", DTYPE_NAMES[self.param_dtype], DTYPE_NAMES[self.grad_dtype], self.moment_format,
                self.scale, self.decay, "sr" if self.stochastic else "rn")

    @property
    def label(self) -> str:
        moment = "no first moment" if self.moment_format == NO_MOMENT else f"first moment format {self.moment_format}"
        return (f"adafactor {DTYPE_NAMES[self.param_dtype]}, {moment}"
                f"{', stochastic rounding' if self.stochastic else ''}")

    def kernels(self) -> list[tuple[str, object, dict]]:
        """``(pass, kernel, compile-time arguments)`` of every kernel the passes launch (both kinds of tensor)."""
        stats = {"BR": ROWS_PER_PROGRAM, "BC": COLS_PER_PROGRAM, "NCOLS": META_COLS}
        kernels = [("row-stats", _row_stats_kernel, {**stats, "PARAM_DTYPE": self.param_dtype,
                                                     "GRAD_DTYPE": self.grad_dtype}),
                   ("col-stats", _col_stats_kernel, {**stats, "GRAD_DTYPE": self.grad_dtype}),
                   ("clip", _clip_kernel, {"CHUNK": REDUCE_CHUNK, "BLOCKS": TILE_BLOCKS, "NCOLS": META_COLS})]
        for factored in (True, False):
            kernels += [
                ("finalize", _finalize_kernel, {"SCALE": self.scale, "CHUNK": REDUCE_CHUNK, "NCOLS": META_COLS,
                                                "FACTORED": factored}),
                ("update", _update_sq_kernel, {"BLOCKS": TILE_BLOCKS, "NCOLS": META_COLS,
                                               "GRAD_DTYPE": self.grad_dtype, "FACTORED": factored}),
                ("apply", _apply_kernel, {"M_FORMAT": self.moment_format, "M_LOAD": self.moment_rows.load,
                                          "M_STORE": self.moment_rows.store, "HAS_DECAY": self.decay,
                                          "BLOCKS": TILE_BLOCKS, "NCOLS": META_COLS, "SR": self.stochastic,
                                          "PARAM_DTYPE": self.param_dtype, "GRAD_DTYPE": self.grad_dtype,
                                          "FACTORED": factored}),
            ]
        return kernels


def _meta_rows(items: list, first_moment) -> tuple[list[list[int]], int, int, list[int]]:
    """(meta rows, total rows, total columns, tiles per tensor) of ``items`` = [(param, grad, state), ...]."""
    table, row_offset, col_offset, first_tile, tiles = [], 0, 0, 0, []
    for param, grad, state in items:
        n = param.numel()
        cols = param.shape[-1] if param.dim() >= 1 else 1
        rows = n // cols
        factored = "exp_avg_sq_row" in state
        height = param.shape[-2] if factored else rows
        m = state.get(first_moment.key)
        fmt = slot_format(state, first_moment) if m is not None else None
        row = [0] * META_COLS
        row[PARAM.value], row[GRAD.value], row[NUMEL.value] = param.data_ptr(), grad.data_ptr(), n
        row[PARAM_DTYPE.value], row[GRAD_DTYPE.value] = dtype_code(param.dtype), dtype_code(grad.dtype)
        row[ROWS.value], row[COLS.value], row[HEIGHT.value], row[FACTORED.value] = rows, cols, height, int(factored)
        row[SQ.value] = state["exp_avg_sq_row" if factored else "exp_avg_sq"].data_ptr()
        row[SQ_COL.value] = state["exp_avg_sq_col"].data_ptr() if factored else 0
        row[RMS.value] = state["RMS"].data_ptr()
        row[M_VALUES.value] = m.data_ptr() if m is not None else 0
        quantized = fmt is not None and fmt.block_size
        row[M_ABSMAX.value] = state[first_moment.absmax_key].data_ptr() if quantized else 0
        row[M_FORMAT.value] = fmt.code if fmt is not None else 0
        row[ROW_OFFSET.value], row[COL_OFFSET.value], row[FIRST_TILE.value] = row_offset, col_offset, first_tile
        row_offset += rows
        col_offset += (rows // height) * cols if factored else 0
        tiles.append(triton.cdiv(num_blocks(n), TILE_BLOCKS))
        first_tile += tiles[-1]
        table.append(row)
    return table, row_offset, col_offset, tiles


def step(algorithm, group: dict, key, items: list, step: int, hyper, cache: mt.PlanCache,
         device: torch.device, stochastic=None) -> None:
    """One Adafactor step of ``items`` = [(param, grad, state), ...] (contiguous local tensors on ``device``, all
    with step counter ``step``, already counted, of one kernel group; ``hyper`` its ``AdafactorHyper``): the six
    passes, each one launch over every tensor, or one per kind (factored, unfactored) where the kinds differ.
    ``stochastic``: ``(ordinals, key)`` device tensors to round bf16 parameters stochastically."""
    (first_moment,) = algorithm.slots
    h = kernel_scalars(hyper)
    eps1, eps2 = h.eps1, h.eps2
    table, total_rows, total_cols, tiles = _meta_rows(items, first_moment)
    first = table[0]
    config = AdafactorConfig(first[PARAM_DTYPE.value], first[GRAD_DTYPE.value],
                             first[M_FORMAT.value] if group["beta1"] is not None else NO_MOMENT,
                             scale=bool(group["scale_parameter"]), decay=group["weight_decay"] != 0,
                             stochastic=stochastic is not None and first[PARAM_DTYPE.value] == BF16.value)
    kernels = {(name, args.get("FACTORED")): (kernel, args) for name, kernel, args in config.kernels()}
    def run(name, grid, *args, factored=None):
        kernel, constants = kernels[(name, factored)]
        triton_guard.launch(kernel, grid, *args, **constants, **config.launch_options(name, factored))

    meta = cache.table((algorithm.name, *key), table, torch.int64, device)
    kinds = {True: [i for i, row in enumerate(table) if row[FACTORED.value]],
             False: [i for i, row in enumerate(table) if not row[FACTORED.value]]}
    blocks = [num_blocks(row[NUMEL.value]) for row in table]
    row_units = [triton.cdiv(row[ROWS.value], ROWS_PER_PROGRAM) for row in table]
    row_table = cache.units(row_units, 1, device)
    # the column pass visits factored tensors only: its table names their indices in ``meta``
    col_units = [(table[i][ROWS.value] // table[i][HEIGHT.value]) * triton.cdiv(table[i][COLS.value], COLS_PER_PROGRAM)
                 for i in kinds[True]]
    matrices = [row[ROWS.value] // row[HEIGHT.value] if row[FACTORED.value] else 1 for row in table]

    row_sums = torch.empty(total_rows, dtype=torch.float32, device=device)
    param_sq = torch.empty(total_rows, dtype=torch.float32, device=device)
    row_factor = torch.empty(max(total_rows, 1), dtype=torch.float32, device=device)
    col_sums = torch.empty(max(total_cols, 1), dtype=torch.float32, device=device)
    col_factor = torch.empty(max(total_cols, 1), dtype=torch.float32, device=device)
    lrs = torch.empty(len(table), dtype=torch.float32, device=device)
    partials = torch.empty(sum(tiles), dtype=torch.float32, device=device)
    clip_denominators = torch.empty(len(table), dtype=torch.float32, device=device)

    run("row-stats", (sum(row_units),), meta, row_table, row_sums, param_sq, eps1)
    if kinds[True]:
        run("col-stats", (sum(col_units),), meta, cache.units(col_units, 1, device, kinds[True]), col_sums, eps1)
    for factored, chosen in kinds.items():
        if chosen:
            units = [matrices[i] for i in chosen]
            run("finalize", (sum(units),), meta, cache.units(units, 1, device, chosen), row_sums, param_sq, col_sums,
                row_factor, col_factor, lrs, h.step_size, eps2, h.beta2t, h.one_minus_beta2t, factored=factored)
    for factored, chosen in kinds.items():
        if chosen:
            units = [blocks[i] for i in chosen]
            grid = (sum(triton.cdiv(b, TILE_BLOCKS) for b in units),)
            run("update", grid, meta, cache.units(units, TILE_BLOCKS, device, chosen), row_factor, col_factor,
                partials, h.beta2t, h.one_minus_beta2t, eps1, factored=factored)
    run("clip", (len(table),), meta, partials, clip_denominators, h.inv_clip_threshold)
    ordinals, sr_key = stochastic if stochastic is not None else (meta, meta)
    qmap, encoder = kernel_maps(config.moment_code, True, device)  # the first moment's map and encoder tables
    for factored, chosen in kinds.items():
        if chosen:
            units = [blocks[i] for i in chosen]
            grid = (sum(triton.cdiv(b, TILE_BLOCKS) for b in units),)
            run("apply", grid, meta, cache.units(units, TILE_BLOCKS, device, chosen), row_factor, col_factor,
                clip_denominators, lrs, eps1, h.negative_decay, qmap, encoder, h.beta1, h.one_minus_beta1, ordinals,
                sr_key, factored=factored)


SIGNATURES = {
    "row-stats": {"meta": "*i64", "units": "*i32", "row_sums": "*fp32", "param_sq": "*fp32", "eps1": "fp32"},
    "col-stats": {"meta": "*i64", "units": "*i32", "col_sums": "*fp32", "eps1": "fp32"},
    "finalize": {"meta": "*i64", "units": "*i32", "row_sums": "*fp32", "param_sq": "*fp32", "col_sums": "*fp32",
                 "row_factor": "*fp32", "col_factor": "*fp32", "lrs": "*fp32", "step_size": "fp32", "eps2": "fp32",
                 "beta2t": "fp32", "one_minus_beta2t": "fp32"},
    "update": {"meta": "*i64", "tiles": "*i32", "row_factor": "*fp32", "col_factor": "*fp32", "partials": "*fp32",
               "beta2t": "fp32", "one_minus_beta2t": "fp32", "eps1": "fp32"},
    "clip": {"meta": "*i64", "partials": "*fp32", "clip_denominators": "*fp32", "inverse_clip_threshold": "fp32"},
    "apply": {"meta": "*i64", "tiles": "*i32", "row_factor": "*fp32", "col_factor": "*fp32",
              "clip_denominators": "*fp32", "lrs": "*fp32", "eps1": "fp32", "negative_decay": "fp32", "qmap": "*fp32",
              "table": "*i32", "beta1": "fp32", "one_minus_beta1": "fp32", "ordinals": "*i64", "sr_key": "*i64"},
}
"""The run-time argument types of each pass's kernel, for ahead-of-time compilation."""


def launch_specs(algorithm: Algorithm, formats: Sequence[StateFormat],
                 fused: Sequence[FusedConfig]) -> list[LaunchSpec]:
    """Adafactor's passes (``TritonPlan.specs``) for every parameter dtype, first moment (none, or each of
    ``formats``), switch (``scale_parameter``, weight decay) and stochastic rounding; each distinct binary once."""
    moments = [NO_MOMENT] + [fmt.code for fmt in as_formats(formats)]
    specs, seen = [], set()
    for dtype in DTYPES:
        for stochastic in (False, True) if dtype == BF16_CODE else (False,):
            for moment in moments:
                for scale in (True, False):
                    for decay in (True, False):
                        config = AdafactorConfig(dtype, dtype, moment, scale, decay, stochastic)
                        for name, kernel, constexprs in config.kernels():
                            binary = (name, tuple(sorted(constexprs.items())))
                            if binary in seen:
                                continue
                            seen.add(binary)
                            label = _adafactor_label(constexprs)
                            per_program = (TILE_BLOCKS * 256 if name in ("update", "apply")
                                           else None)
                            specs.append(LaunchSpec(
                                f"adafactor/{name} {label}".strip(), kernel, SIGNATURES[name], constexprs,
                                config.warps(name), "adafactor", "Adafactor", elements_per_program=per_program,
                                param_dtype=DTYPE_NAMES[dtype] if name in ("row-stats", "apply") else None,
                                options={key: value for key, value in
                                         config.launch_options(name, constexprs.get("FACTORED")).items()
                                         if key != "num_warps"}))
    return specs


def _adafactor_label(constexprs: dict) -> str:
    """``bf16 grad=fp32 factored m=8bit decay scale sr``: the compile-time choices of one Adafactor pass."""
    words = []
    if "PARAM_DTYPE" in constexprs:
        words.append(DTYPE_NAMES[constexprs["PARAM_DTYPE"]])
    if "GRAD_DTYPE" in constexprs:
        words.append(f"grad={DTYPE_NAMES[constexprs['GRAD_DTYPE']]}")
    if "FACTORED" in constexprs:
        words.append("factored" if constexprs["FACTORED"] else "unfactored")
    if "M_FORMAT" in constexprs:
        moment = constexprs["M_FORMAT"]
        words.append("no-m" if moment == NO_MOMENT else
                     f"m={next(f.class_suffix for f in formats_by_rank() if f.code == moment)}")
    words += [name for name, flag in (("decay", "HAS_DECAY"), ("scale", "SCALE"), ("sr", "SR")) if constexprs.get(flag)]
    return " ".join(words)
