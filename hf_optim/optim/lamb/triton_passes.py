"""LAMB's trust-ratio passes in Triton (the update pass, which also writes per-tile sums of squares, is the
fused elementwise kernel with ``NORMS``): a norm pass reduces each tensor's partial sums to ``||p||`` and
``||u||`` and computes its trust ratio on the device, and an apply pass updates ``p -= lr * ratio * u``.

:func:`step` is LAMB's Triton plan (``LAMB_ALGORITHM.triton_plan`` in ``hf_optim/optim/lamb/__init__.py``).

Twin of ``lamb_tensor_update`` / ``trust_ratio`` in ``hf_optim/optim/lamb/__init__.py``. The norms are sums in another
order than torch's ``norm()``, so ratios can differ from the PyTorch path's in the last bits of fp32; the parameter
update ``lr * ratio * u`` is small next to ``p``, so parameters agree to within an ulp of their dtype.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hf_optim.core.algorithm import Algorithm, kernel_scalars
from hf_optim.formats import StateFormat
from hf_optim.formats.quant8 import num_blocks
from hf_optim.kernels.torch_path.multi_tensor import consecutive_pieces
from hf_optim.kernels.triton_path import guard as triton_guard
from hf_optim.kernels.triton_path import multi_tensor as mt
from hf_optim.kernels.triton_path.configs import _ROUNDING, DTYPES, LaunchSpec
from hf_optim.kernels.triton_path.configs import BF16 as BF16_CODE
from hf_optim.kernels.triton_path.elementwise import FusedConfig
from hf_optim.kernels.triton_path.elementwise import launch as launch_fused
from hf_optim.kernels.triton_path.rounding import store_param
from hf_optim.kernels.triton_path.tile import (
    BF16,
    DTYPE_NAMES,
    launch_options,
    load_values,
    masked_load,
    pointer,
    tile,
)

SCRATCH_NUMEL = 1 << 26
"""Most elements of LAMB directions held at once (256 MiB of fp32): larger groups run in several buckets."""

REDUCE_CHUNK = 1024


@triton.jit
def _ratio_kernel(meta, partials, ratios, max_trust_ratio, max_unorm, ADAPT: tl.constexpr, CLAMP: tl.constexpr,
                  UNORM: tl.constexpr, CHUNK: tl.constexpr, BLOCKS: tl.constexpr, COLS: tl.constexpr):
    tensor = tl.program_id(0)
    row = meta + tensor * COLS
    n = tl.load(row + mt.NUMEL)
    first = tl.load(row + mt.FIRST_TILE)
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
def _apply_kernel(meta, tiles, ratios, lr, ordinals, key, PARAM_DTYPE: tl.constexpr, FULL: tl.constexpr,
                  SR: tl.constexpr, BLOCKS: tl.constexpr, W: tl.constexpr, COLS: tl.constexpr,
                  ALIGNED: tl.constexpr):
    """``p -= (lr * ratio) * u`` over one tile (``u``: the direction at the tensor's ``OUT`` address)."""
    program = tl.program_id(0)
    tensor = tl.load(tiles + 2 * program)
    row = meta + tensor.to(tl.int64) * COLS
    first_block = tl.load(tiles + 2 * program + 1)
    _, _, _, offs = tile(first_block, BLOCKS, W)
    mask = None if FULL else offs < tl.load(row + mt.NUMEL)
    step = lr * tl.load(ratios + tensor)
    param_address = tl.load(row + mt.PARAM)
    p = load_values(param_address, offs, mask, PARAM_DTYPE, ALIGNED)
    direction = masked_load(pointer(tl.load(row + mt.OUT), tl.float32, ALIGNED) + offs, mask, 0.0)
    ordinal = tl.load(ordinals + tensor) if SR else 0
    store_param(param_address, offs, p - step * direction, mask, ordinal, key, PARAM_DTYPE, SR, ALIGNED)


@dataclass(frozen=True)
class ApplyConfig:
    """One specialization of LAMB's apply pass: parameter dtype, whole or partial tiles, stochastic rounding,
    alignment; ``tile_blocks`` follows the direction pass's tiles (the launch's tables)."""

    param_dtype: int
    full: bool
    tile_blocks: int
    stochastic: bool = False
    aligned: bool = True

    WIDTH = 4
    """fp32 directions: one 16-byte vector per thread."""

    @property
    def num_warps(self) -> int:
        return self.tile_blocks * 256 // (32 * self.WIDTH)

    def constants(self) -> dict:
        return {"PARAM_DTYPE": self.param_dtype, "FULL": self.full, "SR": self.stochastic, "BLOCKS": self.tile_blocks,
                "W": self.WIDTH, "COLS": mt.META_COLS, "ALIGNED": self.aligned and self.full}

    @property
    def key(self) -> tuple:
        return ("lamb-apply", DTYPE_NAMES[self.param_dtype], "full" if self.full else "partial",
                "sr" if self.stochastic else "rn", self.tile_blocks,
                "aligned" if self.aligned and self.full else "unaligned")

    @property
    def label(self) -> str:
        return (f"lamb/apply {DTYPE_NAMES[self.param_dtype]} {'full' if self.full else 'partial'} tiles"
                f"{' SR' if self.stochastic else ''}")


@dataclass(frozen=True)
class RatioConfig:
    """LAMB's norm pass: whether the trust ratio applies (``weight_decay != 0`` or ``use_nvlamb``), is clamped, and
    whether bitsandbytes' update-norm clip (``max_unorm > 0``) caps it."""

    adapt: bool
    clamp: bool
    tile_blocks: int
    unorm: bool = False

    num_warps = 4

    def constants(self) -> dict:
        return {"ADAPT": self.adapt, "CLAMP": self.clamp, "UNORM": self.unorm, "CHUNK": REDUCE_CHUNK,
                "BLOCKS": self.tile_blocks, "COLS": mt.META_COLS}

    @property
    def key(self) -> tuple:
        return ("lamb-ratio", self.adapt, self.clamp, self.unorm, self.tile_blocks)

    @property
    def label(self) -> str:
        return (f"lamb/ratio{' adaptive' if self.adapt else ''}{' clamped' if self.clamp else ''}"
                f"{' unorm' if self.unorm else ''}")


def trust_ratios(launch: mt.Launch, partials, ratios, config: RatioConfig, max_trust_ratio: float | None,
                 max_unorm: float = 0.0) -> None:
    """Per-tensor trust ratios into ``ratios`` (fp32, one per tensor) from the direction pass's ``partials``, as
    ``trust_ratio`` in ``hf_optim/optim/lamb/__init__.py`` computes them."""
    triton_guard.launch(
        _ratio_kernel, (len(launch.first_tiles),),
        launch.meta, partials, ratios, float(max_trust_ratio) if config.clamp else 0.0, float(max_unorm),
        **config.constants(),
        **launch_options(config.num_warps),
    )


def apply(launch: mt.Launch, ratios, lr: float, config: ApplyConfig, stochastic=None) -> None:
    """``p -= lr * ratio * u`` for every tensor of ``launch`` (``u`` at each tensor's ``OUT`` address), a launch per
    kind of tile; ``stochastic``: ``(ordinals, key)`` device tensors to round bf16 parameters stochastically."""
    ordinals, key = stochastic if stochastic is not None else (launch.meta, launch.meta)
    for whole, table, count in launch.tables():
        specialized = dataclasses.replace(config, full=whole, aligned=config.aligned and launch.aligned)
        triton_guard.launch(
            _apply_kernel, (count,),
            launch.meta, table, ratios, float(lr), ordinals, key, **specialized.constants(),
            **launch_options(specialized.num_warps),
        )


def step(algorithm, group: dict, key, batch: list, step: int, hyper, cache: mt.PlanCache,
         device: torch.device, stochastic=None) -> None:
    """LAMB's passes over ``batch`` = [(param, grad, state), ...] (one device, one step counter, one kernel group:
    see ``step.kernel_group``): the direction pass (moments, direction, per-tile sums of squares: the fused
    kernel with the algorithm's Triton rule), the norm pass and the apply pass, per bucket of at most
    :data:`SCRATCH_NUMEL` elements. ``stochastic``: bf16 stochastic rounding's ``(ordinals, key)`` for the batch
    (the apply pass rounds)."""
    from hf_optim.kernels.triton_path.step import fused_config, kernel_group

    specs = algorithm.slots
    kinds = kernel_group(specs, *batch[0])
    direction = fused_config(algorithm, kinds, device, stochastic=False, write_out=True)
    ratio = RatioConfig(adapt=group["weight_decay"] != 0 or group["use_nvlamb"],
                        clamp=group["max_trust_ratio"] is not None, tile_blocks=direction.tile_blocks,
                        unorm=group["max_unorm"] > 0)
    update = ApplyConfig(kinds[0], full=True, tile_blocks=direction.tile_blocks,
                         stochastic=stochastic is not None and kinds[0] == BF16.value, aligned=direction.aligned)
    scalars = kernel_scalars(hyper)
    buckets = consecutive_pieces(batch, lambda item: item[0].numel(), SCRATCH_NUMEL)
    # One direction buffer for every bucket: launches run in stream order, so a bucket's direction pass writes it
    # after the previous bucket's apply pass has read it (and the launches triton_guard records hold only this one).
    # Each tensor's direction starts on a 256-element boundary: 16-byte aligned, so whole tiles use vector accesses.
    padded = [[num_blocks(param.numel()) * 256 for param, _, _ in bucket] for bucket in buckets]
    scratch = torch.empty(max(sum(sizes) for sizes in padded), dtype=torch.float32, device=device)
    triton_guard.keep_alive(scratch)  # the kernels reach it through the meta table's addresses only
    first = 0  # index in the batch of the bucket's first tensor
    for index, (bucket, sizes) in enumerate(zip(buckets, padded)):
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        out_addresses = [scratch.data_ptr() + 4 * start for start in starts]
        launch = cache.launch((*key, index), bucket, specs, direction.tile_blocks, device, out_addresses)
        partials = torch.empty(2 * launch.num_tiles, dtype=torch.float32, device=device)
        for whole, table, count in launch.tables():
            launch_fused(dataclasses.replace(direction, full=whole, aligned=direction.aligned and launch.aligned),
                         launch.meta, table, count, scalars, device, partials=partials)
        ratios = torch.empty(len(bucket), dtype=torch.float32, device=device)
        trust_ratios(launch, partials, ratios, ratio, group["max_trust_ratio"], group["max_unorm"])
        rounding_args = None
        if update.stochastic:  # this bucket's slice of the batch's ordinals
            rounding_args = (stochastic[0][first : first + len(bucket)], stochastic[1])
        first += len(bucket)
        apply(launch, ratios, group["lr"], update, rounding_args)


def launch_specs(algorithm: Algorithm, formats: Sequence[StateFormat],
                 fused: Sequence[FusedConfig]) -> list[LaunchSpec]:
    """LAMB's norm and apply passes (``TritonPlan.specs``), for each tile size its direction pass (``fused``: the
    fused kernel's configurations with ``write_out``) uses."""
    specs = []
    for tile_blocks in sorted({config.tile_blocks for config in fused if config.write_out}):
        for adapt, clamp, unorm in itertools.product((True, False), repeat=3):
            ratio = RatioConfig(adapt, clamp, tile_blocks, unorm)
            specs.append(LaunchSpec(
                f"{ratio.label} ({tile_blocks * 256}-element tiles)", _ratio_kernel,
                {"meta": "*i64", "partials": "*fp32", "ratios": "*fp32", "max_trust_ratio": "fp32",
                 "max_unorm": "fp32"}, ratio.constants(), ratio.num_warps, "lamb", "LAMB"))
        for dtype in DTYPES:
            for stochastic in (False, True) if dtype == BF16_CODE else (False,):
                for full in (True, False):
                    apply = ApplyConfig(dtype, full, tile_blocks, stochastic)
                    specs.append(LaunchSpec(
                        f"{apply.label} ({tile_blocks * 256}-element tiles)", _apply_kernel,
                        {"meta": "*i64", "tiles": "*i32", "ratios": "*fp32", "lr": "fp32", **_ROUNDING},
                        apply.constants(), apply.num_warps, "lamb", "LAMB", elements_per_program=tile_blocks * 256,
                        main=full, param_dtype=DTYPE_NAMES[dtype]))
    return specs
