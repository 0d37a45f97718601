"""Where optimizer state buffers are allocated, including the Paged* optimizers' buffers.

bitsandbytes semantics: a paged optimizer keeps state tensors of at least ``PAGED_MIN_NUMEL`` elements in CUDA
unified memory. Managed-memory allocation is not implemented yet in hf_optim (tracked as its own issue): until
it is, a Paged* optimizer allocates ordinary memory and says so with one warning, on CPU and on CUDA alike.
The math is identical either way; only where the bytes live differs.
"""

from __future__ import annotations

import warnings

import torch

PAGED_MIN_NUMEL = 100_000
"""bitsandbytes pages only state tensors with at least this many elements."""

_warned: set[str] = set()


def _warn_once(device_type: str) -> None:
    if device_type in _warned:
        return
    _warned.add(device_type)
    if device_type == "cpu":
        message = (
            "hf_optim: paged optimizers page CUDA state to host memory; on CPU the state is already in host "
            "memory, so this optimizer behaves exactly like its unpaged twin."
        )
    else:
        message = (
            f"hf_optim: paging state in CUDA managed memory is not implemented yet; this Paged* optimizer keeps "
            f"its state in ordinary {device_type} memory (same math, no host paging)."
        )
    warnings.warn(message, UserWarning, stacklevel=4)


def is_paged_tensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lives in CUDA managed (paged) memory. Nothing is paged until managed allocation lands."""
    return False


def state_allocator(is_paged: bool):
    """Return ``allocate(shape, dtype=, device=)`` for state buffers of a (possibly paged) optimizer."""

    def allocate(shape, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if is_paged:
            _warn_once(torch.device(device).type)
        return torch.zeros(shape, dtype=dtype, device=device)

    return allocate
