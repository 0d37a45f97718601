"""Compile hf_optim's Triton kernels for a GPU arch without a GPU; run by test_gpu_static.py.

    python tests/triton_compile_check.py                 # the CI set, sm_90
    python tests/triton_compile_check.py --all --arch 75 # every configuration the optimizers launch, sm_75

The CPU interpreter (test_triton_kernels.py) checks the math but accepts code the GPU compiler rejects; this compiles
each kernel of ``hf_optim.kernels.triton_path.configs.kernel_specs`` (exactly what the optimizers launch) to a cubin
with
Triton's ahead-of-time compiler and checks the properties the bit-compatibility and bandwidth claims rest on:

- IEEE division and square root (no ``div.full``, no ``sqrt.approx``; ``rsqrt.approx`` is the 8-bit encoder's), and
  no contraction of separate multiplies and adds into FMAs in the fused elementwise kernels (every ``fma.rn.f32``
  comes from an explicit ``tl.fma``, the 8-bit encoder's; the rules have none);
- no register spills (no local memory);
- whole, aligned tiles of the fused kernels: 128-bit vector loads (64-bit where a thread row is 4 bf16/fp16
  values), and no shared memory (no layout conversion: per-block values stay where their reduction leaves them),
  except where it is expected: LAMB's direction pass (its per-tile norms reduce across warps) and 8-bit state at 4
  elements per thread (``FusedConfig.whole_tile_width``), whose 256-element blocks span two warps, so each block's
  absmax reduces through shared memory, and ``stochastic4`` (``StateFormat.crosses_threads``: a code byte pairs
  elements 128 apart, and its group maxima reduce over a reshaped tile).

The CI set (the default) is every whole-tile fused configuration of AdamW (each dtype and state format, with and
without stochastic rounding) and, for the other algorithms and the other kernels, one configuration each of every
kernel; ``--all`` compiles all of them (``python -m hf_optim.gpu_static`` measures them).
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("run without TRITON_INTERPRET: interpreted kernels cannot be compiled")

from triton import knobs  # noqa: E402

import hf_optim  # noqa: E402, F401  (registers the algorithms)
from hf_optim.kernels.triton_path.configs import LaunchSpec, kernel_specs  # noqa: E402
from hf_optim.optim import registry  # noqa: E402


def ci_set(specs: list[LaunchSpec]) -> list[LaunchSpec]:
    chosen, seen = [], set()
    for spec in specs:
        flagship = spec.group == "fused" and spec.name.startswith("fused/adamw ") and spec.main
        kind = (spec.group, spec.kernel.__name__, spec.name.split(" ")[0], spec.main)
        if flagship or kind not in seen:
            chosen.append(spec)
            seen.add(kind)
    return chosen


def local_memory(cubin: bytes) -> tuple[int, int]:
    """(registers, local memory bytes per thread) from ``cuobjdump -res-usage``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([knobs.nvidia.cuobjdump.path, "-res-usage", f.name], capture_output=True, text=True)
    found = re.search(r"REG:(\d+) STACK:\d+ SHARED:\d+ LOCAL:(\d+)", out.stdout)
    assert found, out.stdout + out.stderr
    return int(found.group(1)), int(found.group(2))


def contracted(ptx: str) -> bool:
    """Whether an ``fma.rn.f32`` in ``ptx`` comes from a source line without an explicit ``tl.fma`` (the 8-bit
    encoder's fmas are explicit, ``triton_path/encode8.py``; anything else is the compiler contracting a multiply and
    an add). Each instruction's source line is the ``.loc FILE LINE COL`` before it, ``FILE`` numbering the
    ``.file`` directives' whole paths (file names alone repeat: ``elementwise.py``, ``triton_rule.py``)."""
    files = dict(re.findall(r'^\s*\.file\s+(\d+)\s+"([^"]+)"', ptx, re.M))
    where = None
    for line in ptx.splitlines():
        loc = re.search(r"\.loc\s+(\d+)\s+(\d+)\s", line)
        if loc:
            where = (files.get(loc.group(1), ""), loc.group(2))
        elif re.search(r"\bfma\.rn\.f32", line):
            if where is None or "tl.fma" not in _source_line(*where):
                return True
    return False


def _source_line(name: str, number: str) -> str:
    path = Path(name)
    lines = path.read_text().splitlines() if name and path.exists() else []
    return lines[int(number) - 1] if 0 < int(number) <= len(lines) else ""


def check(spec: LaunchSpec, arch: int) -> str:
    compiled = spec.compile(arch)
    ptx = compiled.asm["ptx"]
    regs, local = local_memory(compiled.asm["cubin"])
    problems = []
    if "div.full" in ptx or re.search(r"(?<!r)sqrt\.approx", ptx):
        problems.append("approximate division or square root")
    if local:
        problems.append(f"{local} bytes of local memory (spills)")
    if spec.group in ("fused", "lamb") and spec.kernel.__name__ == "_fused_update_kernel":
        if contracted(ptx):
            problems.append("contracted multiply-add")
        if spec.param_dtype == "bf16" and not spec.writes_direction and arch >= 80 and not spec.constexprs.get("SR"):
            if "cvt.rn.bf16" not in ptx:  # triton_tile.fp32_to_bf16: the hardware rounding on the GPU
                problems.append("bf16 parameters stored without cvt.rn.bf16")
        if spec.main:
            # a thread row of W parameters: 16 bytes (one 128-bit access) when it holds that many, else 8 (bf16 and
            # fp16 at 4 elements per thread: FusedConfig.whole_tile_width)
            row_bytes = spec.constexprs["W"] * {"fp32": 4, "bf16": 2, "fp16": 2}[spec.param_dtype]
            vector = r"v4\.b32" if row_bytes >= 16 else r"v[24]\.b32"
            if not re.search(rf"ld\.global(\.[a-z]+)*\.{vector}", ptx):
                problems.append(f"no {min(row_bytes, 16) * 8}-bit vector loads on a whole tile")
            # a 256-element block (8-bit, fp8) spans two warps at 4 elements per thread: its absmax reduces
            # through shared memory (triton_elementwise.FusedConfig.whole_tile_width)
            block = spec.state_format.block_size if spec.state_format is not None else 0
            two_warp_blocks = spec.constexprs["W"] * 32 < block
            crosses = spec.state_format is not None and spec.state_format.crosses_threads
            expected = spec.writes_direction or two_warp_blocks or crosses
            if compiled.metadata.shared and not expected:
                problems.append(f"{compiled.metadata.shared} bytes of shared memory")
    status = "; ".join(problems) if problems else "ok"
    print(f"sm_{arch} {spec.name}: {regs} registers, {status}", flush=True)
    return "" if not problems else f"{spec.name}: {status}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="every configuration (default: the CI set)")
    parser.add_argument("--arch", default="90", help="compute capabilities, comma-separated (default 90)")
    args = parser.parse_args(argv)
    algorithms = [(f.algorithm, f.base._supported_formats()) for f in registry.families()]
    failures, count = [], 0
    for arch in (int(text) for text in args.arch.split(",")):
        specs = kernel_specs(algorithms, arch=arch)  # a few configurations take another tile width per arch
        specs = specs if args.all else ci_set(specs)
        count += len(specs)
        failures += [problem for spec in specs if (problem := check(spec, arch))]
    if failures:
        print("\n".join(["FAILED:", *failures]))
        return 1
    print(f"all kernels compiled ({count} configurations)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
