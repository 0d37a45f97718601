"""Versions and hardware, recorded in summary.json so a run can be reproduced and compared fairly."""

from __future__ import annotations

import os
import platform

import psutil
import torch

from hf_optim.doctor import machine


def versions() -> dict[str, str | None]:
    """Python's, hf_optim's and the training stack's versions (``None``: not installed), as ``hf-optim doctor``
    reports them (torch's names its build: ``torch.__version__``). The CUDA runtime and driver are in
    :func:`hardware`."""
    return machine.package_versions()


def hardware(device: torch.device | None = None, driver_version: str | None = None) -> dict:
    """The host and, for a CUDA device, the GPU the run trained on."""
    info = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "host_memory_bytes": int(psutil.virtual_memory().total),
        "device": str(device) if device is not None else None,
        "gpu": None,
    }
    if device is not None and device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        info["gpu"] = {
            "name": props.name,
            "capacity_bytes": int(props.total_memory),
            "compute_capability": f"{props.major}.{props.minor}",
            "count": torch.cuda.device_count(),
            "cuda": torch.version.cuda,
            "driver": driver_version,
        }
    return info
