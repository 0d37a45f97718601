"""Where optimizer state buffers live, including the Paged* optimizers' CUDA managed memory.

bitsandbytes' semantics, with its resume and CPU problems fixed:

* On CUDA a paged optimizer keeps every state buffer of at least ``PAGED_MIN_NUMEL`` elements (``state1``,
  ``state2``: the 8-bit codes or the fp32 moments) in managed memory (``cudaMallocManaged``, attached to the
  host), wrapped as an ordinary CUDA tensor, so every kernel runs on it unchanged. Before a parameter's update its
  buffers are prefetched to the GPU on the *current* stream (``cudaMemPrefetchAsync``): stream-ordered, no device
  synchronize. When everything fits the pages stay on the GPU; under memory pressure the driver evicts them to
  host RAM and the next prefetch brings them back. Absmax and maps are small and stay ordinary device memory.
* Torch's allocator counters (``torch.cuda.memory_allocated`` / ``max_memory_allocated``) do not see managed
  memory; :func:`is_paged_tensor` and ``hf_optim.state_memory(...).paged_bytes`` do (a registry of live buffers).
* ``state_dict()`` of a paged optimizer holds CPU tensors (copies of the managed state; on CPU, the tensors
  themselves, as torch does), in bitsandbytes' format. A checkpoint of paged state therefore never asks for GPU
  memory when it is loaded, and ``torch.load(..., weights_only=True)`` reads it anywhere. bitsandbytes returns its
  paged tensors as they are instead.
* ``load_state_dict()`` allocates the state buffers through the optimizer's own allocator and copies into them, so a
  resumed run keeps its memory profile (bitsandbytes moves loaded state to plain device memory).
* Where paging is impossible (CPU, a ROCm build, a GPU or OS without concurrent managed access, no CUDA runtime
  library found) a paged optimizer runs exactly as its unpaged twin and says so with one warning per class and
  device type.

The CUDA runtime is reached with ctypes on the libcudart torch already loaded: see :mod:`hf_optim.paging.cudart`
for why, and for the CUDA 13 prototype change it handles.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Mapping

import torch

from hf_optim.paging import managed

PAGED_MIN_NUMEL = 100_000
"""bitsandbytes pages only state tensors with at least this many elements; so does hf_optim."""

_warned: set[tuple[str, str]] = set()
"""(optimizer class, device type) pairs already warned about, so each warns once per process."""


def is_paged_tensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lives in CUDA managed (paged) memory: hf_optim's, or bitsandbytes' (``is_paged``)."""
    if getattr(tensor, "is_paged", False) is True:  # bitsandbytes marks its paged tensors this way
        return True
    return bool(managed._live) and managed.is_managed(tensor)


def serving_device(tensor: torch.Tensor) -> str:
    """The device a state tensor serves: its own, except bitsandbytes' paged tensors (CPU tensors over managed
    memory that record their GPU in ``page_deviceid``)."""
    if getattr(tensor, "is_paged", False) is True and getattr(tensor, "page_deviceid", None) is not None:
        return f"cuda:{tensor.page_deviceid}"
    return str(tensor.device)


def managed_bytes() -> int:
    """Bytes of hf_optim managed memory alive in this process, across all optimizers."""
    return sum(managed.live_buffers().values())


def paging_unavailable_reason(device: torch.device | str) -> str | None:
    """Why a paged optimizer cannot page state on ``device``, or None when it can."""
    device = torch.device(device)
    return managed.unavailable_reason(device.type, device.index)


def _caller_stacklevel() -> int:
    """``stacklevel`` that points a warning at the first frame outside hf_optim and torch (the user's call)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in ("hf_optim", "torch"):
        frame, level = frame.f_back, level + 1
    return level


def _warn_unpaged(owner: str, device: torch.device, reason: str) -> None:
    key = (owner, device.type)
    if key in _warned:
        return
    _warned.add(key)
    twin = owner.removeprefix("Paged") if owner.startswith("Paged") else f"{owner}(is_paged=False)"
    warnings.warn(
        f"hf_optim: paged optimizers page CUDA state to host memory, but {owner} has state on {device} ({reason}); "
        f"its state is kept in ordinary {device.type} memory and it runs exactly as {twin}.",
        UserWarning,
        stacklevel=_caller_stacklevel(),
    )


class StateAllocator:
    """Allocates an optimizer's big state buffers: managed memory for a paged optimizer on CUDA, else ordinary.

    Args:
        paged: whether the optimizer is paged (``is_paged``); False makes plain ``torch.zeros`` buffers.
        owner: the optimizer's class name, used in the fallback warning (default ``"optimizer"``).
    """

    def __init__(self, paged: bool, owner: str = "optimizer") -> None:
        self.paged = bool(paged)
        self.owner = owner
        self._made_managed = False

    def _use_managed(self, numel: int, device: torch.device) -> bool:
        if not self.paged:
            return False
        reason = paging_unavailable_reason(device)
        if reason is not None:
            _warn_unpaged(self.owner, device, reason)
            return False
        return numel >= PAGED_MIN_NUMEL

    def __call__(self, shape, *, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """A zeroed buffer of ``shape`` and ``dtype`` for state on ``device``."""
        device = torch.device(device)
        shape = tuple(shape)
        numel = 1
        for size in shape:
            numel *= size
        if self._use_managed(numel, device):
            self._made_managed = True
            return managed.managed_zeros(managed.runtime(), shape, dtype, device)
        return torch.zeros(shape, dtype=dtype, device=device)

    def copy_of(self, value: torch.Tensor, device: torch.device | str) -> torch.Tensor:
        """A copy of ``value`` on ``device`` in this allocator's memory (``load_state_dict`` of a state buffer)."""
        device = torch.device(device)
        if not self._use_managed(value.numel(), device):
            return value.to(device, copy=True)
        target = self(value.shape, dtype=value.dtype, device=device)
        target.copy_(value)
        return target

    def prefetch(self, state: Mapping) -> None:
        """Enqueue the migration of ``state``'s managed buffers to their GPU on the current stream (no sync)."""
        if not self._made_managed:
            return
        runtime = managed.runtime()
        for value in state.values():
            if isinstance(value, torch.Tensor):
                managed.prefetch(runtime, value)  # a no-op for tensors that are not managed buffers


def state_allocator(is_paged: bool, owner: str = "optimizer") -> StateAllocator:
    """The :class:`StateAllocator` of a (possibly paged) optimizer named ``owner``."""
    return StateAllocator(is_paged, owner)


def on_host(state: Mapping) -> dict:
    """``state`` (a state dict's per-parameter mapping, nested dicts included) with every tensor on the CPU."""
    return {
        key: on_host(value) if isinstance(value, Mapping) else value.cpu() if isinstance(value, torch.Tensor) else value
        for key, value in state.items()
    }
