"""Compiling a configuration ahead of time (no GPU, no driver) and reading its resources: registers, stack, shared
and local memory, spills, and the occupancy they allow."""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass

import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from hf_optim.gpu_static.launch_config import LaunchConfig
from hf_optim.gpu_static.targets import ARCHES, Arch


@dataclass
class Compiled:
    """A compiled binary: the cubin, Triton's metadata numbers and ``ptxas -v``'s log."""

    cubin: bytes
    dynamic_smem: int
    num_warps: int
    seconds: float
    ptxas_log: str


def compile_config(config: LaunchConfig, arch: str) -> Compiled:
    """Compile ``config`` for ``arch`` (``"sm_90"``) cold (Triton's cache bypassed), timing it.

    Args:
        config: the configuration.
        arch: a key of :data:`ARCHES`.
    """
    names = config.kernel.arg_names
    signature = {**config.signature, **{name: "constexpr" for name in config.constexprs}}
    constexprs = {(names.index(name),): value for name, value in config.constexprs.items()}
    options = {"num_warps": config.num_warps, **config.options}
    log = io.StringIO()
    with knobs.compilation.scope(), knobs.nvidia.scope():
        knobs.compilation.always_compile = True
        knobs.nvidia.dump_ptxas_log = True  # printed by Triton: captured below
        with contextlib.redirect_stdout(log):
            start = time.perf_counter()
            compiled = triton.compile(ASTSource(config.kernel, signature, constexprs, config.attrs()),
                                      target=GPUTarget("cuda", ARCHES[arch].cc, 32), options=options)
            seconds = time.perf_counter() - start
    return Compiled(compiled.asm["cubin"], int(compiled.metadata.shared), int(compiled.metadata.num_warps), seconds,
                    log.getvalue())


def _tool(name: str) -> str:
    return getattr(knobs.nvidia, name).path


def run_tool(name: str, cubin: bytes, *args: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        done = subprocess.run([_tool(name), *args, f.name], capture_output=True, text=True)
    if done.returncode != 0:
        first = (done.stderr.strip().splitlines() or ["no message"])[0]
        raise RuntimeError(f"{name} {' '.join(args)} failed: {first}")
    return done.stdout


def resources(compiled: Compiled) -> dict:
    """Registers, stack, static shared and local memory (``cuobjdump -res-usage``) and spill bytes (``ptxas -v``)."""
    usage = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", run_tool("cuobjdump", compiled.cubin,
                                                                                 "-res-usage"))
    if usage is None:
        raise RuntimeError("cuobjdump -res-usage printed no resource line")
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", compiled.ptxas_log)
    if spills is None:
        raise RuntimeError(f"no spill line in ptxas -v's log: {compiled.ptxas_log[-300:]!r}")
    regs, stack, static_smem, local = (int(x) for x in usage.groups())
    return {"regs": regs, "stack": stack, "static_smem": static_smem, "local_bytes": local,
            "spill_stores": int(spills.group(1)), "spill_loads": int(spills.group(2))}


def occupancy(regs: int, smem_per_block: int, num_warps: int, arch: Arch) -> tuple[float, int, str]:
    """(theoretical occupancy, blocks per SM, limiter) of a kernel launched with ``num_warps`` warps per block.

    Args:
        regs: registers per thread.
        smem_per_block: shared memory per block in bytes (reserved included).
        num_warps: warps per block.
        arch: the SM's limits.
    """
    regs_per_warp = -(-max(regs, 1) * 32 // arch.reg_unit) * arch.reg_unit
    warps_by_regs = (arch.regs_per_sm // regs_per_warp) // arch.warp_unit * arch.warp_unit
    limits = {"regs": warps_by_regs // num_warps, "warps": arch.max_warps // num_warps, "blocks": arch.max_blocks}
    if smem_per_block:
        smem = -(-smem_per_block // arch.smem_unit) * arch.smem_unit
        limits["smem"] = arch.smem_per_sm // smem
    limiter = min(limits, key=lambda k: (limits[k], k != "regs"))
    blocks = limits[limiter]
    return blocks * num_warps / arch.max_warps, blocks, limiter
