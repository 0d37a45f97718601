"""What the table is computed for: the five CUDA arches (their per-SM limits, for occupancy) and the two GPUs whose
step time is predicted (their SMs, clock and bandwidth)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Arch:
    """Per-SM limits of a CUDA compute capability (CUDA occupancy calculator, CUDA programming guide)."""

    name: str
    cc: int
    max_warps: int
    max_blocks: int
    smem_per_sm: int
    reserved_smem: int
    """Shared memory the driver reserves per block (sm_80 and later: 1 KiB)."""
    smem_unit: int
    regs_per_sm: int = 65536
    reg_unit: int = 256
    """Register allocation unit, per warp."""
    warp_unit: int = 4
    """Warps limited by registers are rounded down to a multiple of this (the SM's four schedulers)."""


ARCHES = {
    "sm_75": Arch("sm_75", 75, max_warps=32, max_blocks=16, smem_per_sm=64 * 1024, reserved_smem=0, smem_unit=256),
    "sm_80": Arch("sm_80", 80, max_warps=64, max_blocks=32, smem_per_sm=164 * 1024, reserved_smem=1024,
                  smem_unit=128),
    "sm_86": Arch("sm_86", 86, max_warps=48, max_blocks=16, smem_per_sm=100 * 1024, reserved_smem=1024,
                  smem_unit=128),
    "sm_89": Arch("sm_89", 89, max_warps=48, max_blocks=24, smem_per_sm=100 * 1024, reserved_smem=1024,
                  smem_unit=128),
    "sm_90": Arch("sm_90", 90, max_warps=64, max_blocks=32, smem_per_sm=228 * 1024, reserved_smem=1024,
                  smem_unit=128),
}


@dataclass(frozen=True)
class Gpu:
    """A GPU for the step-time prediction: its arch (whose instruction counts it uses), SMs, clock, bandwidth."""

    name: str
    arch: str
    sms: int
    clock_hz: float
    bandwidth: float
    """Bytes per second (data sheet)."""

    def issue_seconds(self, warp_instructions: float) -> float:
        return warp_instructions / (self.sms * 4 * self.clock_hz)


GPUS = (Gpu("H100", "sm_90", 132, 1.98e9, 3.35e12), Gpu("T4", "sm_75", 40, 1.59e9, 320e9))
