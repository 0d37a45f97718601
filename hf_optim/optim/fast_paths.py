"""Which tensors leave the fast paths (Triton, multi-tensor) because of their state format, and the pieces in which
state moves into flat buffers.

Most optimizers run only formats that every path supports, and pay nothing per tensor here. Formats that are
whole-tensor (no flat-buffer form, so not the multi-tensor path) or have no Triton branch are "restricted": a tensor
with such a slot steps on the PyTorch path tensor by tensor (a chunkable format without Triton keeps the
multi-tensor path where Triton does not run).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable

import torch

from hf_optim.formats import FORMATS, StateFormat
from hf_optim.kernels.torch_path import multi_tensor

logger = logging.getLogger("hf_optim")
_told_no_triton: set[tuple[str, str]] = set()
"""(format name, device type) pairs already logged as stepping on the PyTorch path instead of Triton."""

ADOPT_BYTES = 256 << 20
"""Most bytes of state moved into flat buffers at once: until a parameter's old state is released, it exists twice,
so adopting a whole model's state in one piece would briefly double it (on a GPU, that can fail for lack of memory
at the very step that falls back from a failed Triton kernel)."""


class FastPaths:
    """Asks, per state, whether a restricted format keeps it off the fast paths (see the module).

    Args:
        formats: ``formats()`` -> the formats the optimizer runs with (asked again when a format is registered).
        slots: the rule's state slots.
    """

    def __init__(self, formats: Callable[[], tuple[StateFormat, ...]], slots: tuple) -> None:
        self._formats = formats
        self._slots = slots
        self._restricted: tuple[int, tuple[StateFormat, ...]] | None = None
        self._seen: dict[int, tuple] = {}  # id(first state tensor): (weak ref, format or None)

    def restricted(self) -> tuple[StateFormat, ...]:
        if self._restricted is None or self._restricted[0] != len(FORMATS):
            formats = tuple(fmt for fmt in self._formats() if fmt.whole_tensor or not fmt.triton)
            self._restricted = (len(FORMATS), formats)
            self._seen.clear()
        return self._restricted[1]

    def forget(self) -> None:
        """State tensors were replaced: ask again."""
        self._seen.clear()

    def off(self, state: dict, restricted: tuple[StateFormat, ...], on_triton: bool, device: torch.device) -> bool:
        """Whether ``state`` holds a slot in a restricted format that keeps it off the fast paths here: a
        whole-tensor format always, one without a Triton branch where Triton runs the rest (said once per format
        and device type). These formats recognise only their own slots (rank1_4bit: by its column scales), so
        asking them is enough. The answer is remembered per first state tensor (weakly), so a step does not ask
        every format about every tensor again. ``restricted``: :meth:`restricted`, asked once per group."""
        first = state.get(self._slots[0].key)
        seen = self._seen.get(id(first))
        if seen is not None and seen[0]() is first:
            fmt = seen[1]
        else:
            fmt = next((fmt for fmt in restricted if any(fmt.recognises(state, spec) for spec in self._slots)), None)
            if isinstance(first, torch.Tensor):
                self._seen[id(first)] = (weakref.ref(first), fmt)
        if fmt is None:
            return False
        off_triton = not fmt.triton and on_triton
        if off_triton and (fmt.name, device.type) not in _told_no_triton:
            _told_no_triton.add((fmt.name, device.type))
            logger.warning("state_format %r has no Triton kernels: its tensors step on the PyTorch path, one by "
                           "one, on %s (the other tensors stay on Triton)", fmt.name, device.type)
        return fmt.whole_tensor or off_triton


def adoption_pieces(entries: list) -> list[list]:
    """``entries`` (``FlatStates.adopt``'s) in consecutive pieces of at most :data:`ADOPT_BYTES` of state each (a
    larger parameter's state is a piece by itself)."""
    return multi_tensor.consecutive_pieces(
        entries, lambda entry: sum(t.nbytes for t in entry[2].values() if isinstance(t, torch.Tensor)), ADOPT_BYTES)
