"""The state of many tensors in one flat buffer per slot, with each tensor's state a view into it.

The multi-tensor PyTorch path (:mod:`hf_optim.kernels.torch_path.multi_tensor`) updates a whole group of tensors with
one compiled call per chunk of this buffer instead of a chain of small operations per tensor. Each parameter's state
is still the bitsandbytes layout of :mod:`hf_optim.core.state_store`, so ``state_dict()`` is unchanged: its
``state1``/``absmax1``/... entries are views of the flat buffers.

Layout: members follow each other, each starting on a 256-element boundary (a multiple of every format's
quantization block), so every block of the flat buffer belongs to exactly one member and its absmax is the
member's own. The padding between members holds zeros and stays zero (quantized padding holds the code of 0.0,
see each format's ``flat_buffers``): the multi-tensor path feeds it zero parameters and zero gradients, which
every rule maps to zero state, exactly like the zero padding of a tensor's last block in the per-tensor path.
A stacked slot (AdEMAMix's ``(2, *shape)``) is ``(rows, total)``; a member's view of it is ``(rows, *shape)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hf_optim.core.state_store import StateSpec, slot_shape
from hf_optim.formats import SlotLayout
from hf_optim.formats.base import zeroed_buffer
from hf_optim.formats.quant8 import num_blocks
from hf_optim.kernels.torch_path.cpu_kernel import canonical
from hf_optim.numerics import BLOCK_SIZE


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
    """Flat buffers for the slots ``specs`` of ``shapes`` tensors, each slot in the format its layout names.

    ``layouts`` holds, per slot, its :class:`~hf_optim.formats.SlotLayout` (format and map signedness).
    ``allocate(shape, dtype=, device=)`` makes the buffers (paged memory can be plugged in).
    """

    def __init__(
        self,
        specs: Sequence[StateSpec],
        layouts: Sequence[SlotLayout],
        shapes: Sequence[torch.Size],
        device: torch.device,
        allocate: Callable = zeroed_buffer,
    ) -> None:
        self.specs, self.layouts, self.device = tuple(specs), tuple(layouts), device
        self.members: list[Member] = []
        offset = 0
        for shape in shapes:
            numel = torch.Size(shape).numel()
            self.members.append(Member(offset, numel))
            offset += padded(numel)
        self.total = offset
        self.plans: dict[tuple[int, ...], list] = {}  # multi_tensor's chunk plans, by run of member indices
        self._chunks: dict[tuple[int, int], list[torch.Tensor]] = {}  # views of the buffers, made once
        self.buffers: list[list[torch.Tensor]] = [  # per slot: the format's buffers, (rows, ...) each
            layout.format.flat_buffers(spec.rows, self.total, layout.signed, device, allocate)
            for spec, layout in zip(self.specs, self.layouts)
        ]

    def _views(self, slot: int, index: int) -> list[torch.Tensor]:
        member = self.members[index]
        return self.layouts[slot].format.flat_views(self.buffers[slot], member.offset, member.numel)

    def bind(self, index: int, param: torch.Tensor, state: dict) -> None:
        """Point ``state``'s slots at member ``index``'s views (``param`` gives the shape)."""
        for slot, (spec, layout) in enumerate(zip(self.specs, self.layouts)):
            layout.format.bind(state, spec, self._views(slot, index), slot_shape(spec, param))

    def holds(self, index: int, state: dict) -> bool:
        """Whether ``state``'s slots are still member ``index``'s views (a loaded state dict replaces them)."""
        member = self.members[index]
        for slot, (spec, layout) in enumerate(zip(self.specs, self.layouts)):
            tensor = state.get(spec.key)
            main = self.buffers[slot][0]
            if tensor is None or tensor.dtype != main.dtype:
                return False
            if member.numel and tensor.data_ptr() != main.data_ptr() + layout.format.main_offset_bytes(member.offset):
                return False
        return True

    def load(self, index: int, state: dict) -> None:
        """Copy ``state``'s slot tensors (of this layout) into member ``index``'s place, then bind them."""
        for slot, (spec, layout) in enumerate(zip(self.specs, self.layouts)):
            layout.format.load_views(self._views(slot, index), state, spec)

    def chunk(self, start: int, stop: int) -> list[torch.Tensor]:
        """The raw slot tensors of flat elements ``[start, stop)`` (whole blocks), in the order and the block
        form ``(rows, blocks, 256)`` that ``elementwise.update`` takes; on the CPU as aliases that are not views
        (``cpu_kernel.canonical``: what the compiled kernels take), made once."""
        cached = self._chunks.get((start, stop))
        if cached is None:
            alias = canonical if self.device.type == "cpu" else (lambda tensor: tensor)
            cached = self._chunks[start, stop] = [
                alias(tensor)
                for slot, layout in enumerate(self.layouts)
                for tensor in layout.format.kernel_chunk(self.buffers[slot], start, stop, layout.signed, self.device)
            ]
        return cached


class FlatStates:
    """Which parameters' state lives in which :class:`FlatState` of an optimizer.

    State is created (or, after ``load_state_dict`` replaced it, copied) into flat buffers one batch at a time:
    the parameters of a param group that get their state in the same step, split by device, parameter dtype and
    slot layouts. A parameter whose state no longer points into its buffers (a loaded state dict) is found by
    :meth:`locate` and moved in again by :meth:`adopt`.
    """

    def __init__(self) -> None:
        self._where: dict[torch.Tensor, tuple[FlatState, int]] = {}

    def create(self, specs: Sequence[StateSpec], entries: Sequence[tuple], allocate: Callable) -> None:
        """Zeroed state for ``entries`` = ``[(param, local tensor, state dict, slot layouts)]``."""
        self._place(specs, entries, allocate, copy=False)

    def adopt(self, specs: Sequence[StateSpec], entries: Sequence[tuple], allocate: Callable) -> None:
        """Move the existing state of ``entries`` (same form as :meth:`create`) into new flat buffers."""
        self._place(specs, entries, allocate, copy=True)

    @torch._disable_dynamo  # bookkeeping, not tensor math: outside an outer torch.compile's graph
    def _place(self, specs, entries, allocate, copy: bool) -> None:
        batches: dict[tuple, list] = {}
        for entry in entries:
            _, local, _, layouts = entry
            batches.setdefault((local.device, local.dtype, tuple(layouts)), []).append(entry)
        for (device, _, layouts), batch in batches.items():
            flat = FlatState(specs, layouts, [local.shape for _, local, _, _ in batch], device, allocate)
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
