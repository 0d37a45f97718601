"""Adafactor's passes in Triton: the twin of ``Adafactor._update`` in ``hf_optim/optim/adafactor.py``.

:func:`step` is Adafactor's Triton plan (``ADAFACTOR.triton_plan``); it takes the step's host scalars (the
algorithm's ``AdafactorHyper``) and its first-moment slot from the description, never from the optimizer.

Every pass is one launch over all Adafactor tensors of a group that share a step counter (a per-tensor ``meta``
table of addresses, sizes and offsets, and a program-to-tensor table built with
:func:`hf_optim.kernels.triton_multi_tensor.unit_table`), so a step costs six launches whatever the group's size:

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

import torch
import triton
import triton.language as tl

from hf_optim.kernels import triton_guard
from hf_optim.kernels import triton_multi_tensor as mt
from hf_optim.kernels.algorithm import kernel_scalars
from hf_optim.kernels.blockwise import num_blocks
from hf_optim.kernels.dynamic_map import dynamic_map, encoder_table
from hf_optim.kernels.state_store import slot_format
from hf_optim.kernels.triton_blockwise import (
    dtype_code,
    load_state,
    load_values,
    pointer,
    store_state,
    tile_offsets,
)
from hf_optim.kernels.triton_elementwise import TILE_BLOCKS, launch_kwargs
from hf_optim.kernels.triton_rounding import store_param

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
def _finite_grad(address, dtype, offs, mask):
    g = load_values(address, dtype, offs, mask)
    return tl.where((g == g) & (tl.abs(g) != float("inf")), g, 0.0)


@triton.jit
def _tensor_row(meta, units, NCOLS: tl.constexpr):
    """(meta row, first unit) of this program."""
    program = tl.program_id(0)
    tensor = tl.load(units + 2 * program)
    return meta + tensor.to(tl.int64) * NCOLS, tl.load(units + 2 * program + 1)


@triton.jit
def _row_stats_kernel(meta, units, row_sums, param_sq, eps1, BR: tl.constexpr, BC: tl.constexpr,
                      NCOLS: tl.constexpr):
    row, unit = _tensor_row(meta, units, NCOLS)
    rows, cols = tl.load(row + ROWS), tl.load(row + COLS)
    grad, grad_dtype = tl.load(row + GRAD), tl.load(row + GRAD_DTYPE)
    param, param_dtype = tl.load(row + PARAM), tl.load(row + PARAM_DTYPE)
    r = unit.to(tl.int64) * BR + tl.arange(0, BR)
    row_ok = r < rows
    acc = tl.zeros([BR], dtype=tl.float32)
    acc_p = tl.zeros([BR], dtype=tl.float32)
    for start in range(0, cols, BC):
        c = start + tl.arange(0, BC)
        offs = r[:, None] * cols + c[None, :]
        mask = row_ok[:, None] & (c < cols)[None, :]
        g = _finite_grad(grad, grad_dtype, offs, mask)
        p = load_values(param, param_dtype, offs, mask)
        acc += tl.sum(tl.where(mask, g * g + eps1, 0.0), axis=1)
        acc_p += tl.sum(p * p, axis=1)
    offset = tl.load(row + ROW_OFFSET)
    tl.store(row_sums + offset + r, acc, mask=row_ok)
    tl.store(param_sq + offset + r, acc_p, mask=row_ok)


@triton.jit
def _col_stats_kernel(meta, units, col_sums, eps1, BR: tl.constexpr, BC: tl.constexpr, NCOLS: tl.constexpr):
    row, unit = _tensor_row(meta, units, NCOLS)
    height, cols = tl.load(row + HEIGHT), tl.load(row + COLS)
    grad, grad_dtype = tl.load(row + GRAD), tl.load(row + GRAD_DTYPE)
    col_blocks = tl.cdiv(cols, BC)
    batch = unit.to(tl.int64) // col_blocks
    c = (unit % col_blocks) * BC + tl.arange(0, BC)
    col_ok = c < cols
    acc = tl.zeros([BC], dtype=tl.float32)
    for start in range(0, height, BR):
        r = start + tl.arange(0, BR)
        offs = batch * height * cols + r[:, None].to(tl.int64) * cols + c[None, :]
        mask = (r < height)[:, None] & col_ok[None, :]
        g = _finite_grad(grad, grad_dtype, offs, mask)
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
                     one_minus_beta2t, SCALE: tl.constexpr, CHUNK: tl.constexpr, NCOLS: tl.constexpr):
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
    if tl.load(row + FACTORED) != 0:
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
               UPDATE_SQ: tl.constexpr):
    """``u = g / sqrt(V)``: factored ``(rsqrt(R/mean R) * rsqrt(C)) * g``, else ``rsqrt(V) * g`` where the
    unfactored ``V`` is updated and stored first when ``UPDATE_SQ`` (the update pass), read as is otherwise."""
    if tl.load(row + FACTORED) != 0:
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
                      BLOCKS: tl.constexpr, NCOLS: tl.constexpr):
    row, first_block = _tensor_row(meta, tiles, NCOLS)
    _, offs = tile_offsets(first_block.to(tl.int64), BLOCKS)
    mask = offs < tl.load(row + NUMEL)
    g = _finite_grad(tl.load(row + GRAD), tl.load(row + GRAD_DTYPE), offs, mask)
    u = _direction(row, g, offs, mask, row_factor, col_factor, beta2t, one_minus_beta2t, eps1, True)
    u = tl.where(mask, u, 0.0)
    tl.store(partials + tl.program_id(0), tl.sum(tl.sum(u * u, axis=1), axis=0))


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
                  beta1, one_minus_beta1, ordinals, sr_key, HAS_M: tl.constexpr, HAS_DECAY: tl.constexpr,
                  BLOCKS: tl.constexpr, NCOLS: tl.constexpr, SR: tl.constexpr):
    program = tl.program_id(0)
    tensor = tl.load(tiles + 2 * program)
    row = meta + tensor.to(tl.int64) * NCOLS
    blocks, offs = tile_offsets(tl.load(tiles + 2 * program + 1).to(tl.int64), BLOCKS)
    n = tl.load(row + NUMEL)
    mask = offs < n
    block_mask = blocks * 256 < n
    g = load_values(tl.load(row + GRAD), tl.load(row + GRAD_DTYPE), offs, mask)
    finite = (g == g) & (tl.abs(g) != float("inf"))
    g = tl.where(finite, g, 0.0)
    u = _direction(row, g, offs, mask, row_factor, col_factor, 0.0, 0.0, eps1, False)
    u = tl.div_rn(u, tl.load(clip_denominators + tensor))
    lr = tl.load(lrs + tensor)
    u = u * lr
    if HAS_M:
        m_values, m_absmax, m_format = tl.load(row + M_VALUES), tl.load(row + M_ABSMAX), tl.load(row + M_FORMAT)
        old = load_state(m_values, m_absmax, m_format, qmap, qmap, blocks, offs, mask, block_mask)  # no 4-bit state
        m = tl.where(finite, old * beta1 + u * one_minus_beta1, old)
        store_state(m_values, m_absmax, m_format, table, qmap, blocks, offs, m, mask, block_mask, True)
        u = m
    param, param_dtype = tl.load(row + PARAM), tl.load(row + PARAM_DTYPE)
    p = load_values(param, param_dtype, offs, mask)
    new = p
    if HAS_DECAY:
        new = new + new * (negative_decay * lr)
    new = new - u
    ordinal = tl.load(ordinals + tensor) if SR else 0
    store_param(param, param_dtype, offs, tl.where(finite, new, p), mask, ordinal, sr_key, SR)


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


def step(optimizer, algorithm, group: dict, key, items: list, step: int, hyper, cache: mt.PlanCache,
         device: torch.device, stochastic=None) -> None:
    """One Adafactor step of ``items`` = [(param, grad, state), ...] (contiguous local tensors on ``device``, all
    with step counter ``step``, already counted; ``hyper`` its ``AdafactorHyper``): six launches, each over every
    tensor (five when no tensor is factored: no column pass). ``stochastic``: ``(ordinals, key)`` device tensors
    to round bf16 parameters stochastically."""
    kwargs = launch_kwargs(device)
    (first_moment,) = algorithm.slots
    h = kernel_scalars(hyper)
    eps1, eps2 = h.eps1, h.eps2
    table, total_rows, total_cols, tiles = _meta_rows(items, first_moment)
    meta = cache.table((algorithm.name, *key), table, torch.int64, device)
    tiles_table = cache.units([num_blocks(row[NUMEL.value]) for row in table], TILE_BLOCKS, device)
    row_units = [triton.cdiv(row[ROWS.value], ROWS_PER_PROGRAM) for row in table]
    row_table = cache.units(row_units, 1, device)
    # the column pass visits factored tensors only: its table names their indices in ``meta``
    factored = [i for i, row in enumerate(table) if row[FACTORED.value]]
    col_units = [(table[i][ROWS.value] // table[i][HEIGHT.value]) * triton.cdiv(table[i][COLS.value], COLS_PER_PROGRAM)
                 for i in factored]
    col_table = cache.units(col_units, 1, device, factored) if factored else None
    matrices = [row[ROWS.value] // row[HEIGHT.value] if row[FACTORED.value] else 1 for row in table]
    matrix_table = cache.units(matrices, 1, device)

    row_sums = torch.empty(total_rows, dtype=torch.float32, device=device)
    param_sq = torch.empty(total_rows, dtype=torch.float32, device=device)
    row_factor = torch.empty(max(total_rows, 1), dtype=torch.float32, device=device)
    col_sums = torch.empty(max(total_cols, 1), dtype=torch.float32, device=device)
    col_factor = torch.empty(max(total_cols, 1), dtype=torch.float32, device=device)
    lrs = torch.empty(len(table), dtype=torch.float32, device=device)
    num_tiles = sum(tiles)
    partials = torch.empty(num_tiles, dtype=torch.float32, device=device)
    clip_denominators = torch.empty(len(table), dtype=torch.float32, device=device)

    triton_guard.launch(
        _row_stats_kernel, (sum(row_units),),
        meta, row_table, row_sums, param_sq, eps1, BR=ROWS_PER_PROGRAM, BC=COLS_PER_PROGRAM, NCOLS=META_COLS,
        **kwargs,
    )
    if factored:
        triton_guard.launch(
            _col_stats_kernel, (sum(col_units),),
            meta, col_table, col_sums, eps1, BR=ROWS_PER_PROGRAM, BC=COLS_PER_PROGRAM, NCOLS=META_COLS, **kwargs,
        )
    triton_guard.launch(
        _finalize_kernel, (sum(matrices),),
        meta, matrix_table, row_sums, param_sq, col_sums, row_factor, col_factor, lrs,
        h.step_size, eps2, h.beta2t, h.one_minus_beta2t, SCALE=bool(group["scale_parameter"]),
        CHUNK=REDUCE_CHUNK, NCOLS=META_COLS, **kwargs,
    )
    triton_guard.launch(
        _update_sq_kernel, (num_tiles,),
        meta, tiles_table, row_factor, col_factor, partials, h.beta2t, h.one_minus_beta2t, eps1, BLOCKS=TILE_BLOCKS,
        NCOLS=META_COLS, **kwargs,
    )
    triton_guard.launch(
        _clip_kernel, (len(table),),
        meta, partials, clip_denominators, h.inv_clip_threshold, CHUNK=REDUCE_CHUNK,
        BLOCKS=TILE_BLOCKS, NCOLS=META_COLS, **kwargs,
    )
    ordinals, sr_key = stochastic if stochastic is not None else (meta, meta)
    triton_guard.launch(
        _apply_kernel, (num_tiles,),
        meta, tiles_table, row_factor, col_factor, clip_denominators, lrs, eps1, h.negative_decay,
        dynamic_map(True, device), encoder_table(True, device), h.beta1, h.one_minus_beta1, ordinals, sr_key,
        HAS_M=group["beta1"] is not None, HAS_DECAY=group["weight_decay"] != 0, BLOCKS=TILE_BLOCKS, NCOLS=META_COLS,
        SR=stochastic is not None, **kwargs,
    )

