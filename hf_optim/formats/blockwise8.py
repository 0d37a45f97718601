"""bitsandbytes' 8-bit blockwise state (>= 0.44), unchanged on disk, so checkpoints move both ways.

A slot ``stateK`` holds uint8 codes in the slot's shape, ``absmaxK`` one fp32 absmax per 256 elements (per row)
and ``qmapK`` the 256-entry dynamic map (signed for moments that can be negative). The math is in
:mod:`hf_optim.formats.quant8`; the kernels take a slot as ``[codes as int8, absmax, qmap, encoder table]``
(int8: see ``quant8.quantize_into``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
from collections.abc import Callable, Iterator, Sequence

import torch

from hf_optim.formats import quant8
from hf_optim.formats.base import Scales, StateDictError, StateFormat, in_blocks, register_format
from hf_optim.formats.dynamic_map import ZERO_CODE_SIGNED, dynamic_map, encoder_table
from hf_optim.formats.quant8 import num_blocks
from hf_optim.numerics import BLOCK_SIZE

OLD_BLOCK_SIZE = 2048
"""bitsandbytes <= 0.43's optimizer block size, refused with an explanation."""

MAP_ULP_TOLERANCE = 2
"""How many fp32 steps (ulp) a loaded map's entry may lie from the package's constant map (see :func:`_checked_map`).

torch's CPU kernels evaluate the map's ``linspace`` bounds in one of two ways: ``start + step * i`` rounded once (FMA
kernels: AVX2, AVX-512; the constants) or twice (``ATEN_CPU_CAPABILITY=default``). A bound then differs by 1 ulp;
where the midpoint, scaled by ``10**(i - 6)``, lands at the bottom of a lower binade than the bound, that 1 ulp is 2
of the result's ulp: signed entries 89 and 165, unsigned 39, 75, 96 and 98 differ by 2 ulp, 40 + 27 others by 1
(tests/formats/test_dynamic_map.py reproduces both evaluations exactly). Any other map (torchao's, a 4-bit one, one
cast to
bf16 or fp16) is thousands of ulp off."""

logger = logging.getLogger("hf_optim")

_adopted_maps: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("hf_optim_adopted_maps", default=None)


@functools.cache
def shared_map(signed: bool, device: torch.device) -> torch.Tensor:
    """One map per device for the kernels (each parameter's state keeps its own copy for ``state_dict``)."""
    return dynamic_map(signed, device)


class Blockwise8(StateFormat):
    name, bits, code, width, block_size = "blockwise8", 8, 1, 4, BLOCK_SIZE
    class_suffix, optim_suffix, label, rank, optim_bits = "8bit", "8bit", "8-bit blockwise", 2, 8
    triton_rows = "hf_optim.kernels.triton_path.quant8:BLOCKWISE8_ROWS"

    def init_slot(self, state: dict, spec, param: torch.Tensor, allocate: Callable) -> None:
        shape = tuple(param.shape) if spec.rows == 1 else (spec.rows, *param.shape)
        blocks = num_blocks(param.numel())
        state[spec.key] = allocate(shape, dtype=torch.uint8, device=param.device, elements=param.numel())
        state[spec.qmap_key] = dynamic_map(spec.signed, param.device)
        state[spec.absmax_key] = self.zero_absmax(spec, blocks, param.device)

    def raw(self, state: dict, spec) -> list[torch.Tensor]:
        return self.coded_raw(state, spec, encoder_table)

    def slice_raw(self, raw, start, stop, block_form):
        codes, absmax, qmap, table = raw
        codes = codes[:, start:stop]
        blocks = absmax[:, start // BLOCK_SIZE : -(-stop // BLOCK_SIZE)]
        return [codes.reshape(codes.shape[0], -1, BLOCK_SIZE) if block_form else codes, blocks, qmap, table]

    def flat_buffers(self, rows, total, signed, device, allocate):
        codes = allocate((rows, total), dtype=torch.uint8, device=device, elements=total)
        if signed:  # the code of 0.0: 127 in the signed map (0, the allocator's zeros, in the unsigned one)
            codes.fill_(ZERO_CODE_SIGNED)
        return [codes, torch.zeros((rows, total // BLOCK_SIZE), dtype=torch.float32, device=device)]

    def flat_views(self, buffers, offset, numel):
        first = offset // BLOCK_SIZE
        return [buffers[0][:, offset : offset + numel], buffers[1][:, first : first + num_blocks(numel)]]

    def bind(self, state, spec, views, shape):
        codes, absmax = views
        state[spec.key] = codes.view(shape) if spec.rows > 1 else codes[0].view(shape)
        state[spec.absmax_key] = absmax if spec.rows > 1 else absmax[0]
        if spec.qmap_key not in state:
            state[spec.qmap_key] = dynamic_map(spec.signed, codes.device)

    def main_offset_bytes(self, offset: int) -> int:
        return offset

    def main_dtype(self) -> torch.dtype:
        return torch.uint8

    def kernel_chunk(self, buffers, start, stop, signed, device):
        """The raw tensors of flat elements ``[start, stop)`` of the multi-tensor buffers, in block form."""
        codes = in_blocks(buffers[0][:, start:stop], BLOCK_SIZE)
        absmax = buffers[1][:, start // BLOCK_SIZE : -(-stop // BLOCK_SIZE)]
        return [codes.view(torch.int8), absmax, shared_map(signed, device), encoder_table(signed, device)]

    def dequantize(self, raw: Sequence[torch.Tensor], signed: bool, n: int | None = None) -> torch.Tensor:
        codes, absmax, qmap = raw[:3]
        return quant8.dequantize(codes, absmax, qmap)

    def store(self, values: torch.Tensor, raw: Sequence[torch.Tensor], signed: bool, scales=None) -> None:
        codes, absmax, _, table = raw
        quant8.quantize_into(values, table, signed, codes, absmax, None if scales is None else scales[0])

    def scales(self, spec, shape):
        return (Scales(spec.absmax_key, BLOCK_SIZE),)

    def scales_of(self, values, raw, signed):
        return [quant8.block_absmax(values)]

    def state_bytes(self, numel: int, rows: int = 1) -> int:
        return rows * (numel + 4 * num_blocks(numel)) + 4 * 256

    def keys(self, spec) -> tuple[str, ...]:
        return (spec.key, spec.absmax_key, spec.qmap_key)  # flat_views' order first

    def recognises(self, state: dict, spec) -> bool:
        value, qmap = state.get(spec.key), state.get(spec.qmap_key)
        return (
            isinstance(value, torch.Tensor) and value.dtype == torch.uint8
            # Any qmap but the 4-bit formats' 16 entries: a missing or wrong one is refused by check_loaded, by name.
            and not (isinstance(qmap, torch.Tensor) and qmap.numel() == 16)
        )

    def check_loaded(self, param: torch.Tensor, state: dict, spec, where: str) -> None:
        """Refuse a slot that does not fit ``param``, and put the package's map in place of a loaded map within
        :data:`MAP_ULP_TOLERANCE` of it (see :func:`_checked_map`)."""
        shape = tuple(param.shape) if spec.rows == 1 else (spec.rows, *param.shape)
        self.check_slot_shape(param, state[spec.key], spec, where, shape)
        for key in (spec.qmap_key, spec.absmax_key):
            if key not in state:
                raise StateDictError(f"{where}: 8-bit {spec.key} has no {key}")
        blocks = num_blocks(param.numel())
        absmax = state[spec.absmax_key]
        expected = (blocks,) if spec.rows == 1 else (spec.rows, blocks)
        if tuple(absmax.shape) != expected:
            old_blocks = -(-param.numel() // OLD_BLOCK_SIZE)
            per_row = absmax.shape[-1] if absmax.dim() else 0
            if per_row == old_blocks and old_blocks != blocks:
                raise StateDictError(
                    f"{where}: {spec.absmax_key} has {per_row} blocks per row, which matches the 2048-element "
                    f"blocks of bitsandbytes <= 0.43; hf_optim and bitsandbytes >= 0.44 use {BLOCK_SIZE}-element "
                    "blocks. Re-save the checkpoint with a newer bitsandbytes or restart the optimizer state."
                )
            raise StateDictError(f"{where}: {spec.absmax_key} has shape {tuple(absmax.shape)}, expected {expected}")
        state[spec.qmap_key] = _checked_map(state[spec.qmap_key], spec, where)


def _checked_map(qmap, spec, where: str) -> torch.Tensor:
    """The map the loaded slot continues on: the package's constant, if ``qmap`` is it or lies within
    :data:`MAP_ULP_TOLERANCE` of it in every entry; otherwise :class:`StateDictError` saying how far off it is.

    Such maps come from bitsandbytes' (or an older hf_optim's) ``create_dynamic_map`` run on torch kernels without
    FMA. The codes index the map (value = ``qmap[code] * absmax``), so continuing on our map moves each decoded
    value by at most 2 ulp relative (plus the product's own rounding): far below the map's gaps (>= 0.7%, about
    2**16 ulp), so every code keeps its meaning. From the next step on, the state is encoded against our map (the
    encoder's midpoints are ours), and the per-parameter map in state is ours, as the shared map the multi-tensor
    and Triton kernels read already is."""
    kind = "signed" if spec.signed else "unsigned"
    ours = dynamic_map(spec.signed)
    if not isinstance(qmap, torch.Tensor):
        raise StateDictError(f"{where}: {spec.qmap_key} is a {type(qmap).__name__}, expected the {kind} dynamic map "
                             "(a 256-entry float32 tensor)")
    if tuple(qmap.shape) != (256,):
        raise StateDictError(f"{where}: {spec.qmap_key} has shape {tuple(qmap.shape)}, expected the 256-entry {kind} "
                             "dynamic map")
    loaded = qmap.detach().to("cpu", torch.float32)
    if qmap.dtype == torch.float32 and torch.equal(loaded.view(torch.int32), ours.view(torch.int32)):
        return qmap
    bad = (~loaded.isfinite()).nonzero().flatten()
    if bad.numel():
        raise StateDictError(f"{where}: {spec.qmap_key} holds {bad.numel()} non-finite entries (entry {int(bad[0])} "
                             f"is {loaded[bad[0]].item()}), expected the {kind} dynamic map")
    distance = ulp_distance(loaded, ours)
    worst = int(distance.argmax())
    if distance[worst] == 0:  # our values in another dtype (or -0.0 for 0.0): nothing to note
        return ours
    if distance[worst] > MAP_ULP_TOLERANCE:
        other = "unsigned" if spec.signed else "signed"
        hint = (f" (it is the {other} map)" if ulp_distance(loaded, dynamic_map(not spec.signed)).max()
                <= MAP_ULP_TOLERANCE else "")
        raise StateDictError(
            f"{where}: {spec.qmap_key} is not the {kind} dynamic map this algorithm uses{hint}: "
            f"{int((distance > MAP_ULP_TOLERANCE).sum())} of 256 entries differ by more than {MAP_ULP_TOLERANCE} ulp; "
            f"entry {worst} is {loaded[worst].item()!r}, expected {ours[worst].item()!r} "
            f"({int(distance[worst])} ulp apart)"
        )
    note = f"{where}: {spec.qmap_key}, {int((distance > 0).sum())} entries up to {int(distance[worst])} ulp off"
    notes = _adopted_maps.get()
    if notes is None:  # a check outside load_state_dict: its own line
        _log_adopted([note])
    else:
        notes.append(note)
    return ours


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per entry, how many fp32 values lie from ``a`` to ``b`` (0: the same value; +0.0 and -0.0 count as one)."""

    def ordered(x: torch.Tensor) -> torch.Tensor:  # fp32 bit patterns as integers in the order of their values
        bits = x.contiguous().view(torch.int32).to(torch.int64)
        return torch.where(bits < 0, -(bits & 0x7FFFFFFF), bits)

    return (ordered(a) - ordered(b)).abs()


def _log_adopted(notes: list[str]) -> None:
    # INFO, not WARNING: nothing is wrong and nothing is for the user to do (the maps differ only in how torch's
    # kernels round; the decoded state moves by a few ulp, far inside its quantization error). A warning on every
    # resume from such a checkpoint would teach users to ignore warnings.
    logger.info(
        "8-bit state: %d loaded dynamic map(s) differ from hf_optim's by at most %d ulp per entry (the map built by "
        "torch kernels without FMA); the state continues on hf_optim's maps (decoded values move by as many ulp). "
        "First: %s", len(notes), MAP_ULP_TOLERANCE, notes[0])


@contextlib.contextmanager
def one_map_note_per_load() -> Iterator[None]:
    """Within it, :meth:`Blockwise8.check_loaded` collects the maps it replaces, logged in one line when the block
    completes (none if it raises: the load did not happen)."""
    notes: list[str] = []
    token = _adopted_maps.set(notes)
    try:
        yield
    finally:
        _adopted_maps.reset(token)
    if notes:
        _log_adopted(notes)


BLOCKWISE8 = register_format(Blockwise8())
