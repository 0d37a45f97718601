"""The state store of an :class:`~hf_optim.optim.base.HfOptimizer`: where each parameter's state is allocated.

It owns the allocator (plain or paged memory), the flat buffers of the multi-tensor path (one set per rule of a
hybrid optimizer), the choice of each tensor's state format, lazy creation of a step's new state, and telling the
runners when state tensors were replaced (their cached Triton tables name the old addresses).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hf_optim.core.state_store import StateSpec
from hf_optim.formats import FP32, SlotLayout, StateFormat, settings_format, with_overrides
from hf_optim.kernels.torch_path.flat_state import FlatStates
from hf_optim.optim import shard_layout, sharded_blocks
from hf_optim.optim.sharding import local_tensor
from hf_optim.paging import paging_unavailable_reason, state_allocator


class StateStore:
    """Allocation, flat buffers and lazy creation of one optimizer's state (see the module)."""

    def __init__(self, owner: str, is_paged: bool) -> None:
        self.is_paged = is_paged
        self.allocate = state_allocator(is_paged, owner)
        self.flats: dict[str, FlatStates] = {}
        self._replaced: list[Callable[[], None]] = []
        self.pending = sharded_blocks.PendingScales()
        """Split runs of sharded parameters waiting for the whole tensor's scales, reduced at the end of a step."""

    def flat(self, label: str) -> FlatStates:
        """The flat buffers of the rule ``label`` (``""``: a single-rule optimizer's)."""
        found = self.flats.get(label)
        if found is None:
            found = self.flats[label] = FlatStates()
        return found

    def locate(self, full: torch.Tensor, state: dict):
        """``(flat buffer, member index)`` holding ``state``, in any rule's buffers, or None."""
        for flat in self.flats.values():
            place = flat.locate(full, state)
            if place is not None:
                return place
        return None

    def clear(self) -> None:
        """Forget every flat buffer (the state they held was replaced)."""
        for flat in self.flats.values():
            flat.clear()

    def on_replaced(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` whenever state tensors are replaced."""
        self._replaced.append(listener)

    def replaced(self) -> None:
        """State tensors were replaced (a loaded state dict, state moved into flat buffers)."""
        for listener in self._replaced:
            listener()

    @staticmethod
    def format_of(param: torch.Tensor, group: dict) -> StateFormat:
        """The format of ``param``'s state: the group's (``state_format``, or ``optim_bits`` where an override set
        it) when it is not quantized or the WHOLE parameter (a DTensor's global numel) has ``min_8bit_size``
        elements, fp32 otherwise, so the precision of a parameter's state never depends on how many ranks share
        it."""
        fmt = settings_format(group)
        if fmt.quantized and param.numel() < group["min_8bit_size"]:
            return FP32
        return fmt

    def init_slots(self, full: torch.Tensor, group: dict, state: dict, slots: tuple[StateSpec, ...]) -> None:
        """Create the ``slots`` of parameter ``full`` (a DTensor or a tensor) on its local tensor, per tensor."""
        state["step"] = 0
        fmt = self.format_of(full, group)
        for spec in slots:
            self.init_slot(state, spec, full, fmt)

    def init_slot(self, state: dict, spec: StateSpec, full: torch.Tensor, fmt: StateFormat) -> None:
        """Create slot ``spec`` of parameter ``full`` in format ``fmt``: on its local tensor, or, for a sharded
        parameter's quantized slot, on the whole runs of its scales the local part touches
        (:mod:`hf_optim.optim.sharded_blocks`)."""
        local = local_tensor(full)
        part = shard_layout.part_of(full) if local is not full else None
        if isinstance(part, shard_layout.Part):
            local = sharded_blocks.stand_in(part, fmt, spec, local)
        elif part is not None and fmt.quantized:
            shard_layout.note_per_shard(full, part)
        fmt.init_slot(state, spec, local, self.allocate)

    def create(self, runner, group: dict, fresh: list, states: dict) -> None:
        """Create the state of ``fresh`` = ``[(param, local param, per-parameter overrides)]`` for ``runner``'s
        rule: in its flat buffers where the multi-tensor path runs them, per tensor otherwise."""
        flat_entries = []
        for p, param, overrides in fresh:
            settings = with_overrides(group, overrides) if overrides else group
            state = states[p]
            fmt = self.format_of(p, settings)
            if fmt.whole_tensor or not runner.on_multi_tensor_path(p, param):
                runner.init_state(p, settings, state)
                continue
            state["step"] = 0
            flat_entries.append((p, param, state, [SlotLayout(fmt, spec.signed) for spec in runner.slots]))
        if flat_entries:
            self.flat(runner.label).create(runner.slots, flat_entries, self.allocate)

    def page_again(self, states: dict, slots: tuple[StateSpec, ...]) -> None:
        """Move unpickled state to its parameter's device, slot buffers through the allocator (managed memory where
        paging is available), exactly as a loaded state dict is placed."""
        keys = {spec.key for spec in slots}
        for p, param_state in states.items():
            if not isinstance(p, torch.Tensor) or not isinstance(param_state, dict):
                continue
            device = local_tensor(p).device
            pageable = paging_unavailable_reason(device) is None
            for key, value in param_state.items():
                if isinstance(value, torch.Tensor):
                    paged = key in keys and pageable
                    elements = local_tensor(p).numel()
                    param_state[key] = self.allocate.copy_of(value, device, elements) if paged else value.to(device)
