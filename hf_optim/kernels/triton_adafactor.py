"""Adafactor's passes in Triton: the twin of ``Adafactor._update`` in ``hf_optim/optim/adafactor.py``.

Per parameter (Adafactor's statistics are per tensor, so these launch once per tensor, not once per group):

1. statistics: row sums of ``g*g + eps1`` and of ``p*p`` (one program per block of rows) and, for factored
   (>= 2-D) tensors, column sums (one program per block of columns), in a fixed order (no atomics);
2. the small factored statistics (row and column EMAs, ``RMS(p)``, the step's learning rate) are updated with
   the same torch operations as the PyTorch path, on the device;
3. an update pass computes ``u = g / sqrt(V)`` (updating the unfactored ``V`` in place) and per-tile sums of
   ``u*u``, from which torch computes the clipping denominator;
4. an apply pass recomputes ``u``, clips and scales it, runs the optional first moment (fp32 or 8-bit, through
   the shared 8-bit helpers) and updates the parameter.

Non-finite gradients count as zero in every statistic and the element is skipped, as on the PyTorch path.
Device scalars (learning rate, clipping denominator) are read by the kernels from device memory: no host sync.
Sums run in another order than torch's ``mean``/``norm``, so statistics differ from the PyTorch path's in the
last bits, and parameters agree within an ulp rather than bit for bit.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from hf_optim.kernels.blockwise import num_blocks
from hf_optim.kernels.dynamic_map import dynamic_map, encoder_table
from hf_optim.kernels.state_store import is_8bit
from hf_optim.kernels.triton_blockwise import (
    dtype_code,
    load_state,
    load_values,
    store_state,
    store_values,
    tile_offsets,
)
from hf_optim.kernels.triton_elementwise import TILE_BLOCKS, launch_kwargs

ROWS_PER_PROGRAM = 16
COLS_PER_PROGRAM = 256


@triton.jit
def _finite_grad(address, dtype, offs, mask):
    g = load_values(address, dtype, offs, mask)
    return tl.where((g == g) & (tl.abs(g) != float("inf")), g, 0.0)


@triton.jit
def _row_stats_kernel(grad, grad_dtype, param, param_dtype, row_sums, param_sq, rows, cols, eps1,
                      BR: tl.constexpr, BC: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    row_ok = r < rows
    acc = tl.zeros([BR], dtype=tl.float32)
    acc_p = tl.zeros([BR], dtype=tl.float32)
    for start in range(0, cols, BC):
        c = start + tl.arange(0, BC)
        offs = r[:, None].to(tl.int64) * cols + c[None, :]
        mask = row_ok[:, None] & (c < cols)[None, :]
        g = _finite_grad(grad, grad_dtype, offs, mask)
        p = load_values(param, param_dtype, offs, mask)
        acc += tl.sum(tl.where(mask, g * g + eps1, 0.0), axis=1)
        acc_p += tl.sum(p * p, axis=1)
    tl.store(row_sums + r, acc, mask=row_ok)
    tl.store(param_sq + r, acc_p, mask=row_ok)


@triton.jit
def _col_stats_kernel(grad, grad_dtype, col_sums, rows, cols, eps1, BR: tl.constexpr, BC: tl.constexpr):
    batch = tl.program_id(1).to(tl.int64)
    c = tl.program_id(0) * BC + tl.arange(0, BC)
    col_ok = c < cols
    acc = tl.zeros([BC], dtype=tl.float32)
    for start in range(0, rows, BR):
        r = start + tl.arange(0, BR)
        offs = batch * rows * cols + r[:, None].to(tl.int64) * cols + c[None, :]
        mask = (r < rows)[:, None] & col_ok[None, :]
        g = _finite_grad(grad, grad_dtype, offs, mask)
        acc += tl.sum(tl.where(mask, g * g + eps1, 0.0), axis=0)
    tl.store(col_sums + batch * cols + c, acc, mask=col_ok)


@triton.jit
def _direction(g, offs, mask, row_factor, col_factor, sq, beta2t, one_minus_beta2t, eps1, cols, rows_cols,
               FACTORED: tl.constexpr, UPDATE_SQ: tl.constexpr):
    """``u = g / sqrt(V)``: factored ``(rsqrt(R/mean R) * rsqrt(C)) * g``, else ``rsqrt(V) * g`` where the
    unfactored ``V`` is updated and stored first when ``UPDATE_SQ`` (the update pass), read as is otherwise."""
    if FACTORED:
        row = offs // cols
        col = (offs // rows_cols) * cols + offs % cols
        factor = tl.load(row_factor + row, mask=mask, other=1.0) * tl.load(col_factor + col, mask=mask, other=1.0)
        u = factor * g
    else:
        new = tl.load(sq + offs, mask=mask, other=1.0)
        if UPDATE_SQ:
            squared = g * g + eps1
            # torch: sq.mul_(b2t).add_(squared, alpha=1-b2t); its add with alpha is one fused multiply-add
            new = tl.fma(squared, tl.zeros_like(squared) + one_minus_beta2t, new * beta2t)
            tl.store(sq + offs, new, mask=mask)
        u = tl.rsqrt(new) * g
    return u


@triton.jit
def _update_sq_kernel(grad, grad_dtype, row_factor, col_factor, sq, partials, n, cols, rows_cols, beta2t,
                      one_minus_beta2t, eps1, FACTORED: tl.constexpr, BLOCKS: tl.constexpr):
    program = tl.program_id(0)
    _, offs = tile_offsets(program * BLOCKS, BLOCKS)
    mask = offs < n
    g = _finite_grad(grad, grad_dtype, offs, mask)
    u = _direction(g, offs, mask, row_factor, col_factor, sq, beta2t, one_minus_beta2t, eps1, cols, rows_cols,
                   FACTORED, True)
    u = tl.where(mask, u, 0.0)
    tl.store(partials + program, tl.sum(tl.sum(u * u, axis=1), axis=0))


@triton.jit
def _apply_kernel(grad, grad_dtype, param, param_dtype, row_factor, col_factor, sq, n, cols, rows_cols, eps1,
                  clip_denominator, lr, decay_lr, m_values, m_absmax, m_is_8bit, qmap, table, beta1,
                  one_minus_beta1, FACTORED: tl.constexpr, HAS_M: tl.constexpr, HAS_DECAY: tl.constexpr,
                  BLOCKS: tl.constexpr):
    blocks, offs = tile_offsets(tl.program_id(0) * BLOCKS, BLOCKS)
    mask = offs < n
    block_mask = blocks * 256 < n
    g = load_values(grad, grad_dtype, offs, mask)
    finite = (g == g) & (tl.abs(g) != float("inf"))
    g = tl.where(finite, g, 0.0)
    u = _direction(g, offs, mask, row_factor, col_factor, sq, 0.0, 0.0, eps1, cols, rows_cols, FACTORED, False)
    u = tl.div_rn(u, tl.load(clip_denominator))
    u = u * tl.load(lr)
    if HAS_M:
        old = load_state(m_values, m_absmax, m_is_8bit, qmap, blocks, offs, mask, block_mask)
        m = tl.where(finite, old * beta1 + u * one_minus_beta1, old)
        store_state(m_values, m_absmax, m_is_8bit, table, blocks, offs, m, mask, block_mask, True)
        u = m
    p = load_values(param, param_dtype, offs, mask)
    new = p
    if HAS_DECAY:
        new = new + new * tl.load(decay_lr)
    new = new - u
    store_values(param, param_dtype, offs, tl.where(finite, new, p), mask)


def update(optimizer, param: torch.Tensor, grad: torch.Tensor, state: dict, group: dict) -> None:
    """One Adafactor step of ``param`` (contiguous local tensor; ``state["step"]`` already counted)."""
    device, n = param.device, param.numel()
    kwargs = launch_kwargs(device)
    eps1 = float(group["eps"][0])
    grad = grad.contiguous()
    g_dtype, p_dtype = dtype_code(grad.dtype), dtype_code(param.dtype)
    factored = "exp_avg_sq_row" in state
    cols = param.shape[-1] if param.dim() >= 1 else 1
    rows = n // cols
    row_sums = torch.empty(rows, dtype=torch.float32, device=device)
    param_sq = torch.empty(rows, dtype=torch.float32, device=device)
    _row_stats_kernel[(triton.cdiv(rows, ROWS_PER_PROGRAM),)](
        grad.data_ptr(), g_dtype, param.data_ptr(), p_dtype, row_sums, param_sq, rows, cols, eps1,
        BR=ROWS_PER_PROGRAM, BC=COLS_PER_PROGRAM, **kwargs,
    )
    state["RMS"] = param_sq.sum().sqrt() / math.sqrt(n)
    step = state["step"]
    lr = optimizer._learning_rate(group, step, state["RMS"]).to(torch.float32).reshape(())
    beta2t = 1.0 - math.pow(step, group["decay_rate"])
    dummy = row_sums
    if factored:
        row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
        height = param.shape[-2]
        batches = rows // height
        col_sums = torch.empty(batches * cols, dtype=torch.float32, device=device)
        _col_stats_kernel[(triton.cdiv(cols, COLS_PER_PROGRAM), batches)](
            grad.data_ptr(), g_dtype, col_sums, height, cols, eps1, BR=ROWS_PER_PROGRAM, BC=COLS_PER_PROGRAM,
            **kwargs,
        )
        row.mul_(beta2t).add_((row_sums / cols).view_as(row), alpha=1.0 - beta2t)
        col.mul_(beta2t).add_((col_sums / height).view_as(col), alpha=1.0 - beta2t)
        row_factor = (row / row.mean(dim=-1, keepdim=True)).rsqrt().contiguous()
        col_factor = col.rsqrt().contiguous()
        sq, rows_cols = dummy, height * cols
    else:
        row_factor = col_factor = dummy
        sq, rows_cols = state["exp_avg_sq"], n

    tiles = triton.cdiv(num_blocks(n), TILE_BLOCKS)
    partials = torch.empty(tiles, dtype=torch.float32, device=device)
    _update_sq_kernel[(tiles,)](
        grad.data_ptr(), g_dtype, row_factor, col_factor, sq, partials, n, cols, rows_cols, beta2t, 1.0 - beta2t,
        eps1, FACTORED=factored, BLOCKS=TILE_BLOCKS, **kwargs,
    )
    update_rms = partials.sum().sqrt() / math.sqrt(n)
    clip_denominator = (update_rms / group["clip_threshold"]).clamp(min=1.0).reshape(())

    has_m = group["beta1"] is not None
    m = state.get("exp_avg")
    eight = has_m and is_8bit(state, _first_moment())
    m_absmax = state["exp_avg_absmax"] if eight else dummy
    decay_lr = (-group["weight_decay"] * lr).reshape(()) if group["weight_decay"] != 0 else lr
    beta1 = float(group["beta1"]) if has_m else 0.0
    _apply_kernel[(tiles,)](
        grad.data_ptr(), g_dtype, param.data_ptr(), p_dtype, row_factor, col_factor, sq, n, cols, rows_cols, eps1,
        clip_denominator, lr, decay_lr, m.data_ptr() if has_m else 0, m_absmax.data_ptr(), int(eight),
        dynamic_map(True, device) if eight else dummy, encoder_table(True, device), beta1, 1.0 - beta1,
        FACTORED=factored, HAS_M=has_m, HAS_DECAY=group["weight_decay"] != 0, BLOCKS=TILE_BLOCKS, **kwargs,
    )


def _first_moment():
    from hf_optim.optim.adafactor import FIRST_MOMENT

    return FIRST_MOMENT
