"""The fused multi-tensor elementwise update in Triton: the twin of
:func:`hf_optim.kernels.torch_path.elementwise.update`.

A launch runs an algorithm's Triton rule (``hf_optim/optim/<algorithm>/triton_rule.py``) over many tensors of a
group: each program loads a tile of parameter and gradient, loads its state rows (each through its format's Triton
branch, :mod:`rows`), applies the non-finite-gradient rule, runs the rule and stores everything back. The rule of the
PyTorch path applies: an element whose gradient is NaN or +-Inf keeps its parameter and state values (quantized state
is re-encoded against its block's new absmax) and its direction output is 0.

Specialized: everything that decides the kernel's path is a compile-time constant of a :class:`FusedConfig`
(parameter and gradient dtype, each state row's format, as its branch's load and store functions, and map, whole or
partial tiles, stochastic rounding, LAMB's direction output), so each binary is one straight path with no run-time
branch. The host groups a param group's tensors by configuration (``step.kernel_group``) and launches once per
distinct configuration present: the whole tiles of all its tensors in one launch, each tensor's last, partial tile in
another. An 8-bit optimizer usually has two groups (its 8-bit tensors, and those under ``min_8bit_size`` with fp32
state), so up to four launches a step; the tables of each launch are kept between steps (:class:`step.TritonPlans`).

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

from hf_optim.formats import FP32
from hf_optim.kernels.triton_path import guard as triton_guard
from hf_optim.kernels.triton_path import multi_tensor as mt
from hf_optim.kernels.triton_path.rounding import store_param
from hf_optim.kernels.triton_path.rows import PADDING_CODE, TritonRows, kernel_maps, rows_for_code
from hf_optim.kernels.triton_path.tile import (
    BF16,
    DTYPE_NAMES,
    launch_options,
    load_values,
    pointer,
    tile,
    tile_sum,
)


@triton.jit
def _load_row(row, r: tl.constexpr, qmap, blocks, halves, rows, offs, mask, n, LOAD: tl.constexpr,
              SIGNED: tl.constexpr, ALIGNED: tl.constexpr, NATIVE_CONVERSIONS: tl.constexpr):
    """fp32 values of state row ``r`` of a tensor's meta ``row``, read by its format's ``LOAD`` (``qmap``: the row's
    map, see :func:`row_maps`)."""
    return LOAD(tl.load(row + mt.VALUES + r), tl.load(row + mt.ABSMAX + r), qmap, blocks, halves, rows, offs, mask, n,
                SIGNED, ALIGNED, NATIVE_CONVERSIONS)


@triton.jit
def _store_row(row, r: tl.constexpr, encoder, blocks, halves, rows, offs, values, mask, n, STORE: tl.constexpr,
               SIGNED: tl.constexpr, ALIGNED: tl.constexpr, NATIVE_CONVERSIONS: tl.constexpr):
    STORE(tl.load(row + mt.VALUES + r), tl.load(row + mt.ABSMAX + r), encoder, blocks, halves, rows, offs, values, mask,
          n, SIGNED, ALIGNED, NATIVE_CONVERSIONS)


@triton.jit
def _fused_update_kernel(
    meta, tiles, partials, qmap0, encoder0, qmap1, encoder1, qmap2, encoder2, h, ordinals, key,
    RULE: tl.constexpr, ROWS: tl.constexpr, LOAD0: tl.constexpr, STORE0: tl.constexpr, LOAD1: tl.constexpr,
    STORE1: tl.constexpr, LOAD2: tl.constexpr, STORE2: tl.constexpr, SIGNED0: tl.constexpr, SIGNED1: tl.constexpr,
    SIGNED2: tl.constexpr, PARAM_DTYPE: tl.constexpr, GRAD_DTYPE: tl.constexpr, FULL: tl.constexpr, SR: tl.constexpr,
    WRITE_OUT: tl.constexpr, NORMS: tl.constexpr, BLOCKS: tl.constexpr, W: tl.constexpr, COLS: tl.constexpr,
    ALIGNED: tl.constexpr, NATIVE_CONVERSIONS: tl.constexpr,
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

    s0 = _load_row(row, 0, qmap0, blocks, halves, rows, offs, mask, n, LOAD0, SIGNED0, ALIGNED,
                   NATIVE_CONVERSIONS)
    s1 = tl.zeros_like(p)
    s2 = tl.zeros_like(p)
    if ROWS > 1:
        s1 = _load_row(row, 1, qmap1, blocks, halves, rows, offs, mask, n, LOAD1, SIGNED1, ALIGNED,
                       NATIVE_CONVERSIONS)
    if ROWS > 2:
        s2 = _load_row(row, 2, qmap2, blocks, halves, rows, offs, mask, n, LOAD2, SIGNED2, ALIGNED,
                       NATIVE_CONVERSIONS)

    out, n0, n1, n2 = RULE(p, g, s0, s1, s2, h)
    # Every select on ``finite`` here, together: the old values die at once, and the per-element predicates are not
    # kept (or recomputed) across the quantization of the rows.
    n0 = tl.where(finite, n0, s0)
    n1 = tl.where(finite, n1, s1)
    n2 = tl.where(finite, n2, s2)
    out = tl.where(finite, out, 0.0 if WRITE_OUT else p)

    _store_row(row, 0, encoder0, blocks, halves, rows, offs, n0, mask, n, STORE0, SIGNED0, ALIGNED,
               NATIVE_CONVERSIONS)
    if ROWS > 1:
        _store_row(row, 1, encoder1, blocks, halves, rows, offs, n1, mask, n, STORE1, SIGNED1, ALIGNED,
                   NATIVE_CONVERSIONS)
    if ROWS > 2:
        _store_row(row, 2, encoder2, blocks, halves, rows, offs, n2, mask, n, STORE2, SIGNED2, ALIGNED,
                   NATIVE_CONVERSIONS)

    if WRITE_OUT:
        if not FULL:
            out = tl.where(mask, out, 0.0)
        tl.store(pointer(tl.load(row + mt.OUT), tl.float32, ALIGNED) + offs, out, mask=mask)
    else:
        ordinal = tl.load(ordinals + tensor) if SR else 0  # bf16 stochastic rounding: the parameter's ordinal
        store_param(param_address, offs, out, mask, ordinal, key, PARAM_DTYPE, SR, ALIGNED)
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
        formats: each state row's format code (``hf_optim.formats``), one per row the rule reads.
        signed: each state row's map signedness.
        param_dtype, grad_dtype: dtype codes (:data:`tile.DTYPE_CODES`).
        full: whole tiles (no masks) or each tensor's last, partial tile.
        stochastic: bf16 stochastic rounding of the parameter (bf16 parameters only).
        write_out: LAMB's pass: write the rule's output (the direction) and per-tile norms, not the parameter.
        aligned: every address is 16-byte aligned (vector accesses; partial tiles never need it).
        arch: the CUDA compute capability it is compiled for (``major * 10 + minor``; 0: not an NVIDIA GPU), for
            the tile width and the register limit.
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
    arch: int = 90

    def __post_init__(self) -> None:
        if not 1 <= len(self.formats) <= mt.MAX_ROWS or len(self.signed) != len(self.formats):
            raise ValueError(f"a fused configuration takes 1 to {mt.MAX_ROWS} state rows, got {self.formats}")
        if self.stochastic and self.param_dtype != BF16.value:
            raise ValueError("stochastic rounding applies to bf16 parameters only")

    WHOLE_TILE_WARPS = 4

    @functools.cached_property
    def branches(self) -> tuple[TritonRows, ...]:
        """The Triton branch (:class:`rows.TritonRows`: row I/O and tuning) of each distinct format of the rows."""
        return tuple(rows_for_code(code) for code in dict.fromkeys(self.formats))

    @property
    def whole_tile_width(self) -> int:
        """Elements per thread row (``tile``) of the whole-tile kernel, chosen from compiled register counts
        (``benchmarks/gpu/gpu_static.py``, Triton 3.9) so that every kernel reaches 50% occupancy at its 4 warps without
        spills: at most 64 registers on the SMs of 64 warps (sm_80, sm_90), 80 on sm_86/sm_89, 128 on sm_75.

        - 8 for 16-bit parameters with quantized state in at most two rows (AdamW, Lion, RMSprop): a 256-element
          block is one warp (its absmax: warp shuffles); the per-thread work is spread over 8 elements, the fewest
          instructions per element.
        - 4 otherwise: fp32 parameters or fp32 state (16-byte fp32 vectors; Triton stores at most 16 bytes per
          thread at once, so 8 fp32 values would be redistributed through shared memory before their store), and
          the configurations that take more than 64 registers at 8 (sm_80 and sm_90 only where the others stay
          under their limit): three state rows (AdEMAMix), LAMB's direction pass, stochastic rounding on sm_80,
          and those a row's format asks for (``TritonRows.narrow_tile``, beside its row code: 4-bit and fp8 state
          in some configurations on sm_80 and sm_90). An 8-bit block's absmax then spans two warps (a reduction
          through shared memory, 16 bytes)."""
        quantized = any(code != FP32.code for code in self.formats)
        if not quantized or self.param_dtype == 0 or self.write_out or len(self.formats) > 2:
            return 4
        if self.arch == 80 and self.stochastic:
            return 4
        return 4 if any(branch.narrow_tile(self) for branch in self.branches) else 8

    @property
    def max_registers(self) -> int | None:
        """``ptxas``' register limit (Triton's ``maxnreg``), or None (none). 64 for three state rows (AdEMAMix) on
        sm_80: with bf16 parameters, 4-bit state and stochastic rounding it takes 69 registers at width 4 (under 50%
        occupancy on its 64-warp SM), and ptxas fits it in 64 without spills. And 64 for whole tiles on sm_86 and
        sm_89 with fp32 parameters, and for Lion's:
        without a limit ptxas held two of them (AdamW fp32 8-bit, Lion fp16 4-bit) to 48 registers with a
        4-byte spill; with 64 they take 60-63 registers, no spill, 67% occupancy on those 48-warp SMs. The others
        (up to 72 registers; RMSprop bf16, with one state row as Lion, among them) spill with a limit of 64, some
        even with 80, and not without one: measured per configuration, not a rule ptxas documents. Else the
        lowest limit a row's format asks for (``TritonRows.register_limit``, beside its row code: 64 for whole tiles
        of width 8 with 4-bit or fp8 state on sm_90). Nowhere else: a limit above a kernel's natural count is not
        free (ptxas then spends registers up to it: AdamW bf16 8-bit SR on sm_80, 48 without, 64 with), and every
        other configuration is within its arch's limit without one (``benchmarks/gpu/gpu_static.py`` measures every
        configuration). A format's limit, where it gives one, comes before these rules (``stochastic4`` allows 72 on
        sm_80 for three rows with stochastic rounding, where 64 spills)."""
        limits = [limit for branch in self.branches if (limit := branch.register_limit(self)) is not None]
        if limits:  # a format's measured limit for this configuration comes first
            return min(limits)
        if self.arch == 80 and len(self.formats) > 2:
            return 64
        if self.arch in (86, 89) and self.full and (self.param_dtype == 0 or self.algorithm == "lion"):
            return 64
        return None

    def launch_options(self) -> dict:
        """The launch's options: :func:`tile.launch_options` and the register limit."""
        options = launch_options(self.num_warps)
        if self.max_registers is not None:
            options["maxnreg"] = self.max_registers
        return options

    @property
    def tile_blocks(self) -> int:
        """256-element blocks per program (the tile tables' unit: the same for whole and partial tiles): the
        whole-tile kernel's 4 warps with one row per thread."""
        return self.WHOLE_TILE_WARPS * 32 * self.whole_tile_width // 256

    @property
    def width(self) -> int:
        """Elements per thread row: the whole-tile width, or 2 for the partial-tile kernel. Its masks keep the
        compiler from vector accesses anyway (it runs one program per tensor), and a short row keeps its registers
        low: the same tile takes more warps, and a quantization block's absmax spans several of them (a reduction
        through shared memory)."""
        return self.whole_tile_width if self.full else 2

    @property
    def num_warps(self) -> int:
        return self.tile_blocks * 256 // (32 * self.width)

    def constants(self) -> dict:
        """The kernel's compile-time arguments: each row's format as its branch's load and store functions (unused
        rows: fp32's, never called)."""
        codes = self.formats + (PADDING_CODE,) * (mt.MAX_ROWS - len(self.formats))
        signed = self.signed + (True,) * (mt.MAX_ROWS - len(self.signed))
        rows = {}
        for r, code in enumerate(codes):
            branch = rows_for_code(code)
            rows[f"LOAD{r}"], rows[f"STORE{r}"] = branch.load, branch.store
        return {"RULE": self.rule, "ROWS": len(self.formats), **rows, "SIGNED0": signed[0], "SIGNED1": signed[1],
                "SIGNED2": signed[2], "PARAM_DTYPE": self.param_dtype, "GRAD_DTYPE": self.grad_dtype,
                "FULL": self.full, "SR": self.stochastic, "WRITE_OUT": self.write_out, "NORMS": self.write_out,
                "BLOCKS": self.tile_blocks, "W": self.width, "COLS": mt.META_COLS,
                "ALIGNED": self.aligned and self.full, "NATIVE_CONVERSIONS": self.native_conversions}

    @property
    def native_conversions(self) -> bool:
        """Whether the rows use the hardware's conversions (``TritonRows.native``: fp8's float8 conversions on sm_89
        and later): only configurations with a row of such a format say so, the others compile as before."""
        return any(branch.native(self.arch) for branch in self.branches)

    @property
    def label(self) -> str:
        states = "/".join(rows_for_code(code).label for code in self.formats)
        grad = "" if self.grad_dtype == self.param_dtype else f" ({DTYPE_NAMES[self.grad_dtype]} grads)"
        return (f"fused/{self.algorithm}{' direction' if self.write_out else ''} {DTYPE_NAMES[self.param_dtype]}"
                f"{grad} {states} {'full' if self.full else 'partial'} tiles"
                f"{' SR' if self.stochastic else ''}{'' if self.aligned or not self.full else ' unaligned'}")


def row_formats(state: dict, specs) -> tuple[int, ...]:
    """Each state row's format code (a stacked slot gives one per row)."""
    from hf_optim.core.state_store import slot_format

    return tuple(slot_format(state, spec).code for spec in specs for _ in range(spec.rows))


def row_maps(config: FusedConfig, device: torch.device) -> list[torch.Tensor]:
    """The kernel's ``qmap0, encoder0, qmap1, ...`` arguments: per state row its format's map and encoder tables
    (``rows.kernel_maps``; rows without them, and unused rows, get a placeholder, never read). The tensors are
    cached per device by their modules, so the addresses stay valid."""
    return list(_row_maps(tuple(config.formats), tuple(config.signed), torch.device(device)))


@functools.cache
def _row_maps(formats: tuple[int, ...], signed: tuple[bool, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    maps: list[torch.Tensor] = []
    for r in range(mt.MAX_ROWS):
        code, sign = (formats[r], signed[r]) if r < len(formats) else (PADDING_CODE, True)
        maps += kernel_maps(code, sign, device)
    return tuple(maps)


def launch(config: FusedConfig, meta, tiles, num_tiles: int, hyper: tuple, device: torch.device, *, partials=None,
           stochastic=None) -> None:
    """One launch of ``config``'s kernel over ``num_tiles`` tiles of ``tiles`` (a :class:`multi_tensor`
    tile table of the right kind: whole or partial) on ``device``. ``hyper``: the rule's scalars (the algorithm's
    ``hyper`` named tuple of floats); ``partials``: LAMB's per-tile sums (``write_out`` configurations);
    ``stochastic``: ``(ordinals, key)`` int64 device tensors (each tensor's parameter ordinal, the step's two key
    words)."""
    if num_tiles == 0:
        return
    ordinals, key = stochastic if stochastic is not None else (meta, meta)
    triton_guard.launch(
        _fused_update_kernel, (num_tiles,),
        meta, tiles, partials if partials is not None else meta, *row_maps(config, device), hyper, ordinals, key,
        **kernel_options(config),
    )


@functools.cache
def kernel_options(config: FusedConfig) -> dict:
    """The launch's compile-time arguments and options (:meth:`FusedConfig.constants`, :meth:`launch_options`),
    worked out once per configuration: each asks every row's format, and a step launches the same few
    configurations again and again."""
    return {**config.constants(), **config.launch_options()}


# The kernel reads the meta table by column number; keep it in step with multi_tensor's layout.
assert (mt.PARAM, mt.GRAD, mt.OUT, mt.NUMEL, mt.PARAM_DTYPE, mt.GRAD_DTYPE) == (0, 1, 2, 3, 4, 5)
assert (mt.VALUES, mt.ABSMAX, mt.FORMAT, mt.FIRST_TILE) == (6, 9, 12, 15)
