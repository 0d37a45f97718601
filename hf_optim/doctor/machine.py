"""What the doctor reports about this machine: versions, devices and the backend each gets, paging, caches."""

from __future__ import annotations

import platform
import subprocess
from importlib import metadata

import torch

from hf_optim.kernels import backend as kernel_backend
from hf_optim.kernels.triton_path import guard as triton_guard
from hf_optim.paging import managed, paging_unavailable_reason

PACKAGES = ("torch", "triton", "transformers", "trl", "peft", "bitsandbytes", "accelerate")
MANAGED_PROBE_BYTES = 1 << 20
"""The managed buffer the paging check allocates: 1 MiB, and only when four times that is free on the card."""


def package_versions() -> dict[str, str | None]:
    """Python, hf_optim, and the packages hf_optim works with (None: not installed). torch's is what the running torch
    says (``torch.__version__``: it names the build, e.g. ``2.14.1+cu130`` or ``2.13.0+cpu``, which the installed
    package's metadata does not); hf_optim's is the imported one, which may differ from an installed copy."""
    import hf_optim

    found: dict[str, str | None] = {"python": platform.python_version(), "hf_optim": hf_optim.__version__}
    for package in PACKAGES:
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = None
    found["torch"] = str(torch.__version__)
    return found


def versions() -> dict[str, str | None]:
    """:func:`package_versions`, the CUDA runtime and the driver."""
    found = package_versions()
    found["cuda_runtime"] = torch.version.cuda or (f"ROCm {torch.version.hip}" if torch.version.hip else None)
    found["cuda_driver"] = driver_version() if torch.cuda.is_available() else None
    return found


def driver_version() -> str | None:
    """The NVIDIA driver's version: through NVML (nvidia-ml-py), else from ``nvidia-smi``; None when neither answers."""
    try:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # noqa: BLE001 - no NVML (not installed, ROCm, a container without it): ask nvidia-smi
        pass
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = done.stdout.strip().splitlines()
    return lines[0].strip() if done.returncode == 0 and lines else None


def devices() -> list[torch.device]:
    """The CPU and every visible CUDA device."""
    found = [torch.device("cpu")]
    if torch.cuda.is_available():
        found += [torch.device("cuda", index) for index in range(torch.cuda.device_count())]
    return found


def describe_device(device: torch.device, interpret: bool = False) -> dict:
    """Name, arch, the backend the device gets, its PyTorch path, and whether paged optimizers page there."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name, memory = props.name, int(props.total_memory)
        arch = triton_guard.device_arch(device)
    else:
        name, memory = cpu_name(), None
        arch = platform.machine()
    if interpret and device.type == "cpu":
        chosen = "triton (interpreter)"
    else:
        try:
            chosen = kernel_backend.backend_name(device)
        except (RuntimeError, ValueError) as error:  # HF_OPTIM_BACKEND asks for what cannot run here
            chosen = f"error: {error}"
    return {
        "device": str(device),
        "name": name,
        "arch": arch,
        "memory_bytes": memory,
        "backend": chosen,
        "pytorch_path": kernel_backend.torch_backend_name(device),
        "paging": check_paging(device),
    }


def cpu_name() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def check_paging(device: torch.device) -> str:
    """``works`` after allocating, prefetching, writing and reading back a 1 MiB managed buffer on ``device``; else
    why paged optimizers keep their state in ordinary memory there."""
    reason = paging_unavailable_reason(device)
    if reason is not None:
        return f"unavailable: {reason}"
    free, _ = torch.cuda.mem_get_info(device)
    if free < 4 * MANAGED_PROBE_BYTES:
        return f"not checked: only {free} bytes free on {device}"
    try:
        buffer = managed.managed_zeros(managed.runtime(), (MANAGED_PROBE_BYTES // 4,), torch.float32, device)
        buffer += 1.5
        managed.prefetch(managed.runtime(), buffer)
        total = float(buffer.sum())
        del buffer
    except Exception as error:  # noqa: BLE001 - whatever the runtime says is the answer
        return f"FAILED: {triton_guard.first_line(error)}"
    expected = 1.5 * (MANAGED_PROBE_BYTES // 4)
    if total != expected:
        return f"FAILED: a managed buffer read back {total}, expected {expected}"
    return "works (1 MiB managed buffer allocated, prefetched, written, read back)"


def caches() -> dict[str, str]:
    """Where inductor and Triton keep compiled kernels (later processes load them instead of compiling)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        inductor = cache_dir()
    except Exception as error:  # noqa: BLE001 - a torch without this module
        inductor = f"unknown ({triton_guard.first_line(error)})"
    return {"inductor": inductor, "triton": triton_guard.cache_dir()}
