"""The fused multi-tensor elementwise update in Triton: the twin of :func:`hf_optim.kernels.elementwise.update`.

A launch runs an algorithm's rule (:mod:`triton_rules`) over many tensors of a group: each program loads a tile of
parameter and gradient, loads its state rows (fp32, 8-bit or 4-bit), applies the non-finite-gradient rule, runs the
rule and stores everything back. The rule of the PyTorch path applies: an element whose gradient is NaN or +-Inf
keeps its parameter and state values (quantized state is re-encoded against its block's new absmax) and its
direction output is 0.

Specialized: everything that decides the kernel's path is a compile-time constant of a :class:`FusedConfig`
(parameter and gradient dtype, each state row's format and map, whole or partial tiles, stochastic rounding,
LAMB's direction output), so each binary is one straight path with no run-time branch. The host groups a param
group's tensors by configuration (:func:`group_by_config`) and launches once per distinct configuration present:
the whole tiles of all its tensors in one launch, each tensor's last, partial tile in another. An 8-bit optimizer
usually has two groups (its 8-bit tensors, and those under ``min_8bit_size`` with fp32 state), so up to four
launches a step; the tables of each launch are cached (:class:`triton_multi_tensor.PlanCache`).

With ``NORMS`` (LAMB) each program also writes the sums of squares of its parameter and output tile to
``partials[2 * slot]`` and ``[2 * slot + 1]``, ``slot`` being the tile's index in its tensor's run of tiles
(``FIRST_TILE + first_block / BLOCKS``), so whole and partial tiles of one tensor land side by side.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hf_optim.kernels import triton_guard
from hf_optim.kernels import triton_multi_tensor as mt
from hf_optim.kernels.dynamic_map import encoder_table
from hf_optim.kernels.formats import BLOCKWISE4, BLOCKWISE8, FORMATS, FP32
from hf_optim.kernels.formats.blockwise4 import shared_map as shared_map4
from hf_optim.kernels.formats.blockwise8 import shared_map as shared_map8
from hf_optim.kernels.triton_blockwise import (
    FORMAT_BLOCKWISE4,
    FORMAT_BLOCKWISE8,
    load_state,
    store_state,
)
from hf_optim.kernels.triton_rounding import store_param
from hf_optim.kernels.triton_tile import (
    BF16,
    DTYPE_NAMES,
    launch_options,
    load_values,
    pointer,
    tile,
    tile_sum,
)

MAP8: tl.constexpr = tl.constexpr(0)
TABLE8: tl.constexpr = tl.constexpr(2)
MAP4: tl.constexpr = tl.constexpr(4)
"""Columns of :func:`maps_table`: 8-bit signed/unsigned maps, their encoder tables, the signed 4-bit map."""


@triton.jit
def _row_maps(maps, FORMAT: tl.constexpr, SIGNED: tl.constexpr):
    """(map for dequantizing, encoder table) of a row of ``FORMAT``; fp32 rows and 4-bit encoders need neither."""
    kind = 0 if SIGNED else 1
    if FORMAT == FORMAT_BLOCKWISE8:
        qmap = tl.load(maps + MAP8 + kind).to(tl.pointer_type(tl.float32))
        table = tl.load(maps + TABLE8 + kind).to(tl.pointer_type(tl.int32))
    elif FORMAT == FORMAT_BLOCKWISE4:
        qmap = tl.load(maps + MAP4).to(tl.pointer_type(tl.float32))
        table = maps
    else:
        qmap = maps
        table = maps
    return qmap, table


@triton.jit
def _load_row(row, r: tl.constexpr, maps, blocks, halves, rows, offs, mask, n, FORMAT: tl.constexpr,
              SIGNED: tl.constexpr, ALIGNED: tl.constexpr):
    """fp32 values of state row ``r`` of a tensor's meta ``row``."""
    qmap, _ = _row_maps(maps, FORMAT, SIGNED)
    return load_state(tl.load(row + mt.VALUES + r), tl.load(row + mt.ABSMAX + r), qmap, blocks, halves, rows, offs,
                      mask, n, FORMAT, SIGNED, ALIGNED)


@triton.jit
def _store_row(row, r: tl.constexpr, maps, blocks, halves, rows, offs, values, mask, n, FORMAT: tl.constexpr,
               SIGNED: tl.constexpr, ALIGNED: tl.constexpr):
    _, table = _row_maps(maps, FORMAT, SIGNED)
    store_state(tl.load(row + mt.VALUES + r), tl.load(row + mt.ABSMAX + r), table, blocks, halves, rows, offs, values,
                mask, n, FORMAT, SIGNED, ALIGNED)


@triton.jit
def _fused_update_kernel(
    meta, tiles, partials, maps, h, ordinals, key,
    RULE: tl.constexpr, ROWS: tl.constexpr, FORMAT0: tl.constexpr, FORMAT1: tl.constexpr, FORMAT2: tl.constexpr,
    SIGNED0: tl.constexpr, SIGNED1: tl.constexpr, SIGNED2: tl.constexpr, PARAM_DTYPE: tl.constexpr,
    GRAD_DTYPE: tl.constexpr, FULL: tl.constexpr, SR: tl.constexpr, WRITE_OUT: tl.constexpr, NORMS: tl.constexpr,
    BLOCKS: tl.constexpr, W: tl.constexpr, COLS: tl.constexpr, ALIGNED: tl.constexpr,
):
    program = tl.program_id(0)
    tensor = tl.load(tiles + 2 * program)
    row = meta + tensor.to(tl.int64) * COLS
    first_block = tl.load(tiles + 2 * program + 1)
    blocks, halves, rows, offs = tile(first_block, BLOCKS, W)
    if FULL:  # a whole tile: no masks at all
        n = 0
        mask = None
    else:
        n = tl.load(row + mt.NUMEL)
        mask = offs < n

    param_address = tl.load(row + mt.PARAM)
    p = load_values(param_address, offs, mask, PARAM_DTYPE, ALIGNED)
    g = load_values(tl.load(row + mt.GRAD), offs, mask, GRAD_DTYPE, ALIGNED)
    finite = tl.abs(g) < float("inf")  # false for NaN and +-inf: one compare
    g = tl.where(finite, g, 0.0)

    s0 = _load_row(row, 0, maps, blocks, halves, rows, offs, mask, n, FORMAT0, SIGNED0, ALIGNED)
    s1 = tl.zeros_like(p)
    s2 = tl.zeros_like(p)
    if ROWS > 1:
        s1 = _load_row(row, 1, maps, blocks, halves, rows, offs, mask, n, FORMAT1, SIGNED1, ALIGNED)
    if ROWS > 2:
        s2 = _load_row(row, 2, maps, blocks, halves, rows, offs, mask, n, FORMAT2, SIGNED2, ALIGNED)

    out, n0, n1, n2 = RULE(p, g, s0, s1, s2, h)

    _store_row(row, 0, maps, blocks, halves, rows, offs, tl.where(finite, n0, s0), mask, n, FORMAT0, SIGNED0, ALIGNED)
    if ROWS > 1:
        _store_row(row, 1, maps, blocks, halves, rows, offs, tl.where(finite, n1, s1), mask, n, FORMAT1, SIGNED1,
                   ALIGNED)
    if ROWS > 2:
        _store_row(row, 2, maps, blocks, halves, rows, offs, tl.where(finite, n2, s2), mask, n, FORMAT2, SIGNED2,
                   ALIGNED)

    if WRITE_OUT:
        out = tl.where(finite, out, 0.0)
        if not FULL:
            out = tl.where(mask, out, 0.0)
        tl.store(pointer(tl.load(row + mt.OUT), tl.float32, ALIGNED) + offs, out, mask=mask)
    else:
        ordinal = tl.load(ordinals + tensor) if SR else 0  # bf16 stochastic rounding: the parameter's ordinal
        store_param(param_address, offs, tl.where(finite, out, p), mask, ordinal, key, PARAM_DTYPE, SR, ALIGNED)
    if NORMS:
        slot = tl.load(row + mt.FIRST_TILE) + first_block // BLOCKS
        tl.store(partials + 2 * slot, tile_sum(p * p))
        tl.store(partials + 2 * slot + 1, tile_sum(out * out))


@dataclass(frozen=True)
class FusedConfig:
    """One specialization of the fused kernel: everything that decides its compiled path.

    Args:
        algorithm: the algorithm's name (for labels).
        rule: its ``@triton.jit`` rule.
        formats: each state row's format code (``hf_optim.kernels.formats``), one per row the rule reads.
        signed: each state row's map signedness.
        param_dtype, grad_dtype: dtype codes (:data:`triton_tile.DTYPE_CODES`).
        full: whole tiles (no masks) or each tensor's last, partial tile.
        stochastic: bf16 stochastic rounding of the parameter (bf16 parameters only).
        write_out: LAMB's pass: write the rule's output (the direction) and per-tile norms, not the parameter.
        aligned: every address is 16-byte aligned (vector accesses; partial tiles never need it).
    """

    algorithm: str
    rule: object
    formats: tuple[int, ...]
    signed: tuple[bool, ...]
    param_dtype: int
    grad_dtype: int
    full: bool
    stochastic: bool = False
    write_out: bool = False
    aligned: bool = True

    def __post_init__(self) -> None:
        if not 1 <= len(self.formats) <= mt.MAX_ROWS or len(self.signed) != len(self.formats):
            raise ValueError(f"a fused configuration takes 1 to {mt.MAX_ROWS} state rows, got {self.formats}")
        if self.stochastic and self.param_dtype != BF16.value:
            raise ValueError("stochastic rounding applies to bf16 parameters only")

    @property
    def width(self) -> int:
        """Elements per thread row (``triton_tile``). 8 where a row of 8-bit state must stay in one thread, so that a
        256-element block is one warp (its absmax: warp shuffles), and for 16-bit parameters with quantized state
        (16 bytes of bf16, a 32-bit word of 4-bit codes); 4 where fp32 values are stored and no 8-bit row needs 8
        (fp32 parameters, fp32 state, LAMB's fp32 direction): Triton stores at most 16 bytes per thread at once, so
        4 fp32 values keep every store a single vector without redistributing values through shared memory."""
        stores_fp32 = self.param_dtype == 0 or FP32.code in self.formats or self.write_out
        return 4 if stores_fp32 and BLOCKWISE8.code not in self.formats else 8

    @property
    def num_warps(self) -> int:
        return 4

    @property
    def tile_blocks(self) -> int:
        """256-element blocks per program: one row per thread."""
        return self.num_warps * 32 * self.width // 256

    def constants(self) -> dict:
        """The kernel's compile-time arguments."""
        formats = self.formats + (FP32.code,) * (mt.MAX_ROWS - len(self.formats))
        signed = self.signed + (True,) * (mt.MAX_ROWS - len(self.signed))
        return {"RULE": self.rule, "ROWS": len(self.formats), "FORMAT0": formats[0], "FORMAT1": formats[1],
                "FORMAT2": formats[2], "SIGNED0": signed[0], "SIGNED1": signed[1], "SIGNED2": signed[2],
                "PARAM_DTYPE": self.param_dtype, "GRAD_DTYPE": self.grad_dtype, "FULL": self.full,
                "SR": self.stochastic, "WRITE_OUT": self.write_out, "NORMS": self.write_out,
                "BLOCKS": self.tile_blocks, "W": self.width, "COLS": mt.META_COLS,
                "ALIGNED": self.aligned and self.full}

    @property
    def key(self) -> tuple:
        """A hashable name of the configuration (the fallback guard's key)."""
        return ("fused", self.algorithm, DTYPE_NAMES[self.param_dtype], DTYPE_NAMES[self.grad_dtype],
                tuple(format_label(f) for f in self.formats), "full" if self.full else "partial",
                "sr" if self.stochastic else "rn", "aligned" if self.aligned and self.full else "unaligned")

    @property
    def label(self) -> str:
        states = "/".join(format_label(f) for f in self.formats)
        grad = "" if self.grad_dtype == self.param_dtype else f" ({DTYPE_NAMES[self.grad_dtype]} grads)"
        return (f"fused/{self.algorithm}{' direction' if self.write_out else ''} {DTYPE_NAMES[self.param_dtype]}"
                f"{grad} {states} {'full' if self.full else 'partial'} tiles"
                f"{' SR' if self.stochastic else ''}{'' if self.aligned or not self.full else ' unaligned'}")


def format_label(code: int) -> str:
    return next(f"{fmt.bits}-bit" for fmt in FORMATS.values() if fmt.code == code)


def row_formats(state: dict, specs) -> tuple[int, ...]:
    """Each state row's format code (a stacked slot gives one per row)."""
    from hf_optim.kernels.state_store import slot_format

    return tuple(slot_format(state, spec).code for spec in specs for _ in range(spec.rows))


def maps_table(device: torch.device) -> torch.Tensor:
    """Addresses of the formats' maps on ``device``, for the kernels (one int64 table instead of five pointer
    arguments): 8-bit signed/unsigned map, their encoder tables, the signed 4-bit map. The tensors are cached per
    device by their modules, so the addresses stay valid."""
    return _maps_table(torch.device(device))


@functools.cache
def _maps_table(device: torch.device) -> torch.Tensor:
    tensors = [shared_map8(True, device), shared_map8(False, device), encoder_table(True, device),
               encoder_table(False, device), shared_map4(True, device)]
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=device)


def launch(config: FusedConfig, meta, tiles, num_tiles: int, maps, hyper: tuple, *, partials=None,
           stochastic=None) -> None:
    """One launch of ``config``'s kernel over ``num_tiles`` tiles of ``tiles`` (a :class:`triton_multi_tensor`
    tile table of the right kind: whole or partial). ``hyper``: the rule's scalars (the algorithm's ``hyper``
    named tuple of floats); ``partials``: LAMB's per-tile sums (``write_out`` configurations); ``stochastic``:
    ``(ordinals, key)`` int64 device tensors (each tensor's parameter ordinal, the step's two key words)."""
    if num_tiles == 0:
        return
    ordinals, key = stochastic if stochastic is not None else (meta, meta)
    triton_guard.launch(
        _fused_update_kernel, (num_tiles,),
        meta, tiles, partials if partials is not None else meta, maps, hyper, ordinals, key,
        **config.constants(), **launch_options(config.num_warps),
    )


# The kernel reads the meta table by column number; keep it in step with triton_multi_tensor's layout.
assert (mt.PARAM, mt.GRAD, mt.OUT, mt.NUMEL, mt.PARAM_DTYPE, mt.GRAD_DTYPE) == (0, 1, 2, 3, 4, 5)
assert (mt.VALUES, mt.ABSMAX, mt.FORMAT, mt.FIRST_TILE) == (6, 9, 12, 15)
assert (FORMAT_BLOCKWISE8.value, FORMAT_BLOCKWISE4.value) == (BLOCKWISE8.code, BLOCKWISE4.code)
