"""torch's CUDA caching-allocator counters for one device, with peaks per logging window and per run.

torch keeps one peak counter per device; to get a peak per logging window the counter is reset after each read
(``reset_peak_stats=True``). The run peak is then the largest window peak. Code of your own that reads
``torch.cuda.max_memory_reserved()`` after training sees only the last window in that mode: pass
``reset_peak_stats=False`` to leave torch's counters alone (window peaks are then null and the run peak is
torch's peak since its last reset, which may include what happened before training).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

CUDA_FIELDS = (
    "cuda_allocated_bytes",  # current, when sampled
    "cuda_reserved_bytes",
    "cuda_peak_allocated_window_bytes",  # peak since the previous sample that closed a window
    "cuda_peak_reserved_window_bytes",
    "cuda_peak_allocated_run_bytes",  # peak since the run started
    "cuda_peak_reserved_run_bytes",
    "cuda_capacity_bytes",  # the device's total memory
    "cuda_reserved_pct",  # current reserved, % of capacity
    "cuda_peak_reserved_run_pct",
    "cuda_alloc_retries",  # cumulative: cudaMalloc failures the allocator recovered from by freeing its cache
    "cuda_ooms",  # cumulative: out-of-memory errors raised by the allocator
)


def null_cuda_fields() -> dict:
    """Every CUDA field as ``None``: what a CPU run records (unknown is not zero)."""
    return dict.fromkeys(CUDA_FIELDS)


def _pct(part: int, whole: int) -> float | None:
    return round(100.0 * part / whole, 2) if whole else None


class CudaMemory:
    """Samples ``torch.cuda.memory_stats`` for one device.

    Args:
        device: the CUDA device (``torch.device("cuda:0")``, ``0``, ...).
        reset_peak_stats: reset torch's peak counters after each window (see the module docstring). Default True.
        stats: returns the ``memory_stats`` dict; default ``torch.cuda.memory_stats(device)``. Injected by tests.
        capacity_bytes: the device's total memory; default from ``torch.cuda.get_device_properties``.
        reset: resets the peak counters; default ``torch.cuda.reset_peak_memory_stats(device)``.
    """

    def __init__(self, device, *, reset_peak_stats: bool = True, stats: Callable[[], dict] | None = None,
                 capacity_bytes: int | None = None, reset: Callable[[], None] | None = None):
        self.device = device
        self.reset_peak_stats = reset_peak_stats
        self._stats = stats or (lambda: torch.cuda.memory_stats(device))
        self._reset = reset or (lambda: torch.cuda.reset_peak_memory_stats(device))
        if capacity_bytes is None:
            capacity_bytes = torch.cuda.get_device_properties(device).total_memory
        self.capacity_bytes = int(capacity_bytes)
        self.run_peak_allocated = 0
        self.run_peak_reserved = 0

    def start_run(self) -> None:
        """Start the run's peaks from what is allocated now (the model, the optimizer's empty state)."""
        if self.reset_peak_stats:
            self._reset()
        stats = self._stats()
        self.run_peak_allocated = stats.get("allocated_bytes.all.current", 0)
        self.run_peak_reserved = stats.get("reserved_bytes.all.current", 0)

    def sample(self, *, end_window: bool) -> dict:
        """The CUDA fields now; ``end_window`` closes the logging window (resets torch's peaks when enabled)."""
        stats = self._stats()
        peak_allocated = stats.get("allocated_bytes.all.peak", 0)
        peak_reserved = stats.get("reserved_bytes.all.peak", 0)
        self.run_peak_allocated = max(self.run_peak_allocated, peak_allocated)
        self.run_peak_reserved = max(self.run_peak_reserved, peak_reserved)
        reserved = stats.get("reserved_bytes.all.current", 0)
        fields = {
            "cuda_allocated_bytes": stats.get("allocated_bytes.all.current", 0),
            "cuda_reserved_bytes": reserved,
            "cuda_peak_allocated_window_bytes": peak_allocated if self.reset_peak_stats else None,
            "cuda_peak_reserved_window_bytes": peak_reserved if self.reset_peak_stats else None,
            "cuda_peak_allocated_run_bytes": self.run_peak_allocated,
            "cuda_peak_reserved_run_bytes": self.run_peak_reserved,
            "cuda_capacity_bytes": self.capacity_bytes,
            "cuda_reserved_pct": _pct(reserved, self.capacity_bytes),
            "cuda_peak_reserved_run_pct": _pct(self.run_peak_reserved, self.capacity_bytes),
            "cuda_alloc_retries": stats.get("num_alloc_retries", 0),
            "cuda_ooms": stats.get("num_ooms", 0),
        }
        if end_window and self.reset_peak_stats:
            self._reset()
        return fields
