"""Where optimizer state buffers live, including the Paged* optimizers' CUDA managed memory.

bitsandbytes' semantics, with its resume and CPU problems fixed:

* On CUDA a paged optimizer keeps every state buffer of at least ``PAGED_MIN_NUMEL`` elements (``state1``,
  ``state2``: the 8-bit codes or the fp32 moments) in managed memory (``cudaMallocManaged``, attached to the
  host), wrapped as an ordinary CUDA tensor, so every kernel runs on it unchanged. New buffers are prefetched to
  the GPU when they are made. When everything fits the pages stay on the GPU; under memory pressure the driver
  evicts them to host RAM. Absmax and maps are small and stay ordinary device memory.
* A step prefetches only at the end of a memory shortage (:func:`short_of_memory`, from one ``cudaMemGetInfo``
  per device and step): the first step whose device has room again after a step that found it short enqueues the
  migration of every managed buffer to the GPU on the *current* stream before its update (``cudaMemPrefetchAsync``:
  stream-ordered, no device synchronize), bringing evicted pages back in bulk. Other steps do not prefetch
  (measured on an H200 with a Llama-3.2-1B's 2.3 GiB of 8-bit state, about 0.9 GiB of it evicted under pressure):
  with room to spare the pages are resident, and a prefetch costs about 40 us of host time per buffer even then
  (226 of them made the step 1.86x slower than unpaged; skipped, 1.00x); while the device is short, prefetching
  every buffer before the group's one fused launch evicts the buffers prefetched first, and the kernel's page
  faults alone were faster (about 330 against 470 ms a step); once memory is back, the bulk prefetch took 42 ms
  against 110 ms of faults.
  bitsandbytes prefetches every paged tensor before every parameter's update and synchronizes after it.
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

SHORT_BELOW_FREE_BYTES = 1 << 30
"""A device with less free memory than this, or than the paged state if that is smaller, is short of memory: its
managed pages may have been evicted (see :func:`short_of_memory`)."""

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


def short_of_memory(free_bytes: int, paged_bytes: int) -> bool:
    """Whether a device with ``free_bytes`` free (``cudaMemGetInfo``) may have evicted some of ``paged_bytes`` of
    managed state: its free memory is below :data:`SHORT_BELOW_FREE_BYTES` or below the paged state, whichever is
    smaller. The driver evicts managed pages only when an allocation finds the device full, and torch's caching
    allocator keeps what it took, so the free memory stays low for as long as pages may be away.

    Args:
        free_bytes: free memory of the device, in bytes.
        paged_bytes: bytes of managed state alive (0: nothing can be evicted).
    """
    return paged_bytes > 0 and free_bytes < min(paged_bytes, SHORT_BELOW_FREE_BYTES)


def free_device_bytes(device: torch.device) -> int | None:
    """Free memory of CUDA ``device`` in bytes (``cudaMemGetInfo``: no synchronization), None for other devices."""
    if device.type != "cuda":
        return None
    return torch.cuda.mem_get_info(device)[0]


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
        self._prefetching: dict[torch.device, bool] = {}
        self._short: dict[torch.device, bool] = {}

    def _use_managed(self, numel: int, device: torch.device) -> bool:
        if not self.paged:
            return False
        reason = paging_unavailable_reason(device)
        if reason is not None:
            _warn_unpaged(self.owner, device, reason)
            return False
        return numel >= PAGED_MIN_NUMEL

    def __call__(self, shape, *, dtype: torch.dtype, device: torch.device | str, elements: int) -> torch.Tensor:
        """A zeroed buffer of ``shape`` and ``dtype`` for state on ``device``, serving ``elements`` parameter
        elements. Paging is decided on ``elements``, not on the buffer's size, as bitsandbytes decides on the
        parameter: AdEMAMix's two-row state of a 76,800-element tensor (153,600 values) stays ordinary memory."""
        device = torch.device(device)
        shape = tuple(shape)
        if self._use_managed(elements, device):
            self._made_managed = True
            return managed.managed_zeros(managed.runtime(), shape, dtype, device)
        return torch.zeros(shape, dtype=dtype, device=device)

    def copy_of(self, value: torch.Tensor, device: torch.device | str, elements: int) -> torch.Tensor:
        """A copy of ``value`` on ``device`` in this allocator's memory (``load_state_dict`` of a state buffer
        serving ``elements`` parameter elements: see :meth:`__call__`)."""
        device = torch.device(device)
        if not self._use_managed(elements, device):
            return value.to(device, copy=True)
        target = self(value.shape, dtype=value.dtype, device=device, elements=elements)
        target.copy_(value)
        return target

    def begin_step(self) -> None:
        """Start a step: whether to prefetch is decided again, once per device (:meth:`prefetch`)."""
        self._prefetching.clear()

    def prefetch(self, state: Mapping, device: torch.device) -> None:
        """Enqueue the migration of ``state``'s managed buffers to GPU ``device`` on the current stream (no sync)
        when this is the first step since ``device`` was short of memory (:func:`short_of_memory`, asked once per
        device and step; see the module for why only then)."""
        if not self._made_managed:
            return
        wanted = self._prefetching.get(device)
        if wanted is None:
            free = free_device_bytes(device)
            short = free is not None and short_of_memory(free, managed_bytes())
            wanted = self._prefetching[device] = self._short.get(device, False) and not short
            self._short[device] = short
        if not wanted:
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
