"""One memory sample: CUDA allocator counters, NVML device usage and host RSS, as flat JSON-ready fields."""

from __future__ import annotations

import psutil
import torch

from hf_optim.monitor.cuda_memory import CudaMemory, null_cuda_fields
from hf_optim.monitor.nvml_memory import NvmlMemory, null_nvml_fields


def host_rss_bytes() -> int:
    """Resident set size of this process (psutil)."""
    return int(psutil.Process().memory_info().rss)


class MemorySampler:
    """Samples every memory source of one training process.

    Args:
        cuda: the CUDA counters of the training device, or ``None`` on CPU (CUDA fields are then null).
        nvml: NVML for the same device, or ``None`` (NVML fields are then null).
    """

    def __init__(self, cuda: CudaMemory | None = None, nvml: NvmlMemory | None = None):
        self.cuda = cuda
        self.nvml = nvml
        self.host_rss_peak = 0  # the largest sampled RSS (a sample, not the kernel's high-water mark)
        self.nvml_peak: int | None = None  # the largest sampled NVML device usage

    @classmethod
    def for_device(cls, device: torch.device | str, *, reset_peak_stats: bool = True) -> MemorySampler:
        """The sampler for a training device: CUDA and NVML on ``cuda``, host only otherwise."""
        device = torch.device(device)
        if device.type != "cuda":
            return cls()
        index = device.index if device.index is not None else torch.cuda.current_device()
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
        return cls(CudaMemory(index, reset_peak_stats=reset_peak_stats),
                   NvmlMemory(index, uuid=str(uuid) if uuid is not None else None))

    @property
    def basis(self) -> str:
        """What "peak memory" means for this run: torch's CUDA allocations, or the process's host RSS."""
        return "cuda_peak_allocated" if self.cuda is not None else "host_rss_peak_sampled"

    def start_run(self) -> None:
        if self.cuda is not None:
            self.cuda.start_run()

    def sample(self, *, end_window: bool = False) -> dict:
        """All fields now. ``end_window`` closes a logging window (CUDA window peaks restart)."""
        rss = host_rss_bytes()
        self.host_rss_peak = max(self.host_rss_peak, rss)
        fields = {"host_rss_bytes": rss}
        fields.update(self.cuda.sample(end_window=end_window) if self.cuda is not None else null_cuda_fields())
        fields.update(self.nvml.sample() if self.nvml is not None else null_nvml_fields())
        if fields["nvml_used_bytes"] is not None:
            self.nvml_peak = max(self.nvml_peak or 0, fields["nvml_used_bytes"])
        return fields

    def peak_bytes(self) -> int:
        """The run's peak on this sampler's basis."""
        return self.cuda.run_peak_allocated if self.cuda is not None else self.host_rss_peak
