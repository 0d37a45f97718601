"""The state of many tensors in one flat buffer per slot, with each tensor's state a view into it.

The multi-tensor PyTorch path (:mod:`hf_optim.kernels.multi_tensor`) updates a whole group of tensors with one
compiled call per chunk of this buffer instead of a chain of small operations per tensor. Each parameter's state
is still the bitsandbytes layout of :mod:`hf_optim.kernels.state_store`, so ``state_dict()`` is unchanged: its
``state1``/``absmax1``/... entries are views of the flat buffers.

Layout: members follow each other, each starting on a 256-element boundary (the quantization block), so every
8-bit block of the flat buffer belongs to exactly one member and its absmax is the member's own. The padding
between members holds zeros and stays zero (8-bit padding holds the code of 0.0, which is 0 in the unsigned map
and 127 in the signed one): the multi-tensor path feeds it zero parameters and zero gradients, which every rule
maps to zero state, exactly like the zero padding of a tensor's last block in the per-tensor path.
A stacked slot (AdEMAMix's ``(2, *shape)``) is ``(rows, total)``; a member's view of it is ``(rows, *shape)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hf_optim.kernels.blockwise import num_blocks
from hf_optim.kernels.dynamic_map import BLOCK_SIZE, ZERO_CODE_SIGNED, dynamic_map, encoder_table
from hf_optim.kernels.state_store import StateSpec, slot_shape


def padded(numel: int) -> int:
    """``numel`` rounded up to whole quantization blocks (an empty tensor takes no room)."""
    return num_blocks(numel) * BLOCK_SIZE


@dataclass(frozen=True)
class Member:
    """Where one tensor's state lives in the flat buffers: elements ``[offset, offset + numel)``."""

    offset: int
    numel: int

    @property
    def stop(self) -> int:
        return self.offset + self.numel

    @property
    def padded_stop(self) -> int:
        return self.offset + padded(self.numel)


class FlatState:
    """Flat buffers for the slots ``specs`` of ``shapes`` tensors, 8-bit where ``kinds`` says so.

    ``kinds`` holds, per slot, None (fp32) or the signedness of an 8-bit slot (as ``state_store.slot_kinds``).
    ``allocate(shape, dtype=, device=)`` makes the buffers (paged memory can be plugged in).
    """

    def __init__(
        self,
        specs: Sequence[StateSpec],
        kinds: Sequence[bool | None],
        shapes: Sequence[torch.Size],
        device: torch.device,
        allocate: Callable = torch.zeros,
    ) -> None:
        self.specs, self.kinds, self.device = tuple(specs), tuple(kinds), device
        self.members: list[Member] = []
        offset = 0
        for shape in shapes:
            numel = torch.Size(shape).numel()
            self.members.append(Member(offset, numel))
            offset += padded(numel)
        self.total = offset
        self.plans: dict[tuple[int, ...], list] = {}  # multi_tensor's chunk plans, by run of member indices
        self._chunks: dict[tuple[int, int], list[torch.Tensor]] = {}  # views of the buffers, made once
        self.values: list[torch.Tensor] = []  # per slot: (rows, total), fp32 values or uint8 codes
        self.absmax: list[torch.Tensor | None] = []  # per slot: (rows, total / 256) for 8-bit slots
        for spec, kind in zip(self.specs, self.kinds):
            dtype = torch.float32 if kind is None else torch.uint8
            values = allocate((spec.rows, self.total), dtype=dtype, device=device)
            if kind:  # codes that decode to exactly 0 whatever the block's absmax: the padding must stay zero
                values.fill_(ZERO_CODE_SIGNED)
            self.values.append(values)
            blocks = (spec.rows, self.total // BLOCK_SIZE)
            self.absmax.append(None if kind is None else torch.zeros(blocks, dtype=torch.float32, device=device))

    def bind(self, index: int, param: torch.Tensor, state: dict) -> None:
        """Point ``state``'s slots at member ``index``'s views (``param`` gives the shape)."""
        member = self.members[index]
        for slot, (spec, kind) in enumerate(zip(self.specs, self.kinds)):
            view = self.values[slot][:, member.offset : member.stop].view(slot_shape(spec, param) if spec.rows > 1
                                                                         else (1, *param.shape))
            state[spec.key] = view if spec.rows > 1 else view[0]
            if kind is not None:
                blocks = slice(member.offset // BLOCK_SIZE, member.offset // BLOCK_SIZE + num_blocks(member.numel))
                absmax = self.absmax[slot][:, blocks]
                state[spec.absmax_key] = absmax if spec.rows > 1 else absmax[0]
                if spec.qmap_key not in state:
                    state[spec.qmap_key] = dynamic_map(kind, self.device)

    def holds(self, index: int, state: dict) -> bool:
        """Whether ``state``'s slots are still member ``index``'s views (a loaded state dict replaces them)."""
        member = self.members[index]
        for slot, spec in enumerate(self.specs):
            tensor = state.get(spec.key)
            values = self.values[slot]
            if tensor is None or tensor.dtype != values.dtype:
                return False
            if member.numel and tensor.data_ptr() != values.data_ptr() + member.offset * values.element_size():
                return False
        return True

    def load(self, index: int, state: dict) -> None:
        """Copy ``state``'s slot tensors (of this layout) into member ``index``'s place, then bind them."""
        member = self.members[index]
        for slot, (spec, kind) in enumerate(zip(self.specs, self.kinds)):
            self.values[slot][:, member.offset : member.stop].copy_(state[spec.key].reshape(spec.rows, -1))
            if kind is not None:
                first = member.offset // BLOCK_SIZE
                blocks = num_blocks(member.numel)
                self.absmax[slot][:, first : first + blocks].copy_(state[spec.absmax_key].reshape(spec.rows, -1))

    def chunk(self, start: int, stop: int) -> list[torch.Tensor]:
        """The raw slot tensors of flat elements ``[start, stop)`` (block-aligned), in the order
        ``elementwise.update`` takes them, in block form ``(rows, blocks, 256)``: fp32 ``[values]``, 8-bit
        ``[codes (int8 view), absmax (rows, blocks), qmap, table]``."""
        cached = self._chunks.get((start, stop))
        if cached is not None:
            return cached
        tensors = []
        blocks = slice(start // BLOCK_SIZE, -(-stop // BLOCK_SIZE))
        for slot, kind in enumerate(self.kinds):
            values = self.values[slot][:, start:stop]
            # The kernels' block form; one row is viewed as a contiguous tensor's, so that its strides do not
            # depend on the buffer's length (they would count as a new shape for the compiled kernel).
            if values.shape[0] == 1:
                values = values[0].view(1, -1, BLOCK_SIZE)
            else:
                values = values.unflatten(1, (-1, BLOCK_SIZE))
            if kind is None:
                tensors.append(values)
            else:
                tensors += [values.view(torch.int8), self.absmax[slot][:, blocks], _shared_map(kind, self.device),
                            encoder_table(kind, self.device)]
        self._chunks[start, stop] = tensors
        return tensors


_maps: dict = {}


def _shared_map(signed: bool, device: torch.device) -> torch.Tensor:
    """One map per device for the kernels (each parameter's state keeps its own copy for ``state_dict``)."""
    key = (signed, device)
    if key not in _maps:
        _maps[key] = dynamic_map(signed, device)
    return _maps[key]


class FlatStates:
    """Which parameters' state lives in which :class:`FlatState` of an optimizer.

    State is created (or, after ``load_state_dict`` replaced it, copied) into flat buffers one batch at a time:
    the parameters of a param group that get their state in the same step, split by device, parameter dtype and
    slot kinds. A parameter whose state no longer points into its buffers (a loaded state dict) is found by
    :meth:`locate` and moved in again by :meth:`adopt`.
    """

    def __init__(self) -> None:
        self._where: dict[torch.Tensor, tuple[FlatState, int]] = {}

    def create(self, specs: Sequence[StateSpec], entries: Sequence[tuple], allocate: Callable) -> None:
        """Zeroed state for ``entries`` = ``[(param, local tensor, state dict, slot kinds)]``."""
        self._place(specs, entries, allocate, copy=False)

    def adopt(self, specs: Sequence[StateSpec], entries: Sequence[tuple], allocate: Callable) -> None:
        """Move the existing state of ``entries`` (same form as :meth:`create`) into new flat buffers."""
        self._place(specs, entries, allocate, copy=True)

    @torch._disable_dynamo  # bookkeeping, not tensor math: outside an outer torch.compile's graph
    def _place(self, specs, entries, allocate, copy: bool) -> None:
        batches: dict[tuple, list] = {}
        for entry in entries:
            _, local, _, kinds = entry
            batches.setdefault((local.device, local.dtype, tuple(kinds)), []).append(entry)
        for (device, _, kinds), batch in batches.items():
            flat = FlatState(specs, kinds, [local.shape for _, local, _, _ in batch], device, allocate)
            for index, (param, local, state, _) in enumerate(batch):
                if copy:
                    flat.load(index, state)
                flat.bind(index, local, state)
                self._where[param] = (flat, index)

    def locate(self, param: torch.Tensor, state: dict) -> tuple[FlatState, int] | None:
        """``param``'s flat buffers and member index, or None when its state is not (or no longer) in them."""
        found = self._where.get(param)
        if found is None or not found[0].holds(found[1], state):
            return None
        return found

    def clear(self) -> None:
        self._where.clear()
