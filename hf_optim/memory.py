"""How much memory an optimizer's state takes: total, by dtype, by device, and how much of it is paged.

Used by the logging callback, ``hf-optim validate``'s estimates and the tests; works for any
``torch.optim.Optimizer`` (torch's own and bitsandbytes' included), not only hf_optim's.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from hf_optim.paging import is_paged_tensor, serving_device


@dataclass(frozen=True)
class StateMemory:
    """Optimizer-state footprint in bytes.

    Attributes:
        total_bytes: every tensor held in ``optimizer.state`` (a DTensor counts its local shard).
        by_dtype: bytes per dtype name (``"uint8"``, ``"float32"``, ...).
        by_device: bytes per device (``"cpu"``, ``"cuda:0"``, ...); paged state counts on the device it serves.
        paged_bytes: bytes that live in CUDA managed (paged) memory, which torch's allocator counters do not see.
    """

    total_bytes: int = 0
    by_dtype: dict[str, int] = field(default_factory=dict)
    by_device: dict[str, int] = field(default_factory=dict)
    paged_bytes: int = 0

    def as_dict(self) -> dict:
        return {
            "total_bytes": self.total_bytes,
            "by_dtype": dict(self.by_dtype),
            "by_device": dict(self.by_device),
            "paged_bytes": self.paged_bytes,
        }


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def state_memory(optimizer: torch.optim.Optimizer) -> StateMemory:
    """The optimizer-state footprint of ``optimizer`` (see :class:`StateMemory`).

    A tensor that appears in several places (views of one buffer) is counted once, as it occupies memory once.
    """
    by_dtype: Counter[str] = Counter()
    by_device: Counter[str] = Counter()
    paged = 0
    seen: set[tuple[str, int]] = set()
    for param_state in optimizer.state.values():
        for value in param_state.values():
            if not isinstance(value, torch.Tensor):
                continue
            tensor = _local(value)
            nbytes = tensor.numel() * tensor.element_size()
            if nbytes == 0:
                continue
            key = (str(tensor.device), tensor.data_ptr())
            if key in seen:
                continue
            seen.add(key)
            by_dtype[str(tensor.dtype).removeprefix("torch.")] += nbytes
            by_device[serving_device(tensor)] += nbytes
            if is_paged_tensor(tensor):
                paged += nbytes
    return StateMemory(sum(by_dtype.values()), dict(by_dtype), dict(by_device), paged)
