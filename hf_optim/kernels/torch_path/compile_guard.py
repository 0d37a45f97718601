"""Where the multi-tensor PyTorch path is compiled by inductor, and its eager fallback when compiling fails there.

The multi-tensor path (:mod:`hf_optim.kernels.torch_path.multi_tensor`) compiles its update with ``torch.compile`` on
the devices in :data:`COMPILED_DEVICE_TYPES` (on the CPU through :mod:`hf_optim.kernels.torch_path.cpu_compile`, which
decides when and handles a failed compilation per kernel: that kernel runs eagerly after one warning; this module
records the failures of GPU compilations, and :func:`compiles_on` is what the backend's name reports).
Inductor needs a working toolchain there (a C++ compiler on the CPU; on a
GPU, Triton, which it generates kernels for): when a compile fails on a device, that device runs the same update
eagerly for the rest of the process (the same rule, the same bits: ``tests/kernels/test_multi_tensor.py``) after ONE
warning on the ``hf_optim`` logger (see :mod:`hf_optim.kernels.triton_path.guard` for why the logger). Only compile
failures
(dynamo's and inductor's exceptions, :data:`COMPILE_ERRORS`) fall back: they are raised before the compiled code
runs, so no state was written; any other error propagates.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("hf_optim")

COMPILED_DEVICE_TYPES = ("cpu", "cuda")
"""Device types whose multi-tensor updates are compiled (unless ``HF_OPTIM_COMPILE=0``)."""

_failed: dict[str, str] = {}  # device -> the compile error's first line


def compile_errors() -> tuple[type[BaseException], ...]:
    """The exceptions of a failed compile: dynamo's base class (inductor's ``InductorError`` and
    ``BackendCompilerFailed`` derive from it)."""
    from torch._dynamo.exc import TorchDynamoException

    return (TorchDynamoException,)


def compiles_on(device: torch.device) -> bool:
    """Whether updates on ``device`` are compiled: a compiled device type, and no compile failed there."""
    return device.type in COMPILED_DEVICE_TYPES and str(device) not in _failed


def compile_failed(device: torch.device, error: BaseException) -> None:
    """Record that compiling failed on ``device`` (updates there run eagerly from now on), with one warning."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    reason = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    if str(device) in _failed:
        return
    _failed[str(device)] = reason
    logger.warning("torch.compile failed to compile the optimizer update on %s (%s); it runs eagerly there from now "
                   "on (the same math, slower). HF_OPTIM_COMPILE=0 skips the attempt", device, reason)


def failures() -> dict[str, str]:
    """Devices where compiling failed in this process, with the error's first line."""
    return dict(_failed)


def reset() -> None:
    """Forget failures (tests)."""
    _failed.clear()
