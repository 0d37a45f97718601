"""A state format's Triton branch, declared in one place per format, and the one switch the kernels reach it through.

A format with a Triton branch names a :class:`TritonRows` in ``StateFormat.triton_rows`` (``"module:attribute"``,
resolved here when a Triton step first needs it, so that ``hf_optim.formats`` never imports triton). It holds
everything the Triton path knows about the format:

- ``load`` / ``store``: the ``@triton.jit`` row I/O, one signature for every format::

      load(address, absmax_address, qmap, blocks, halves, rows, offs, mask, n, SIGNED, ALIGNED, NATIVE) -> values
      store(address, absmax_address, encoder, blocks, halves, rows, offs, values, mask, n, SIGNED, ALIGNED, NATIVE)

  ``address``: the row's values or codes (an integer address from a meta table); ``absmax_address``: its per-block
  scales (0 for a format without); ``qmap`` / ``encoder``: the row's :attr:`TritonRows.maps` kernel arguments;
  ``blocks, halves, rows, offs``: the :mod:`tile` tile; ``mask`` None for a whole tile, else ``offs < n``;
  ``SIGNED``: the slot's map signedness; ``ALIGNED``: 16-byte aligned rows (vector accesses); ``NATIVE``: the
  configuration's :meth:`TritonRows.native`. The kernels take them as compile-time arguments (the fused kernel's
  ``LOAD0``, ``STORE0``, ...; Adafactor's ``M_LOAD``, ``M_STORE``), so a binary holds only its own formats' code
  and branches on none;
- ``label``: how kernel labels name the state (``"8-bit"``);
- ``maps(signed, device)``: the row's map and encoder-table kernel arguments (None: a placeholder, never read);
- ``narrow_tile(config)`` / ``register_limit(config)``: the format's tuning of a fused-kernel configuration
  (``elementwise.FusedConfig``) that has one of its rows: whether its whole tiles need 4 elements per thread rather
  than 8, and the ``ptxas`` register limit it needs, each measured (``benchmarks/gpu/gpu_static.py``) and explained
  beside the format's row code;
- ``native(arch)``: whether its rows use the hardware's conversions on compute capability ``arch`` (fp8 on sm_89+).

Two function names of different formats must differ: tools key compiled binaries by the names of the compile-time
arguments' functions (``gpu_static.LaunchConfig.binary_key``).

fp32 rows are declared here: they are the rows of fp32 state, and what a configuration's unused rows are set to.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import triton
import triton.language as tl

from hf_optim.core.algorithm import resolve
from hf_optim.formats import FORMATS, FP32, StateFormat
from hf_optim.formats.blockwise8 import shared_map as shared_map8
from hf_optim.formats.encode8 import encoder8_tables
from hf_optim.kernels.triton_path.tile import masked_load, pointer


class FusedConfigLike(Protocol):
    """What a format's tuning reads of a fused-kernel configuration (``elementwise.FusedConfig``, which reads the
    formats' tuning: named here, not imported)."""

    @property
    def algorithm(self) -> str: ...
    @property
    def arch(self) -> int: ...
    @property
    def param_dtype(self) -> int: ...
    @property
    def stochastic(self) -> bool: ...
    @property
    def full(self) -> bool: ...
    @property
    def formats(self) -> tuple[int, ...]: ...
    @property
    def whole_tile_width(self) -> int: ...


def no_maps(signed: bool, device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A format that reads no map and no encoder table."""
    return None, None


def never_narrow(config: FusedConfigLike) -> bool:
    return False


def no_register_limit(config: FusedConfigLike) -> int | None:
    return None


def no_native_conversions(arch: int) -> bool:
    return False


@dataclass(frozen=True)
class TritonRows:
    """One state format's Triton branch (see the module docstring)."""

    label: str
    load: Any
    store: Any
    maps: Callable[[bool, torch.device], tuple[torch.Tensor | None, torch.Tensor | None]] = no_maps
    narrow_tile: Callable[[FusedConfigLike], bool] = never_narrow
    register_limit: Callable[[FusedConfigLike], int | None] = no_register_limit
    native: Callable[[int], bool] = no_native_conversions


@triton.jit
def load_fp32(address, absmax_address, qmap, blocks, halves, rows, offs, mask, n, SIGNED: tl.constexpr,
              ALIGNED: tl.constexpr, NATIVE: tl.constexpr):
    """The fp32 values at ``address``."""
    return masked_load(pointer(address, tl.float32, ALIGNED) + offs, mask, 0.0)


@triton.jit
def store_fp32(address, absmax_address, encoder, blocks, halves, rows, offs, values, mask, n, SIGNED: tl.constexpr,
               ALIGNED: tl.constexpr, NATIVE: tl.constexpr):
    tl.store(pointer(address, tl.float32, ALIGNED) + offs, values, mask=mask)


FP32_ROWS = TritonRows("32-bit", load_fp32, store_fp32)
"""fp32 state (``FP32.triton_rows``); its tiles' width and registers are the fused configuration's own rules."""


def rows_of(fmt: StateFormat) -> TritonRows:
    """``fmt``'s Triton branch (its ``triton_rows`` reference, resolved once; a relative reference is looked up in
    the package of the module defining the format's class)."""
    if fmt.triton_rows is None:
        raise ValueError(f"state format {fmt.name!r} has no Triton branch (its triton_rows is None)")
    return _resolved(fmt)


@functools.cache
def _resolved(fmt: StateFormat) -> TritonRows:
    module = sys.modules.get(type(fmt).__module__)
    rows = resolve(fmt.triton_rows, getattr(module, "__package__", None))
    if not isinstance(rows, TritonRows):
        raise TypeError(f"state format {fmt.name!r}: triton_rows {fmt.triton_rows!r} names a "
                        f"{type(rows).__name__}, not a TritonRows")
    return rows


def rows_for_code(code: int) -> TritonRows:
    """The Triton branch of the registered format whose ``code`` is ``code`` (the kernels' tables carry codes)."""
    for fmt in FORMATS.values():
        if fmt.code == code:
            return rows_of(fmt)
    raise ValueError(f"no registered state format has code {code}")


def kernel_maps(code: int, signed: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A row's ``(qmap, encoder)`` kernel arguments (:attr:`TritonRows.maps`), a placeholder typed as the kernels
    declare them (fp32 map, int32 table) for each one the format does not read. The tensors are cached per device by
    their modules, so the addresses stay valid."""
    qmap, encoder = rows_for_code(code).maps(signed, device)
    return (shared_map8(True, device) if qmap is None else qmap,
            encoder8_tables(True, device) if encoder is None else encoder)


PADDING_CODE = FP32.code
"""The format of a configuration's unused rows (never read or written)."""
