"""Device-level GPU memory from NVML (nvidia-ml-py): what ``nvidia-smi`` shows.

NVML counts everything resident on the device, CUDA managed (paged) memory and the CUDA context included, which
torch's allocator counters never see; the two together show what paging moved where.
"""

from __future__ import annotations

import os

NVML_FIELDS = (
    "nvml_used_bytes",  # whole device, every process
    "nvml_total_bytes",
    "nvml_used_pct",
    "nvml_process_bytes",  # this process, when the driver reports it (not inside some containers)
)


def null_nvml_fields() -> dict:
    """Every NVML field as ``None``: what a run without NVML records."""
    return dict.fromkeys(NVML_FIELDS)


class NvmlMemory:
    """Reads one GPU's memory through NVML. When NVML cannot be used, :attr:`error` says why and fields are null.

    Args:
        index: the CUDA device index (used when no UUID is given). Default 0.
        uuid: the device's UUID as torch reports it (``torch.cuda.get_device_properties(i).uuid``); NVML numbers
            devices differently from CUDA under ``CUDA_VISIBLE_DEVICES``, the UUID names the same device in both.
        nvml: the ``pynvml`` module; default: imported from nvidia-ml-py. Injected by tests.
    """

    def __init__(self, index: int = 0, uuid: str | None = None, nvml=None):
        self.error: str | None = None
        self.handle = None
        self._nvml = nvml
        try:
            if self._nvml is None:
                import pynvml

                self._nvml = pynvml
            self._nvml.nvmlInit()
        except Exception as exc:  # ImportError, NVMLError (no driver), ...: NVML is optional
            self.error = f"NVML unavailable: {type(exc).__name__}: {exc}"
            return
        try:
            if uuid:
                name = uuid if str(uuid).startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
                self.handle = self._nvml.nvmlDeviceGetHandleByUUID(name)
            else:
                self.handle = self._nvml.nvmlDeviceGetHandleByIndex(index)
        except Exception as exc:
            self.error = f"NVML has no device {uuid or index}: {type(exc).__name__}: {exc}"

    def sample(self) -> dict:
        """The NVML fields now (all ``None`` when NVML is unavailable)."""
        if self.handle is None:
            return null_nvml_fields()
        info = self._nvml.nvmlDeviceGetMemoryInfo(self.handle)
        return {
            "nvml_used_bytes": int(info.used),
            "nvml_total_bytes": int(info.total),
            "nvml_used_pct": round(100.0 * info.used / info.total, 2) if info.total else None,
            "nvml_process_bytes": self._process_bytes(),
        }

    def _process_bytes(self) -> int | None:
        try:
            processes = self._nvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
        except Exception:
            return None
        for process in processes:
            if process.pid == os.getpid() and process.usedGpuMemory is not None:
                return int(process.usedGpuMemory)
        return None  # PID namespaces (containers) hide our PID from the driver

    def driver_version(self) -> str | None:
        if self.handle is None:
            return None
        version = self._nvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
