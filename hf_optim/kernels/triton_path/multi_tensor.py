"""Multi-tensor launch metadata: one kernel launch updates every parameter of a group.

A launch gets two small device tables instead of one tensor per argument:

- ``meta`` (int64, ``(tensors, META_COLS)``): per tensor the addresses of its parameter, gradient, optional
  fp32 output, up to three state rows (fp32 values or uint8 codes) and their absmax rows, its element count,
  the dtype codes of parameter and gradient, the format code of each state row, and its first tile.
- ``tiles`` (int32, ``(tiles, 2)``): per program the tensor it works on and its first 256-element block, so a
  program never straddles two tensors and a quantization block is always whole inside one program. A launch has
  two: the whole tiles of every tensor (run by a kernel compiled without masks) and each tensor's last, partial
  tile (a masked kernel); ``FIRST_TILE`` numbers each tensor's tiles, whole then partial, for per-tile outputs.

Both tables are built on the host from values the host already knows (addresses, sizes, dtypes), so building
them never synchronizes with the device. They are sent with non-blocking copies from pinned memory; the fused
kernel's are kept between steps by ``step.TritonPlans`` (which rewrites only the gradient column of ``meta``
when gradients move), those of LAMB's and Adafactor's passes by :class:`PlanCache` (re-sent when a value changes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_optim.core.state_store import StateSpec, slot_format
from hf_optim.formats.quant8 import num_blocks
from hf_optim.kernels.triton_path.tile import dtype_code
from hf_optim.numerics import BLOCK_SIZE

PARAM, GRAD, OUT, NUMEL, PARAM_DTYPE, GRAD_DTYPE = range(6)
VALUES = 6  # 6, 7, 8: state rows (fp32 values or uint8 codes)
ABSMAX = 9  # 9, 10, 11: absmax rows of 8-bit state rows
FORMAT = 12  # 12, 13, 14: format codes of the state rows (hf_optim.formats)
FIRST_TILE = 15
META_COLS = 16
MAX_ROWS = 3


def state_rows(state: dict, specs: tuple[StateSpec, ...]) -> list[tuple[int, int, int]]:
    """(values address, absmax address, format code) of every state row, in rule order; a stacked slot
    (AdEMAMix) gives one row per EMA, each row's values and absmax following the previous row's."""
    rows = []
    for spec in specs:
        fmt = slot_format(state, spec)
        values = state[spec.key]
        row_bytes = values.numel() // spec.rows * values.element_size()
        absmax = state[spec.absmax_key] if fmt.block_size else None
        for r in range(spec.rows):
            absmax_address = absmax.data_ptr() + r * (absmax.numel() // spec.rows) * 4 if fmt.block_size else 0
            rows.append((values.data_ptr() + r * row_bytes, absmax_address, fmt.code))
    return rows


def row_signedness(specs: tuple[StateSpec, ...]) -> tuple[bool, ...]:
    """Whether each state row uses the signed map (compile-time constants of the kernel)."""
    signed = tuple(spec.signed for spec in specs for _ in range(spec.rows))
    if len(signed) > MAX_ROWS:
        raise ValueError(f"the fused kernels take at most {MAX_ROWS} state rows, got {len(signed)}")
    return signed + (True,) * (MAX_ROWS - len(signed))


def meta_rows(items, specs, tile_blocks: int, out_addresses=None) -> list[list[int]]:
    """The ``meta`` table as Python ints for ``items`` = [(param, grad, state), ...] (contiguous tensors)."""
    table, first_tile = [], 0
    for index, (param, grad, state) in enumerate(items):
        n = param.numel()
        rows = state_rows(state, specs) + [(0, 0, 0)] * MAX_ROWS
        row = [0] * META_COLS
        row[PARAM], row[GRAD], row[NUMEL] = param.data_ptr(), grad.data_ptr(), n
        row[OUT] = out_addresses[index] if out_addresses is not None else 0
        row[PARAM_DTYPE], row[GRAD_DTYPE] = dtype_code(param.dtype), dtype_code(grad.dtype)
        for r in range(MAX_ROWS):
            row[VALUES + r], row[ABSMAX + r], row[FORMAT + r] = rows[r]
        row[FIRST_TILE] = first_tile
        first_tile += -(-num_blocks(n) // tile_blocks)
        table.append(row)
    return table


def split_tile_tables(numels: tuple[int, ...], tile_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(whole tiles, partial tiles): flat int32 (tensor index, first block) pairs of every tensor's tiles of
    ``tile_blocks`` blocks that lie wholly inside it, and of each tensor's last tile when it is partial."""
    per_tile = tile_blocks * BLOCK_SIZE
    whole = unit_table([(n // per_tile) * tile_blocks for n in numels], tile_blocks)
    partial = [(index, (n // per_tile) * tile_blocks) for index, n in enumerate(numels) if n % per_tile]
    return whole, torch.tensor(partial, dtype=torch.int32).flatten()


def unit_table(units: list[int], per_program: int, tensors: list[int] | None = None) -> torch.Tensor:
    """Flat int32 (tensor index, first unit) pairs giving each program ``per_program`` consecutive units of one
    tensor, where tensor ``i`` has ``units[i]`` units (quantization blocks, blocks of rows, ...); ``tensors``
    (default ``range(len(units))``) are the indices the table names, for a pass over some tensors only."""
    if tensors is None:
        tensors = range(len(units))
    units = torch.tensor(units, dtype=torch.int64)
    counts = (units + per_program - 1) // per_program
    tensor_index = torch.repeat_interleave(torch.tensor(list(tensors), dtype=torch.int64), counts)
    starts = torch.cumsum(counts, 0) - counts
    first_unit = (torch.arange(int(counts.sum())) - torch.repeat_interleave(starts, counts)) * per_program
    return torch.stack([tensor_index, first_unit], dim=1).to(torch.int32).flatten()


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list or tensor as a device tensor, copied without blocking the host (pinned staging memory on
    CUDA)."""
    host = torch.as_tensor(values, dtype=dtype)
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


@dataclass
class Launch:
    """Device tables of one multi-tensor launch (a kernel over the whole tiles, another over the partial ones)."""

    meta: torch.Tensor
    whole_tiles: torch.Tensor
    num_whole: int
    partial_tiles: torch.Tensor
    num_partial: int
    first_tiles: list[int]
    tile_blocks: int
    aligned: bool
    """Whether every parameter, gradient, output and state-row address is 16-byte aligned (vector accesses)."""

    @property
    def num_tiles(self) -> int:
        return self.num_whole + self.num_partial

    def tables(self):
        """``(whole, tiles table, number of tiles)`` for each non-empty kind of tile."""
        return [(whole, table, count) for whole, table, count in
                ((True, self.whole_tiles, self.num_whole), (False, self.partial_tiles, self.num_partial)) if count]


def launch_tables(table: list[list[int]], host: torch.Tensor, tile_blocks: int, device: torch.device) -> Launch:
    """The device tables of one launch from its ``meta`` rows (``table``, and ``host``: the same as an int64
    tensor)."""
    whole, partial = split_tile_tables(tuple(row[NUMEL] for row in table), tile_blocks)
    return Launch(to_device(host, torch.int64, device), to_device(whole, torch.int32, device), whole.numel() // 2,
                  to_device(partial, torch.int32, device), partial.numel() // 2, [row[FIRST_TILE] for row in table],
                  tile_blocks, all_aligned(table))


class PlanCache:
    """Keeps the device tables of recent launches, so unchanged addresses cost no copy at all."""

    def __init__(self) -> None:
        self._meta: dict = {}
        self._tiles: dict = {}

    def launch(self, key, items, specs, tile_blocks: int, device: torch.device, out_addresses=None) -> Launch:
        table = meta_rows(items, specs, tile_blocks, out_addresses)
        numels = tuple(row[NUMEL] for row in table)
        tiles_key = (numels, tile_blocks, device)
        if tiles_key not in self._tiles:
            whole, partial = split_tile_tables(numels, tile_blocks)
            self._tiles[tiles_key] = (to_device(whole, torch.int32, device), whole.numel() // 2,
                                      to_device(partial, torch.int32, device), partial.numel() // 2)
        cached = self._meta.get(key)
        if cached is None or cached[0] != table:
            cached = (table, to_device(table, torch.int64, device))
            self._meta[key] = cached
        return Launch(cached[1], *self._tiles[tiles_key], [row[FIRST_TILE] for row in table], tile_blocks,
                      all_aligned(table))

    def units(self, units: list[int], per_program: int, device: torch.device, tensors: list[int] | None = None):
        """The device :func:`unit_table` of ``units``, built and sent once per distinct set of arguments."""
        key = ("units", tuple(units), per_program, device, None if tensors is None else tuple(tensors))
        if key not in self._tiles:
            self._tiles[key] = to_device(unit_table(units, per_program, tensors), torch.int32, device)
        return self._tiles[key]

    def table(self, key, values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``values`` (host ints) as a device tensor, re-sent only when they changed since the last call with
        ``key``."""
        cached = self._meta.get(key)
        if cached is None or cached[0] != values:
            cached = (values, to_device(values, dtype, device))
            self._meta[key] = cached
        return cached[1]


def all_aligned(table: list[list[int]]) -> bool:
    """Whether every element address in ``table`` (not the absmax rows, read per block) is 16-byte aligned."""
    columns = (PARAM, GRAD, OUT, *range(VALUES, VALUES + MAX_ROWS))
    return all(row[column] % 16 == 0 for row in table for column in columns)
