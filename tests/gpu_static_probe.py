"""Kernels with known answers for test_gpu_static.py: hf_optim.gpu_static's measurements on them, as JSON.

Run in a fresh process without TRITON_INTERPRET (kernels defined under the interpreter cannot be compiled):
``python tests/gpu_static_probe.py OUT.json``. Three kernels:

- ``_spills``: a program holds 32 KiB of values live across a reduction in one warp (256 fp32 per thread, over
  the 255 registers a thread can have), so ptxas must spill: the check must see it.
- ``_branch``: a run-time ``if`` whose arms use different special-function instructions (``rsqrt``: MUFU.RSQ,
  ``exp2``: MUFU.EX2): the main path of each configuration must hold its arm's and not the other's.
- ``_loop``: a run-time ``for`` over ``range(0, cols, BC)`` (a row reduction, as Adafactor's statistics): the main
  path must grow by one body per trip, on arches where ptxas tests the loop at its bottom and at its top.
"""

import json
import sys
from pathlib import Path

from hf_optim import gpu_static  # before triton: it refuses the interpreter

# isort: split
import triton
import triton.language as tl


@triton.jit
def _spills(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    total = tl.sum(x * x, axis=0)
    tl.store(out_ptr + offs, x * total + x)


@triton.jit
def _branch(x_ptr, out_ptr, flag, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if flag == 0:
        tl.store(out_ptr + offs, tl.rsqrt(tl.load(x_ptr + offs)))
    else:
        tl.store(out_ptr + BLOCK + offs, tl.exp2(tl.load(x_ptr + BLOCK + offs)))


@triton.jit
def _loop(x_ptr, out_ptr, cols, BR: tl.constexpr, BC: tl.constexpr):
    rows = tl.arange(0, BR)
    acc = tl.zeros([BR], dtype=tl.float32)
    for start in range(0, cols, BC):
        c = start + tl.arange(0, BC)
        x = tl.load(x_ptr + rows[:, None] * cols + c[None, :], mask=(c < cols)[None, :], other=0.0)
        acc += tl.sum(x * x, axis=1)
    tl.store(out_ptr + rows, acc)


def config(name, kernel, signature, constexprs, facts=None, num_warps=4, elements=None):
    return gpu_static.LaunchConfig(name, kernel, signature, constexprs, num_warps=num_warps, facts=facts or {},
                                   elements_per_program=elements)


def main(out: Path, arch: str = "sm_90") -> None:
    result = {}
    spills = config("spills", _spills, {"x_ptr": "*fp32", "out_ptr": "*fp32"}, {"BLOCK": 8192}, num_warps=1)
    result["spills"] = gpu_static.measure(spills, arch)
    result["spill_problems"] = gpu_static.problems([result["spills"]])

    branch = {"x_ptr": "*fp32", "out_ptr": "*fp32", "flag": "i32"}
    compiled = gpu_static.compile_config(config("branch", _branch, branch, {"BLOCK": 1024}), arch)
    sass = gpu_static.read_sass(compiled.cubin)
    for flag in (0, 1):
        path = gpu_static.main_path(sass, {"flag": flag, "BLOCK": 1024})
        opcodes = [ins.opcode for b in path.blocks for ins in sass.blocks[b].instructions]
        result[f"branch flag={flag}"] = {"rsq": opcodes.count("MUFU.RSQ"), "ex2": opcodes.count("MUFU.EX2"),
                                         "ambiguous": path.ambiguous}
    result["branch binary"] = {"rsq": sum(ins.opcode == "MUFU.RSQ" for ins in sass.instructions),
                               "ex2": sum(ins.opcode == "MUFU.EX2" for ins in sass.instructions)}

    loop = config("loop", _loop, {"x_ptr": "*fp32", "out_ptr": "*fp32", "cols": "i32"}, {"BR": 16, "BC": 256})
    for loop_arch in (arch, "sm_80", "sm_75"):  # ptxas shapes this loop with its test at the bottom or the top
        sass = gpu_static.read_sass(gpu_static.compile_config(loop, loop_arch).cubin)
        for trips in (1, 2, 8):
            path = gpu_static.main_path(sass, {"cols": trips * 256, "BR": 16, "BC": 256})
            opcodes = [ins.opcode for b in path.blocks for ins in sass.blocks[b].instructions]
            result[f"loop {loop_arch} trips={trips}"] = {"instructions": path.instructions,
                                                         "loads": sum(op.startswith("LDG") for op in opcodes),
                                                         "ambiguous": path.ambiguous}
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), *sys.argv[2:])
