"""SASS cost of 8-bit quantization and dequantization in Triton: the table encoder with IEEE division
(``triton_blockwise``) against the arithmetic encoder (``triton_encode8``), compiled without a GPU.

Each test kernel loads an fp32 tile, quantizes it (codes and per-block absmax stored) or loads codes and absmax and
dequantizes (fp32 stored). Two tile shapes: ``rows`` is ``(BLOCKS, 256)`` (one block per row, the standalone
kernels' shape) and ``threads`` is ``(BLOCKS, 2, 16, 8)`` (8 consecutive elements per thread, the fused kernels'
shape on the specialized-kernel branch). Printed per configuration: registers, spills (stack bytes), SASS
instructions on the main path per element (instructions per thread x threads / elements; the division's slow-path
calls are not on it), ``own/el``: the same less the kernel's with a one-instruction stand-in for the encoder (or
the lookup), i.e. the encoder's (or lookup's) own cost, MUFU (special function) instructions per element, and
global loads per element by width (the tile's own vector loads included: one 128-bit load per 4 fp32 values).

    python benchmarks/proofs/encoder8_sass.py [--arch 90 80] [--warps 4]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("run without TRITON_INTERPRET: interpreted kernels cannot be compiled")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from hf_optim.kernels.triton_path import encode8 as te  # noqa: E402
from hf_optim.kernels.triton_path import quant8 as tb  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
BLOCKS = 4


@triton.jit
def _offsets(first_block, BLOCKS: tl.constexpr, SHAPE: tl.constexpr):
    blocks = first_block + tl.arange(0, BLOCKS)
    if SHAPE == 0:
        offs = blocks[:, None] * 256 + tl.arange(0, 256)[None, :]
    else:  # (BLOCKS, 2, 16, 8): halves of 16 rows of 8 consecutive elements
        halves = blocks[:, None] * 2 + tl.arange(0, 2)[None, :]
        rows = halves[:, :, None] * 16 + tl.arange(0, 16)[None, None, :]
        offs = rows[:, :, :, None] * 8 + tl.arange(0, 8)[None, None, None, :]
    return blocks, offs


@triton.jit
def _per_block(x, SHAPE: tl.constexpr):
    if SHAPE == 0:
        y = x[:, None]
    else:
        y = x[:, None, None, None]
    return y


@triton.jit
def _block_max(x, SHAPE: tl.constexpr):
    if SHAPE == 0:
        m = tl.max(x, axis=1)
    else:
        m = tl.max(tl.max(tl.max(x, axis=3), axis=2), axis=1)
    return m


@triton.jit
def _quantize(values_ptr, codes_ptr, absmax_ptr, table_ptr, NEW: tl.constexpr, SHAPE: tl.constexpr,
              BLOCKS: tl.constexpr):
    blocks, offs = _offsets(tl.program_id(0) * BLOCKS, BLOCKS, SHAPE)
    values = tl.load(values_ptr + offs)
    absmax = _block_max(tl.abs(values), SHAPE)
    if NEW == 2:  # the kernel around the encoder: one shift stands in for it (codes = top byte of the value)
        codes = (values.to(tl.uint32, bitcast=True) >> 24).to(tl.uint8)
    elif NEW == 1:
        scale, norm, reciprocal = te.quantize8_params(absmax)
        codes = te.quantize8(values, _per_block(scale, SHAPE), _per_block(norm, SHAPE),
                             _per_block(reciprocal, SHAPE), table_ptr)
    else:
        divisor = tl.where(absmax > 0, absmax, 1.0)
        codes = tb.encode(tl.div_rn(values, _per_block(divisor, SHAPE)), table_ptr, True)
    tl.store(codes_ptr + offs, codes)
    tl.store(absmax_ptr + blocks, absmax)


@triton.jit
def _dequantize(codes_ptr, absmax_ptr, qmap_ptr, out_ptr, NEW: tl.constexpr, SHAPE: tl.constexpr,
                BLOCKS: tl.constexpr):
    blocks, offs = _offsets(tl.program_id(0) * BLOCKS, BLOCKS, SHAPE)
    codes = tl.load(codes_ptr + offs)
    absmax = _per_block(tl.load(absmax_ptr + blocks), SHAPE)
    if NEW == 2:  # the kernel around the lookup: a conversion stands in for it
        values = codes.to(tl.float32) * absmax
    elif NEW == 1:
        values = te.dequantize8(codes, absmax, qmap_ptr)
    else:
        values = tl.load(qmap_ptr + codes.to(tl.int32)) * absmax
    tl.store(out_ptr + offs, values)


def compile_sass(kernel, signature: dict, constants: dict, arch: int, warps: int) -> tuple[str, str]:
    names = kernel.arg_names
    signature = {**signature, **{name: "constexpr" for name in constants}}
    constexprs = {(names.index(name),): value for name, value in constants.items()}
    # Pointers 16-byte aligned, as the launches the kernels get (torch allocations; the fused kernels check it).
    aligned = {(names.index(name),): [["tt.divisibility", 16]] for name, kind in signature.items()
               if kind.startswith("*")}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, aligned), target=GPUTarget("cuda", arch, 32),
                              options={"enable_fp_fusion": False, "num_warps": warps})
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.cubin")
        with open(path, "wb") as file:
            file.write(compiled.asm["cubin"])
        sass = subprocess.run([os.path.join(BIN, "nvdisasm"), "-c", path], capture_output=True, text=True,
                              check=True).stdout
        usage = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", path], capture_output=True,
                               text=True, check=True).stdout
    return sass, usage


INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);")


def main_path(sass: str) -> list[str]:
    """The entry function's instructions up to its last EXIT, without the blocks that call a slow path (a
    conditional branch jumps over each: IEEE division's out-of-range operands)."""
    body = re.split(r"\.type\s+\$__internal", sass)[0]
    lines = body.splitlines()
    items: list[tuple[str, str]] = []  # (kind, text): kind "label" or "op"
    for line in lines:
        label = re.match(r"^\s*(\.L_x_\d+):", line)
        if label:
            items.append(("label", label.group(1)))
            continue
        found = INSTRUCTION.search(line)
        if found:
            items.append(("op", found.group(2).strip()))
    ops: list[str] = []
    index = 0
    while index < len(items):
        kind, text = items[index]
        if kind == "op":
            jump = re.match(r"^@!?U?P\d\s+BRA\s+`\((\.L_x_\d+)\)", text)
            if jump:
                target = jump.group(1)
                end = next(i for i in range(index + 1, len(items)) if items[i] == ("label", target))
                skipped = [t for k, t in items[index + 1:end] if k == "op"]
                if any(t.startswith("CALL") for t in skipped):
                    ops.append(text)
                    index = end
                    continue
            ops.append(text)
        index += 1
    last_exit = max(i for i, op in enumerate(ops) if re.match(r"^(@!?P\d\s+)?EXIT", op))
    return [op for op in ops[: last_exit + 1] if not op.startswith("NOP")]


def opcode(op: str) -> str:
    return op.split()[1] if op.startswith("@") else op.split()[0]


def measure(kernel, signature, constants, arch, warps, elements):
    sass, usage = compile_sass(kernel, signature, constants, arch, warps)
    ops = main_path(sass)
    threads = 32 * warps
    per = threads / elements
    codes = collections.Counter(opcode(op) for op in ops)
    loads = {name.split("LDG.E")[-1].lstrip(".") or "32": count * per for name, count in codes.items()
             if name.startswith("LDG")}
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    spills = re.search(r"STACK:(\d+)", usage)
    return {
        "regs": registers, "stack": int(spills.group(1)) if spills else 0, "inst/el": len(ops) * per,
        "loads/el": {k: round(v, 3) for k, v in sorted(loads.items())},
        "mufu/el": sum(c for n, c in codes.items() if n.startswith("MUFU")) * per,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, nargs="+", default=[90, 80])
    parser.add_argument("--warps", type=int, default=4)
    args = parser.parse_args()
    elements = BLOCKS * 256
    quantize_sig = {"values_ptr": "*fp32", "codes_ptr": "*u8", "absmax_ptr": "*fp32", "table_ptr": "*i32"}
    dequantize_sig = {"codes_ptr": "*u8", "absmax_ptr": "*fp32", "qmap_ptr": "*fp32", "out_ptr": "*fp32"}
    print(f"{'arch':>4} {'shape':>7} {'kernel':>10} {'encoder':>9} {'regs':>4} {'stack':>5} {'inst/el':>7} "
          f"{'own/el':>6} {'mufu/el':>7}  loads/el (by width; the tile's own loads included)")
    for arch in args.arch:
        for shape_name, shape in (("rows", 0), ("threads", 1)):
            for kernel_name, kernel, signature in (("quantize", _quantize, quantize_sig),
                                                   ("dequantize", _dequantize, dequantize_sig)):
                base = None
                for encoder, new in (("(none)", 2), ("table", 0), ("arith", 1)):
                    row = measure(kernel, signature, {"NEW": new, "SHAPE": shape, "BLOCKS": BLOCKS}, arch,
                                  args.warps, elements)
                    base = row["inst/el"] if base is None else base
                    print(f"{arch:>4} {shape_name:>7} {kernel_name:>10} {encoder:>9} {row['regs']:>4} "
                          f"{row['stack']:>5} {row['inst/el']:>7.2f} {row['inst/el'] - base:>6.2f} "
                          f"{row['mufu/el']:>7.3f}  {row['loads/el']}", flush=True)


if __name__ == "__main__":
    main()
