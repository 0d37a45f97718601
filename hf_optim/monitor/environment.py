"""Versions and hardware, recorded in summary.json so a run can be reproduced and compared fairly."""

from __future__ import annotations

import os
import platform
from importlib import metadata

import psutil
import torch

PACKAGES = ("torch", "transformers", "trl", "peft", "bitsandbytes", "accelerate", "hf_optim")


def versions() -> dict[str, str | None]:
    """Installed versions of the training stack (``None`` when a package is not installed) and Python's."""
    found: dict[str, str | None] = {"python": platform.python_version()}
    for package in PACKAGES:
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = None
    import hf_optim

    found["hf_optim"] = hf_optim.__version__  # the imported one, which may differ from an installed copy
    return found


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
