"""CUDA managed memory as torch tensors: allocation, lifetime, prefetch, and the registry of live buffers.

A buffer comes from ``cudaMallocManaged(..., cudaMemAttachHost)`` and becomes a CUDA tensor through
``__cuda_array_interface__`` (``torch.as_tensor`` wraps the pointer without copying and keeps the owning
:class:`ManagedBuffer` alive for as long as any tensor or view uses the storage). When the last one dies torch drops
its reference, the buffer calls ``cudaFree`` and leaves the registry. The registry (address -> bytes) is how
``is_paged_tensor`` and ``hf_optim.state_memory`` tell managed state from ordinary device memory, which torch's
allocator counters never see.
"""

from __future__ import annotations

import functools
import math
import sys

import torch

from hf_optim.paging import cudart

_live: dict[int, int] = {}
"""Base address -> size in bytes of every managed buffer alive in this process."""


def live_buffers() -> dict[int, int]:
    """A snapshot of the live managed buffers (address -> bytes)."""
    return dict(_live)


def is_managed(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s storage is one of hf_optim's live managed buffers (views included)."""
    return tensor.untyped_storage().data_ptr() in _live


class ManagedBuffer:
    """Owns one managed allocation of ``nbytes`` made on CUDA device ``device``; frees it when collected.

    Torch holds a reference to it from every tensor made with :func:`managed_zeros`, so it outlives them all.

    Args:
        runtime: the :class:`~hf_optim.paging.cudart.CudaRuntime` to allocate and free with.
        nbytes: size of the allocation.
        device: CUDA device ordinal current while allocating (what the pointer reports as its device).
    """

    def __init__(self, runtime: cudart.CudaRuntime, nbytes: int, device: int) -> None:
        self.runtime = runtime
        self.nbytes = nbytes
        with torch.cuda.device(device):
            self.ptr = runtime.malloc_managed(nbytes, cudart.MEM_ATTACH_HOST)
        _live[self.ptr] = nbytes

    @property
    def __cuda_array_interface__(self) -> dict:
        # Exposed as raw bytes: the caller reinterprets them as any dtype (typestr cannot express bfloat16).
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False), "version": 2}

    def __del__(self) -> None:
        ptr, self.ptr = getattr(self, "ptr", 0), 0
        if not ptr:
            return
        _live.pop(ptr, None)
        if sys.is_finalizing():  # the CUDA runtime may already be torn down; the process is ending anyway
            return
        try:
            self.runtime.free(ptr)
        except cudart.CudaRuntimeError:  # never raise from a finalizer; a failed free leaks, it cannot corrupt
            pass


def managed_zeros(
    runtime: cudart.CudaRuntime, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A zeroed tensor of ``shape`` and ``dtype`` in managed memory, serving CUDA ``device``.

    The pages are prefetched to the device on the current stream and zeroed there, both stream-ordered: no sync.
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    numel = math.prod(shape)
    element_size = torch.empty((), dtype=dtype).element_size()
    buffer = ManagedBuffer(runtime, numel * element_size, index)
    raw = torch.as_tensor(buffer, device=torch.device("cuda", index))  # explicit: a default device must not copy
    if raw.data_ptr() != buffer.ptr or raw.device != torch.device("cuda", index):
        raise RuntimeError(
            f"wrapping managed memory gave a tensor at {raw.data_ptr():#x} on {raw.device}, expected "
            f"{buffer.ptr:#x} on cuda:{index}"
        )
    tensor = raw.view(dtype).view(shape)
    prefetch(runtime, tensor)
    tensor.zero_()
    return tensor


def prefetch(runtime: cudart.CudaRuntime, tensor: torch.Tensor) -> None:
    """Enqueue migration of ``tensor``'s whole managed buffer to its GPU on that device's current stream.

    Asynchronous and stream-ordered: kernels queued after it on the stream find the pages resident, and nothing
    waits for the device. Tensors that are not managed buffers are left alone."""
    ptr = tensor.untyped_storage().data_ptr()
    nbytes = _live.get(ptr)
    if nbytes is None:
        return
    runtime.prefetch(ptr, nbytes, tensor.device.index, torch.cuda.current_stream(tensor.device).cuda_stream)


@functools.cache
def runtime() -> cudart.CudaRuntime:
    """The process's CUDA runtime binding (loaded once)."""
    return cudart.load_cudart()


@functools.cache
def unavailable_reason(device_type: str, index: int | None) -> str | None:
    """Why state on this device cannot be paged, or None when it can."""
    if device_type != "cuda":
        return f"paging uses CUDA managed memory and {device_type} has none"
    if getattr(torch.version, "hip", None):
        return f"this is a ROCm build of torch ({torch.version.hip}); hf_optim pages through the CUDA runtime only"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    try:
        import numpy  # noqa: F401  (torch parses __cuda_array_interface__ type strings with numpy)
    except ImportError:
        return "numpy is not installed (torch needs it to wrap managed memory as a tensor)"
    try:
        rt = runtime()
        ordinal = index if index is not None else torch.cuda.current_device()
        if not rt.device_attribute(cudart.DEV_ATTR_MANAGED_MEMORY, ordinal):
            return f"cuda:{ordinal} does not support managed memory"
        if not rt.device_attribute(cudart.DEV_ATTR_CONCURRENT_MANAGED_ACCESS, ordinal):
            return (
                f"cuda:{ordinal} has no concurrent managed access (e.g. Windows, WSL or pre-Pascal), so managed "
                "memory cannot be prefetched or oversubscribed"
            )
    except cudart.CudaRuntimeError as error:
        return str(error)
    return None
