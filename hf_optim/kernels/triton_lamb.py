"""LAMB's trust-ratio passes in Triton (the update pass, which also writes per-tile sums of squares, is the
fused elementwise kernel with ``NORMS``): a norm pass reduces each tensor's partial sums to ``||p||`` and
``||u||`` and computes its trust ratio on the device, and an apply pass updates ``p -= lr * ratio * u``.

:func:`step` is LAMB's Triton plan (``LAMB_ALGORITHM.triton_plan`` in ``hf_optim/optim/lamb.py``).

Twin of ``LAMB._update`` / ``trust_ratio`` in ``hf_optim/optim/lamb.py``. The norms are sums in another order
than torch's ``norm()``, so ratios can differ from the PyTorch path's in the last bits of fp32; the parameter
update ``lr * ratio * u`` is small next to ``p``, so parameters agree to within an ulp of their dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_optim.kernels import triton_guard
from hf_optim.kernels import triton_multi_tensor as mt
from hf_optim.kernels.algorithm import kernel_scalars, resolve
from hf_optim.kernels.triton_blockwise import load_values, pointer, tile_offsets
from hf_optim.kernels.triton_elementwise import FULL_TILE_BOUND, TILE_BLOCKS, fused_update, launch_kwargs, maps_table
from hf_optim.kernels.triton_rounding import store_param

SCRATCH_NUMEL = 1 << 26
"""Most elements of LAMB directions held at once (256 MiB of fp32): larger groups run in several buckets."""

REDUCE_CHUNK = 1024


@triton.jit
def _ratio_kernel(meta, partials, ratios, max_trust_ratio, max_unorm, ADAPT: tl.constexpr, CLAMP: tl.constexpr,
                  UNORM: tl.constexpr, CHUNK: tl.constexpr, BLOCKS: tl.constexpr, COLS: tl.constexpr):
    tensor = tl.program_id(0)
    row = meta + tensor * COLS
    n = tl.load(row + 3)
    first = tl.load(row + 15)
    count = tl.cdiv(tl.cdiv(n, 256), BLOCKS)
    weight_sq = tl.zeros([CHUNK], dtype=tl.float32)
    update_sq = tl.zeros([CHUNK], dtype=tl.float32)
    for start in range(0, count, CHUNK):
        index = start + tl.arange(0, CHUNK)
        valid = index < count
        weight_sq += tl.load(partials + 2 * (first + index), mask=valid, other=0.0)
        update_sq += tl.load(partials + 2 * (first + index) + 1, mask=valid, other=0.0)
    weight_norm = tl.sqrt_rn(tl.sum(weight_sq, axis=0))
    update_norm = tl.sqrt_rn(tl.sum(update_sq, axis=0))
    both = (weight_norm > 0) & (update_norm > 0)
    free = tl.div_rn(weight_norm, tl.where(both, update_norm, 1.0))
    ratio = weight_norm * 0.0 + 1.0
    if ADAPT:
        ratio = tl.where(both, free, 1.0)
        if CLAMP:
            ratio = tl.minimum(ratio, max_trust_ratio)
    if UNORM:
        ratio = tl.where(both, tl.minimum(ratio, free * max_unorm), ratio)
    tl.store(ratios + tensor, ratio)


@triton.jit
def _apply_tile(row, step, offs, mask, ordinal, key, ALIGNED: tl.constexpr, SR: tl.constexpr):
    param_address, param_dtype = tl.load(row + 0), tl.load(row + 4)
    p = load_values(param_address, param_dtype, offs, mask, ALIGNED)
    direction = tl.load(pointer(tl.load(row + 2), tl.float32, ALIGNED) + offs, mask=mask, other=0.0)
    store_param(param_address, param_dtype, offs, p - step * direction, mask, ordinal, key, SR, ALIGNED)


@triton.jit
def _apply_kernel(meta, tiles, ratios, lr, ordinals, key, BLOCKS: tl.constexpr, COLS: tl.constexpr,
                  ALIGNED: tl.constexpr, SR: tl.constexpr):
    program = tl.program_id(0)
    tensor = tl.load(tiles + 2 * program)
    row = meta + tensor.to(tl.int64) * COLS
    first_block = tl.load(tiles + 2 * program + 1)
    _, offs = tile_offsets(first_block, BLOCKS)
    n = tl.load(row + 3)
    step = lr * tl.load(ratios + tensor)
    ordinal = tl.load(ordinals + tensor) if SR else 0
    if (first_block + BLOCKS) * 256 <= n:  # whole tile: a compile-time mask bound (vector accesses)
        _apply_tile(row, step, offs, offs < FULL_TILE_BOUND, ordinal, key, ALIGNED, SR)
    else:
        _apply_tile(row, step, offs, offs < n, ordinal, key, ALIGNED, SR)


def trust_ratios(launch: mt.Launch, partials, ratios, *, adapt: bool, max_trust_ratio: float | None,
                 max_unorm: float = 0.0, device) -> None:
    """Per-tensor trust ratios into ``ratios`` (fp32, one per tensor) from the update pass's ``partials``, as
    ``trust_ratio`` in ``hf_optim/optim/lamb.py`` computes them."""
    clamp = max_trust_ratio is not None
    triton_guard.launch(
        _ratio_kernel, (len(launch.first_tiles),),
        launch.meta, partials, ratios, float(max_trust_ratio) if clamp else 0.0, float(max_unorm),
        ADAPT=bool(adapt), CLAMP=clamp, UNORM=max_unorm > 0, CHUNK=REDUCE_CHUNK, BLOCKS=TILE_BLOCKS,
        COLS=mt.META_COLS, **launch_kwargs(device),
    )


def apply(launch: mt.Launch, ratios, lr: float, device, stochastic=None) -> None:
    """``p -= lr * ratio * u`` for every tensor of ``launch`` (``u`` at each tensor's ``OUT`` address);
    ``stochastic``: ``(ordinals, key)`` device tensors to round bf16 parameters stochastically."""
    ordinals, key = stochastic if stochastic is not None else (launch.meta, launch.meta)
    triton_guard.launch(
        _apply_kernel, (launch.num_tiles,),
        launch.meta, launch.tiles, ratios, float(lr), ordinals, key, BLOCKS=TILE_BLOCKS, COLS=mt.META_COLS,
        ALIGNED=launch.aligned, SR=stochastic is not None, **launch_kwargs(device),
    )


def _buckets(batch: list, limit: int) -> list[list]:
    buckets, current, size = [], [], 0
    for item in batch:
        n = item[0].numel()
        if current and size + n > limit:
            buckets.append(current)
            current, size = [], 0
        current.append(item)
        size += n
    if current:
        buckets.append(current)
    return buckets


def step(optimizer, algorithm, group: dict, key, batch: list, step: int, hyper, cache: mt.PlanCache,
         device: torch.device, stochastic=None) -> None:
    """LAMB's passes over ``batch`` = [(param, grad, state), ...] (one device, one step counter): the update pass
    (moments, direction, per-tile sums of squares: the fused kernel with the algorithm's Triton rule), the norm
    pass and the apply pass, per bucket of at most :data:`SCRATCH_NUMEL` elements. ``stochastic``: bf16
    stochastic rounding's ``(ordinals, key)`` for the batch (the apply pass rounds)."""
    specs = algorithm.slots
    rule, scalars = resolve(algorithm.triton_rule), kernel_scalars(hyper)
    adapt = group["weight_decay"] != 0 or group["use_nvlamb"]
    first = 0  # index in the batch of the bucket's first tensor
    buckets = _buckets(batch, SCRATCH_NUMEL)
    # One direction buffer for every bucket: launches run in stream order, so a bucket's update pass writes it after
    # the previous bucket's apply pass has read it (and the launches recorded by triton_guard hold only this one).
    scratch = torch.empty(max(sum(param.numel() for param, _, _ in bucket) for bucket in buckets),
                          dtype=torch.float32, device=device)
    triton_guard.keep_alive(scratch)  # the kernels reach it through the meta table's addresses only
    for index, bucket in enumerate(buckets):
        out_addresses, offset = [], 0
        for param, _, _ in bucket:
            out_addresses.append(scratch.data_ptr() + 4 * offset)
            offset += param.numel()
        launch = cache.launch((*key, index), bucket, specs, TILE_BLOCKS, device, out_addresses)
        partials = torch.empty(2 * launch.num_tiles, dtype=torch.float32, device=device)
        fused_update(rule, algorithm.state_rows, mt.row_signedness(specs), launch, maps_table(device), scalars,
                     write_out=True, partials=partials, device=device)
        ratios = torch.empty(len(bucket), dtype=torch.float32, device=device)
        trust_ratios(launch, partials, ratios, adapt=adapt, max_trust_ratio=group["max_trust_ratio"],
                     max_unorm=group["max_unorm"], device=device)
        rounding_args = None
        if stochastic is not None:  # this bucket's slice of the batch's ordinals
            rounding_args = (stochastic[0][first : first + len(bucket)], stochastic[1])
        first += len(bucket)
        apply(launch, ratios, group["lr"], device, rounding_args)
