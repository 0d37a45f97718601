"""Which kernels run an optimizer step: the Triton kernels or the PyTorch path (eager or compiled).

Rule: tensors on a device Triton compiles for (CUDA, which includes ROCm builds of torch, and XPU) use the
Triton kernels when ``triton`` is importable; every other tensor uses the PyTorch path. The environment variable
``HF_OPTIM_BACKEND`` forces one: ``torch`` (never Triton) or ``triton`` (always; on CPU tensors this needs
``TRITON_INTERPRET=1`` set before triton is imported, which is how CI tests the kernels). Triton itself is only
imported when a Triton step actually runs.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Iterable

import torch

from hf_optim.kernels.torch_path import compile_guard, multi_tensor

ENV_VAR = "HF_OPTIM_BACKEND"
BACKENDS = ("torch", "triton")
"""Valid values of ``HF_OPTIM_BACKEND`` (unset: automatic)."""

TRITON_DEVICE_TYPES = ("cuda", "xpu")


def forced_backend() -> str | None:
    """The backend ``HF_OPTIM_BACKEND`` forces, or None when it is unset or empty (automatic choice)."""
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if not value:
        return None
    if value not in BACKENDS:
        raise ValueError(
            f"{ENV_VAR}={os.environ[ENV_VAR]!r} is not a valid backend; valid values are "
            f"{', '.join(repr(b) for b in BACKENDS)} (or leave it unset for the automatic choice)"
        )
    return value


@functools.cache
def triton_available() -> bool:
    """Whether the ``triton`` package is installed (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def interpreter_enabled() -> bool:
    """Whether Triton kernels run in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def uses_triton(device: torch.device) -> bool:
    """Whether tensors on ``device`` are updated by the Triton kernels (raises if ``triton`` is forced but
    cannot run there)."""
    forced = forced_backend()
    if forced == "torch":
        return False
    if forced == "triton":
        if not triton_available():
            raise RuntimeError(f"{ENV_VAR}=triton, but the triton package is not installed (pip install triton)")
        if device.type not in TRITON_DEVICE_TYPES and not interpreter_enabled():
            raise RuntimeError(
                f"{ENV_VAR}=triton with {device.type} tensors needs Triton's interpreter: set TRITON_INTERPRET=1 "
                "before triton is imported, or use HF_OPTIM_BACKEND=torch"
            )
        return True
    return device.type in TRITON_DEVICE_TYPES and triton_available()


def torch_backend_name(device: torch.device) -> str:
    """The PyTorch path's name on ``device``: ``torch-compile`` (CPU or CUDA, compiled by inductor) or ``torch``
    (eager: ``HF_OPTIM_COMPILE=0``, another device type, or compiling failed on this device)."""
    compiled = multi_tensor.compile_enabled() and compile_guard.compiles_on(torch.device(device))
    return "torch-compile" if compiled else "torch"


def backend_name(device: torch.device) -> str:
    """``triton``, ``torch-compile`` or ``torch``: what updates tensors on ``device``."""
    return "triton" if uses_triton(device) else torch_backend_name(device)


def describe(devices: Iterable[torch.device]) -> str:
    """One backend name, or ``name (device type), ...`` when the devices disagree. No devices: the CPU choice."""
    names = {}
    for device in devices:
        names.setdefault(device.type, backend_name(device))
    if not names:
        return backend_name(torch.device("cpu"))
    if len(set(names.values())) == 1:
        return next(iter(names.values()))
    return ", ".join(f"{name} ({kind})" for kind, name in sorted(names.items()))
