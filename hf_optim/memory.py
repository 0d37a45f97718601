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
        num_params: elements of the parameters the optimizer updates (a DTensor counts its local shard), so that
            the footprint reads as bytes per parameter, the unit memory-efficient optimizers are compared in.
    """

    total_bytes: int = 0
    by_dtype: dict[str, int] = field(default_factory=dict)
    by_device: dict[str, int] = field(default_factory=dict)
    paged_bytes: int = 0
    num_params: int = 0

    @property
    def bytes_per_param(self) -> float | None:
        """State bytes per updated parameter element (None for an optimizer without parameters)."""
        return self.total_bytes / self.num_params if self.num_params else None

    def as_dict(self) -> dict:
        return {
            "total_bytes": self.total_bytes,
            "by_dtype": dict(self.by_dtype),
            "by_device": dict(self.by_device),
            "paged_bytes": self.paged_bytes,
            "num_params": self.num_params,
            "bytes_per_param": self.bytes_per_param,
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
    num_params = sum(_local(p).numel() for group in optimizer.param_groups for p in group["params"])
    return StateMemory(sum(by_dtype.values()), dict(by_dtype), dict(by_device), paged, num_params)
