"""The GPU kernels without a GPU: every Triton kernel configuration the optimizers launch, compiled ahead of time.

    python benchmarks/gpu/gpu_static.py                    # every configuration on sm_75, sm_80, sm_86, sm_89, sm_90
    python benchmarks/gpu/gpu_static.py --arch sm_90,sm_75 --kernels adamw --jobs 2
    python benchmarks/gpu/gpu_static.py --json benchmarks/gpu/results/gpu_static_after.json
    python benchmarks/gpu/gpu_static.py --from-json benchmarks/gpu/results/gpu_static_before.json --markdown

The configurations are those ``hf_optim.kernels.triton_path.configs.kernel_specs`` lists (exactly what the optimizers
launch, built from the configuration objects the launches use). Each is compiled with Triton's ahead-of-time
compiler (``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))``: no device or driver needed) to a
cubin for each arch, and the cubin is read with the tools in Triton's wheel (``cuobjdump -res-usage``, ``nvdisasm``;
``ptxas -v``'s log for spills). One table, one row per configuration and arch:

- ``regs``: registers per thread; ``spill st/ld``: bytes of spill stores / loads (``ptxas -v``); ``local``: local
  memory instructions (``LDL``/``STL``) in the SASS; ``smem``: shared memory per block in bytes (Triton's dynamic
  shared memory, plus the static or the 1 KiB per block the driver reserves on sm_80 and later, whichever is larger).
- ``occ``: theoretical occupancy at the launch's ``num_warps`` (Triton's default 4 unless the launch sets it), as the
  CUDA occupancy calculator computes it: registers are allocated per warp in units of 256 (64K per SM, warps
  limited by registers rounded down to a multiple of 4, the SM's four schedulers), shared memory in units of 256
  bytes (sm_75) or 128 bytes, and blocks are limited by the SM's warps (sm_75 32, sm_80 64, sm_86/89 48, sm_90 64),
  its blocks (16, 32, 16, 24, 32) and its shared memory (64, 164, 100, 100, 228 KiB).
- ``inst/el``: SASS instructions executed per thread on the main path x threads per program / elements per program.
- ``ld/el``: global loads (``LDG``, any width) executed per thread on the main path x threads per program / elements
  per program, counted on the same path as ``inst/el``: streaming loads (vectorized) and any table gathers.
  The main path is the common case: a full tile, the configuration's parameter dtype and state format, no special
  operands. For straight-line code it is the static instruction count. Where a kernel branches at run time (the
  generic fused kernel before issue 22 branched on dtype and state format per tensor), only the executed path is
  counted, found by a control-flow analysis of the SASS (method below). Loops count their trip count; kernels whose
  work is per tensor (reductions over per-tile partials) have no per-element count (``-``). A configuration off the
  main path (the masked kernel of a tensor's last, partial tile) shows its own count and gets no prediction.
- ``compile s``: wall seconds of ``triton.compile`` (front end, LLVM and ``ptxas``) for that arch, cold (Triton's
  cache is bypassed); one binary serves every row that shares its compile-time constants, and its seconds are shown
  on each of them. They depend on the machine and its load.
- For the fused elementwise configurations, the predicted step time on the Llama-3.2-1B full set (146 tensors,
  1.24e9 elements; tensors under ``min_8bit_size`` keep fp32 state, as the optimizers do) on an H100 SXM (sm_90:
  132 SMs, 1.98 GHz, 3.35 TB/s) and a T4 (sm_75: 40 SMs, 1.59 GHz, 320 GB/s): ``max(bandwidth bound, issue bound)``
  beside the bandwidth bound. Bandwidth bound = bytes / bandwidth, the bytes computed from the configuration's
  formats: parameter and gradient read, parameter written (or the fp32 direction written, LAMB), each state row read
  and written with its per-block absmax amortized. Issue bound = elements x instructions per element / 32 / (SMs x
  4 schedulers x clock): one warp instruction per scheduler per cycle, the best case (no latency, no dual issue).

Main-path analysis. The cubin is disassembled with source lines and inlining (``nvdisasm -gi``) and split into basic
blocks (labels, branches, exits), with their immediate post-dominators. Every ``if`` and ``for`` of the kernel sources
(read with ``ast``) is decided for the configuration: its test is evaluated on the configuration's compile-time
constants and run-time facts (e.g. ``dtype == 1`` with the parameter's dtype code, ``fmt == FORMAT_BLOCKWISE8`` with
the state format's code, the full-tile test with a large ``n``), and a ``for`` over ``range(...)`` gets its trip
count the same way. The walk starts at the entry and follows unconditional branches. At a forward conditional
branch, each side is the set of blocks reachable from it before the branch's post-dominator and not from the other
side, and these rules are tried in order:

1. a side whose code lies only in arms the configuration does not run is not taken, if the other side holds code
   it runs (the ``if``s the branch itself lies in are left out: the compiler shares code between their copies, and
   the line information then names one copy);
2. the ``if`` whose test line the branch is attributed to: the side holding the arm taken;
3. a decided ``if`` whose arms split the two sides (their majority arms differ): the side of the arm taken;
4. a side calling a compiler subroutine (the slow paths of IEEE division and square root for special operands,
   64-bit integer division when the operands do not fit 32 bits) or taken by a diverged warp is not taken;
5. the only side holding code the configuration runs;
6. a guard (one side skips to the join): the side with the code, which a warp issues when any of its threads
   runs it.

A branch no rule decides follows its larger side (an upper bound) and is counted in ``ambiguous_branches``
(marked ``?`` in the table); the CI test asserts there are none in the fused kernels. A backward branch attributed
to a ``for`` header is that loop's latch, taken trip count - 1 times; a loop whose body ends in an unconditional
backward branch leaves at its exit test (the branch attributed to the same header) once the body ran trip count
times; a compiler or library loop runs once and counts as ambiguous. Predicated instructions count where they lie on
the path: they issue whatever their predicate. The method is checked on kernels with known answers
(tests/gpu_static_probe.py: the arm of a run-time branch, loop trips, a spill).

Machine-readable output: ``--json PATH`` writes every row (and the environment); ``--from-json A.json [B.json ...]``
re-renders saved runs (merged: run arch subsets separately, then merge them with ``--json``); ``--markdown`` prints the
table as Markdown (for docs/benchmarks.md); ``--check`` exits 1 on a spill, local memory or a compile error.
Functions to reuse: :func:`compile_config`, :func:`measure`, :func:`resources`, :func:`read_sass`, :func:`main_path`,
:func:`occupancy`, :func:`predict`, :func:`problems`.
"""

from __future__ import annotations

import argparse
import ast
import collections
import contextlib
import datetime
import functools
import io
import json
import math
import multiprocessing
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    # Kernels defined under the interpreter cannot be compiled; this script only compiles.
    os.environ["TRITON_INTERPRET"] = "0"

import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # after PYTHONPATH: a checkout named there is the one measured


# --------------------------------------------------------------------------------------------------------------
# Targets


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


# --------------------------------------------------------------------------------------------------------------
# Configurations


@dataclass(frozen=True)
class Stream:
    """Bytes a configuration moves per element, from its formats (the bandwidth bound).

    Args:
        param_bytes: bytes of one parameter (and gradient) element.
        state_format: the state rows' format (a ``hf_optim.formats`` format), or None: no state.
        state_rows: state rows read and written.
        param_read / grad_read / param_write (default True): whether the pass streams them.
        out_read / out_write (default 0): bytes per element of an fp32 side output (LAMB's direction).
    """

    param_bytes: int
    state_format: Any
    state_rows: int
    param_read: bool = True
    grad_read: bool = True
    param_write: bool = True
    out_read: int = 0
    out_write: int = 0

    def bytes_per_element(self, state_format: Any = None) -> float:
        """Bytes per element, with ``state_format`` in place of the configuration's (default: its own)."""
        fmt = state_format if state_format is not None else self.state_format
        total = self.param_bytes * (self.param_read + self.grad_read + self.param_write)
        total += self.out_read + self.out_write
        if fmt is not None:
            per_row = fmt.bits / 8 + (4 / fmt.block_size if fmt.block_size else 0)
            total += 2 * self.state_rows * per_row  # read and written
        return total


@dataclass(eq=False)
class LaunchConfig:
    """One kernel configuration an optimizer launches: a binary (kernel, signature, compile-time constants, launch
    options) and the run-time facts that pick its main path.

    Args:
        name: the row's label (``group/kernel ...``), unique.
        kernel: the ``@triton.jit`` kernel.
        signature: type of each run-time argument (``"*fp32"``, ``"i32"``, a tuple of types for a named tuple).
        constexprs: value of each ``tl.constexpr`` argument.
        num_warps (default 4): warps per program, as launched (Triton's default unless the launch sets it).
        options (default {}): other launch options, as launched (``enable_fp_fusion``).
        facts (default {}): run-time values that decide the main path: names the kernels' ``if`` and ``for`` tests
            read (``dtype``, ``fmt``, ``n``...), or a test's exact source text mapped to its outcome.
        elements_per_program (default None): elements one program updates on the main path (None: per-tensor work,
            no per-element count).
        stream (default None): the bytes model (:class:`Stream`) of a fused elementwise configuration: gets a
            predicted step time.
        group (default ""): the kernel family (``fused``, ``lamb``, ``adafactor``, ``standalone``).
        fp32_state_twin (default None): the name of the configuration tensors below ``min_8bit_size`` run instead
            (fp32 state), for the prediction.
        launched_by (default ""): who launches it (shown in the JSON).
        main (default True): a configuration of the common case; only those get a predicted step time.
        specialization (default None): Triton's ``attrs`` of the arguments as launched (None: :meth:`attrs`).
    """

    name: str
    kernel: Any
    signature: dict
    constexprs: dict
    num_warps: int = 4
    options: dict = field(default_factory=dict)
    facts: dict = field(default_factory=dict)
    elements_per_program: int | None = None
    stream: Stream | None = None
    group: str = ""
    fp32_state_twin: str | None = None
    launched_by: str = ""
    main: bool = True
    """Whether it runs the common case (whole tiles); False: e.g. the masked kernel of tensors' last tiles."""
    specialization: dict | None = None
    """Triton's ``attrs`` of the arguments as launched; None: :meth:`attrs`' default."""
    arch: str | None = None
    """The arch it is launched on (a key of :data:`ARCHES`), where the kernels layer specializes per arch; None: every
    arch."""

    def attrs(self) -> dict:
        """Triton's specialization of the arguments as launched: by default every pointer hf_optim passes is a
        tensor's data, 16-byte aligned (``tt.divisibility`` 16, as Triton's launcher detects); integers general."""
        if self.specialization is not None:
            return self.specialization
        names = self.kernel.arg_names
        return {(names.index(name),): [["tt.divisibility", 16]] for name, kind in self.signature.items()
                if isinstance(kind, str) and kind.startswith("*")}

    def binary_key(self) -> tuple:
        """Configurations with equal keys share one compiled binary."""
        def plain(value):
            return getattr(value, "__name__", None) or repr(value)
        return (self.kernel.fn.__module__, self.kernel.__name__, repr(sorted(self.signature.items())),
                repr(sorted((k, plain(v)) for k, v in self.constexprs.items())), self.num_warps,
                repr(sorted(self.options.items())), repr(sorted(self.attrs().items())))


# --------------------------------------------------------------------------------------------------------------
# Compiling


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


def _run_tool(name: str, cubin: bytes, *args: str) -> str:
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
    usage = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", _run_tool("cuobjdump", compiled.cubin,
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


# --------------------------------------------------------------------------------------------------------------
# SASS


@dataclass
class Instruction:
    address: int
    predicate: str
    opcode: str
    text: str
    frames: tuple[tuple[str, int], ...]
    """Source (file, line) of the instruction, innermost inlined function first."""

    @property
    def target(self) -> str | None:
        found = re.search(r"`\(([^)]+)\)", self.text)
        return found.group(1) if found else None


_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^([.$\w][^\s:]*):")
_FRAME = re.compile(r'//## File "([^"]+)", line (\d+)')


def disassemble(cubin: bytes) -> tuple[list[Instruction], dict[str, int]]:
    """The kernel's instructions (``nvdisasm -c -gi``) and its labels (label -> index of the next instruction)."""
    instructions: list[Instruction] = []
    labels: dict[str, int] = {}
    frames: tuple = ()
    group: list = []
    in_comment = False
    for line in _run_tool("nvdisasm", cubin, "-c", "-gi").splitlines():
        frame = _FRAME.search(line)
        if frame:
            if not in_comment:
                group = []
            group.append((frame.group(1), int(frame.group(2))))
            in_comment = True
            continue
        if in_comment:
            frames, in_comment = tuple(group), False
        found = _INSTRUCTION.match(line)
        if found:
            text = found.group(2).strip("{} ")
            predicate = ""
            if text.startswith("@"):
                predicate, text = text.split(None, 1)
            opcode = text.split(None, 1)[0]
            instructions.append(Instruction(int(found.group(1), 16), predicate, opcode, text, frames))
            continue
        label = _LABEL.match(line.strip())
        if label:
            labels[label.group(1)] = len(instructions)
    return instructions, labels


def _is_branch(ins: Instruction) -> bool:
    """A jump; ptxas also jumps with a call to a label of the same function (``@P0 CALL.REL.NOINC `(.L_x_0)``, a
    loop's exit on sm_80), unlike a call of a subroutine (``$__internal_...``)."""
    base = ins.opcode.split(".")[0]
    return base in ("BRA", "BRX", "JMP", "JMX") or (base == "CALL" and not (ins.target or "$").startswith("$"))


def _ends_block(ins: Instruction) -> bool:
    base = ins.opcode.split(".")[0]
    return _is_branch(ins) or base in ("RET", "EXIT", "KILL")


@dataclass
class Block:
    start: int
    instructions: list[Instruction]
    successors: list[int] = field(default_factory=list)
    """Block indices: [target, fallthrough] for a conditional branch."""


def basic_blocks(instructions: list[Instruction], labels: dict[str, int]) -> list[Block]:
    """The kernel function's basic blocks (subroutines after it are left out; a call is not a block end)."""
    end = min([index for name, index in labels.items() if name.startswith("$")] + [len(instructions)])
    leaders = {0}
    leaders.update(index for index in labels.values() if index < end)
    for index, ins in enumerate(instructions[:end]):
        if _ends_block(ins) and index + 1 < end:
            leaders.add(index + 1)
    starts = sorted(leaders)
    blocks = [Block(s, instructions[s:e]) for s, e in zip(starts, starts[1:] + [end], strict=True)]
    index_of = {block.start: i for i, block in enumerate(blocks)}
    for i, block in enumerate(blocks):
        last = block.instructions[-1]
        following = [i + 1] if i + 1 < len(blocks) else []
        base = last.opcode.split(".")[0]
        if _is_branch(last):
            target = labels.get(last.target or "")
            targets = [index_of[target]] if target in index_of else []
            unconditional = not last.predicate and ".DIV" not in last.opcode
            block.successors = targets if unconditional else targets + following
        elif base in ("RET", "EXIT", "KILL") and not last.predicate:
            block.successors = []
        else:
            block.successors = following
    return blocks


def _post_dominators(blocks: list[Block]) -> list[int | None]:
    """Immediate post-dominator of each block (None: the exit)."""
    n = len(blocks)
    everyone = (1 << (n + 1)) - 1
    exit_bit = 1 << n
    pdom = [everyone] * n
    changed = True
    while changed:
        changed = False
        for i in reversed(range(n)):
            succs = blocks[i].successors
            meet = exit_bit if not succs else everyone
            for s in succs:
                meet &= pdom[s]
            new = meet | (1 << i)
            if new != pdom[i]:
                pdom[i], changed = new, True
    result: list[int | None] = []
    for i in range(n):
        strict = pdom[i] & ~(1 << i) & ~exit_bit
        candidates = [j for j in range(n) if strict >> j & 1]
        # the immediate one is post-dominated by all the others: the one with the most post-dominators
        result.append(max(candidates, key=lambda j: bin(pdom[j]).count("1")) if candidates else None)
    return result


# --------------------------------------------------------------------------------------------------------------
# Source: which arm of each `if` and how many trips of each `for` a configuration takes


@dataclass(frozen=True)
class _Construct:
    kind: str  # "if" | "for"
    arms: tuple[tuple[int, int], ...]  # (first line, last line): if: body, else; for: body
    source: str  # if: the test; for: the iterable
    head: tuple[int, int]  # lines of the `if`/`elif` test or the `for` header


@functools.cache
def _constructs(path: str) -> tuple[_Construct, ...]:
    """Every ``if`` and run-time ``for`` (over ``range``: ``tl.static_range`` unrolls) in the functions of ``path``."""
    try:
        text = Path(path).read_text()
        tree = ast.parse(text)
    except (OSError, SyntaxError):
        return ()

    def span(statements) -> tuple[int, int]:
        return statements[0].lineno, max(statement.end_lineno for statement in statements)

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            arms = (span(node.body),) + ((span(node.orelse),) if node.orelse else ())
            found.append(_Construct("if", arms, ast.get_source_segment(text, node.test),
                                    (node.lineno, node.test.end_lineno)))
        elif (isinstance(node, ast.For) and isinstance(node.iter, ast.Call) and isinstance(node.iter.func, ast.Name)
              and node.iter.func.id == "range"):
            found.append(_Construct("for", (span(node.body),), ast.get_source_segment(text, node.iter),
                                    (node.lineno, node.iter.end_lineno)))
    return tuple(found)


@functools.cache
def _line_arms(path: str) -> dict[int, tuple[tuple[int, int], ...]]:
    """line -> (construct index, arm) of every construct arm of ``path`` that contains it."""
    lines: dict[int, list] = {}
    for index, construct in enumerate(_constructs(path)):
        for arm, (first, last) in enumerate(construct.arms):
            for line in range(first, last + 1):
                lines.setdefault(line, []).append((index, arm))
    return {line: tuple(arms) for line, arms in lines.items()}


def _arm_keys(ins: Instruction) -> set[tuple[str, int, int]]:
    """(file, construct index, arm) of every arm the instruction's inlining chain lies in."""
    return {(path, index, arm) for path, line in ins.frames for index, arm in _line_arms(path).get(line, ())}


def _module_namespace(path: str) -> dict:
    """The numeric globals of the loaded module at ``path`` (``tl.constexpr`` values unwrapped), for the tests."""
    if path not in _NAMESPACES:
        for module in list(sys.modules.values()):
            file = getattr(module, "__file__", None)
            if file and os.path.realpath(file) == os.path.realpath(path):
                values = {name: getattr(value, "value", value) for name, value in vars(module).items()}
                _NAMESPACES[path] = {k: v for k, v in values.items() if isinstance(v, int | float | bool)}
                break
        else:
            return {}  # not imported (yet): not remembered
    return _NAMESPACES[path]


_NAMESPACES: dict[str, dict] = {}


class Decisions:
    """What a configuration does at each ``if`` (the arm taken: 0 body, 1 else) and ``for`` (trips) of the sources.

    A test is evaluated on the configuration's ``names`` (compile-time constants and run-time facts, e.g. ``dtype``)
    over the module's numeric globals; ``names`` may also map a test's exact source text to its outcome. A test that
    reads anything else is undecided (None): a compile-time test of a helper's own parameter, which leaves no branch.
    """

    def __init__(self, names: dict):
        self.names = names
        self._cache: dict[tuple[str, int], int | None] = {}

    def __call__(self, path: str, index: int) -> int | None:
        key = (path, index)
        if key not in self._cache:
            self._cache[key] = self._decide(path, _constructs(path)[index])
        return self._cache[key]

    def _decide(self, path: str, construct: _Construct) -> int | None:
        if construct.source in self.names:
            outcome = self.names[construct.source]
        else:
            scope = {**_module_namespace(path), **self.names}
            try:
                outcome = eval(construct.source, {"__builtins__": {"range": range, "len": len}}, scope)  # noqa: S307
            except Exception:
                return None
        if construct.kind == "for":
            return len(outcome) if isinstance(outcome, range) else int(outcome)
        return 0 if outcome else 1

    def goes(self, key: tuple[str, int, int]) -> bool | None:
        """Whether the configuration runs code in arm ``key`` (None: undecided)."""
        path, index, arm = key
        outcome = self(path, index)
        if outcome is None:
            return None
        return outcome > 0 if _constructs(path)[index].kind == "for" else outcome == arm

    def sign(self, ins: Instruction, context: frozenset = frozenset()) -> int:
        """-1 if the instruction lies in an arm the configuration does not run, +1 if in one it runs, else 0; arms of
        the constructs in ``context`` ((file, construct index) pairs) are left out."""
        verdicts = {self.goes(key) for key in _arm_keys(ins) if key[:2] not in context}
        return -1 if False in verdicts else 1 if True in verdicts else 0


# --------------------------------------------------------------------------------------------------------------
# The main path

_RARE = re.compile(r"^CALL\S*\s+`\(\$|^BRA\.DIV")
"""Calls of compiler subroutines (the slow paths of IEEE division and square root for special operands, 64-bit
integer division when the operands do not fit 32 bits) and branches taken only by diverged warps."""


@dataclass
class Sass:
    """A binary's disassembly and control flow (configuration-independent, cached per binary)."""

    instructions: list[Instruction]
    labels: dict[str, int]
    blocks: list[Block]
    ipdom: list[int | None]
    arms: list[collections.Counter] = field(default_factory=list)
    """Per block: instructions per (file, construct index, arm)."""
    rare: list[bool] = field(default_factory=list)
    _regions: dict = field(default_factory=dict)

    def region(self, start: int, stop: int | None) -> frozenset[int]:
        """Blocks reachable from ``start`` before ``stop`` (a branch's immediate post-dominator)."""
        key = (start, stop)
        if key not in self._regions:
            seen, todo = set(), [start]
            while todo:
                b = todo.pop()
                if b == stop or b in seen:
                    continue
                seen.add(b)
                todo.extend(self.blocks[b].successors)
            self._regions[key] = frozenset(seen)
        return self._regions[key]


@functools.lru_cache(maxsize=8)
def read_sass(cubin: bytes) -> Sass:
    """Disassemble ``cubin`` and build its control-flow graph (cached: rows sharing a binary read it once)."""
    instructions, labels = disassemble(cubin)
    blocks = basic_blocks(instructions, labels)
    sass = Sass(instructions, labels, blocks, _post_dominators(blocks))
    for block in blocks:
        counter = collections.Counter()
        for ins in block.instructions:
            counter.update(_arm_keys(ins))
        sass.arms.append(counter)
        sass.rare.append(any(_RARE.search(ins.text) for ins in block.instructions))
    return sass


@dataclass
class MainPath:
    instructions: int
    """Instructions executed per thread."""
    ambiguous: int
    """Branches no rule decided (the larger side was followed)."""
    blocks: list[int]
    """Blocks walked, in order."""
    rules: collections.Counter = field(default_factory=collections.Counter)
    """How many branches each rule decided (test, split, rare, evidence, loop, ambiguous)."""


def _by_construct(sass: Sass, region: frozenset[int]) -> dict[tuple[str, int], list[int]]:
    counts: dict[tuple[str, int], list[int]] = {}
    for b in region:
        for (path, index, arm), n in sass.arms[b].items():
            counts.setdefault((path, index), [0, 0])[arm] += n
    return counts


def _majority(counts: Sequence[int] | None) -> int | None:
    return None if not counts or not sum(counts) else int(counts[1] > counts[0])


def _tested_if(ins: Instruction) -> tuple[str, int] | None:
    """The ``if`` whose test line the branch instruction is attributed to (innermost frame first)."""
    for path, line in ins.frames:
        for index, construct in enumerate(_constructs(path)):
            if construct.kind == "if" and construct.head[0] <= line <= construct.head[1]:
                return path, index
    return None


def _choose(sass: Sass, decisions: Decisions, branch: int, stop: int | None) -> tuple[int | None, str]:
    """(the successor the configuration takes at the forward conditional branch ending block ``branch`` or None,
    the rule that decided)."""
    successors = sass.blocks[branch].successors
    both = [sass.region(s, stop) for s in successors]
    regions = [both[0] - both[1], both[1] - both[0]]  # what each side runs that the other does not
    counts = [_by_construct(sass, region) for region in regions]
    # The constructs the branch lies in: code of their other arms on either side was shared by the compiler
    # between both copies (its line information names one of them), so they say nothing here.
    context = frozenset(key[:2] for key in _arm_keys(sass.blocks[branch].instructions[-1]))

    # 1. A side holding only code the configuration does not run (an arm not taken, a loop that does not run) is
    #    not taken, when the other side holds code it runs.
    signs = [{decisions.sign(ins, context) for b in region for ins in sass.blocks[b].instructions}
             for region in regions]
    possible = [s for s, found in zip(successors, signs, strict=True) if not (-1 in found and 1 not in found)]
    if len(possible) == 1 and any(1 in found for found in signs):
        return possible[0], "evidence"

    def by_arm(key: tuple[str, int], outcome: int) -> int | None:
        """The only side holding the arm taken of ``if`` ``key``, else the only side without the arm not taken
        (an `if` without `else`, skipped), else the side where the arm taken is the majority."""
        sides = [c.get(key, [0, 0]) for c in counts]
        for found in ([side[outcome] > 0 for side in sides], [side[1 - outcome] == 0 for side in sides]):
            if found.count(True) == 1:
                return successors[found.index(True)]
        majority = [_majority(side) for side in sides]
        if majority[0] != majority[1] and outcome in majority:
            return successors[majority.index(outcome)]
        return None

    # 2. The `if` whose test the branch is attributed to: the side holding the arm the configuration takes.
    tested = _tested_if(sass.blocks[branch].instructions[-1])
    if tested is not None and decisions(*tested) is not None:
        chosen = by_arm(tested, decisions(*tested))
        if chosen is not None:
            return chosen, "test"

    # 3. Else a decided `if` (not one the branch lies in) whose arms split the two sides (their majority arms
    #    differ), the one with the most instructions there.
    best, best_weight = None, 0
    for key in set(counts[0]) | set(counts[1]):
        outcome = decisions(*key)
        if outcome is None or _constructs(key[0])[key[1]].kind != "if" or key in context:
            continue
        sides = [c.get(key, [0, 0]) for c in counts]
        majority = [_majority(side) for side in sides]
        weight = sum(map(sum, sides))
        if majority[0] != majority[1] and weight > best_weight:
            best, best_weight = key, weight
    if best is not None:
        chosen = by_arm(best, decisions(*best))
        if chosen is not None:
            return chosen, "split"

    # 4. A slow path (or a diverged warp) is not the main path.
    common = [s for s, region in zip(successors, regions, strict=True) if not any(sass.rare[b] for b in region)]
    if len(common) == 1:
        return common[0], "rare"

    # 5. The side holding code the configuration runs (e.g. a loop body that runs, against the guard that skips it).
    running = [s for s, found in zip(successors, signs, strict=True) if 1 in found and s in possible]
    if len(running) == 1:
        return running[0], "evidence"

    # 6. A guard (one side skips straight to the join): the side with the code, which a warp issues when any of
    #    its threads runs it (e.g. a load under a mask that a full tile never clears).
    sized = [s for s, region in zip(successors, regions, strict=True) if region]
    if len(sized) == 1:
        return sized[0], "guard"
    return None, "ambiguous"


def _loop_of(latch: Instruction) -> tuple[str, int] | None:
    """The source ``for`` a loop's backward branch belongs to: the one whose header line the branch is attributed to
    (innermost frame first); None for a loop of the compiler's or a library's own."""
    for path, line in latch.frames:
        for index, construct in enumerate(_constructs(path)):
            if construct.kind == "for" and construct.head[0] <= line <= construct.head[1]:
                return path, index
    return None


def _top_tested_loops(sass: Sass) -> dict[int, tuple[int, int, tuple[str, int] | None]]:
    """Loops whose body ends with an unconditional backward branch: their exit tests, as {block ending in the exit
    test: (loop header, the loop's last block, source ``for``)}. The exit test is the conditional branch in the loop,
    attributed to the same ``for`` header, with one side leaving the loop."""
    exits = {}
    for latch, block in enumerate(sass.blocks):
        if len(block.successors) != 1 or sass.blocks[block.successors[0]].start > block.start:
            continue
        header = block.successors[0]
        loop = _loop_of(block.instructions[-1])
        for b in range(header, latch + 1):
            successors = sass.blocks[b].successors
            if (len(successors) == 2 and _loop_of(sass.blocks[b].instructions[-1]) == loop
                    and sum(not header <= s <= latch for s in successors) == 1):
                exits[b] = (header, latch, loop)
    return exits


def main_path(sass: Sass, names: dict, limit: int = 10_000_000) -> MainPath:
    """The main path through the kernel for a configuration whose tests see ``names`` (see the module docstring).

    Args:
        sass: the binary's :func:`read_sass`.
        names: compile-time constants and run-time facts of the configuration.
        limit (default 10M): most instructions walked (a guard against a loop that never ends).
    """
    decisions = Decisions(names)
    blocks = sass.blocks
    exit_tests = _top_tested_loops(sass)
    count, ambiguous, walked, latch_taken, rules = 0, 0, [], {}, collections.Counter()
    headers = {header for header, _, _ in exit_tests.values()}
    visits: dict[int, int] = {}  # header of a loop ending in an unconditional branch -> arrivals since it was entered
    current: int | None = 0

    def trips_of(loop: tuple[str, int] | None) -> int:
        nonlocal ambiguous
        rules["loop"] += 1
        trips = decisions(*loop) if loop is not None else None
        if trips is None:  # a loop of the compiler's, or an undecided one: the body once
            ambiguous += 1
            return 1
        return trips

    while current is not None:
        block = blocks[current]
        walked.append(current)
        count += len(block.instructions)
        if current in headers:
            visits[current] = visits.get(current, 0) + 1
        if count > limit:
            raise RuntimeError(f"main path longer than {limit} instructions: a loop without a known trip count")
        if len(block.successors) <= 1:
            current = block.successors[0] if block.successors else None
            continue
        target, fallthrough = block.successors
        if current in exit_tests:  # the exit test of such a loop: leave once the body ran trips times
            header, latch, loop = exit_tests[current]
            inside, outside = sorted(block.successors, key=lambda s: not header <= s <= latch)
            runs = visits.get(header, 0) - (current == header)  # a test in the header runs before the body
            if runs < trips_of(loop):
                current = inside
            else:
                visits[header], current = 0, outside
            continue
        if blocks[target].start <= block.start:  # a loop's latch at the bottom: taken trips - 1 times
            trips = trips_of(_loop_of(block.instructions[-1]))
            done = latch_taken.get(current, 0)
            if done + 1 < trips:
                latch_taken[current], current = done + 1, target
            else:
                latch_taken[current], current = 0, fallthrough
            continue
        chosen, rule = _choose(sass, decisions, current, sass.ipdom[current])
        rules[rule] += 1
        if chosen is None:
            ambiguous += 1
            regions = {s: sass.region(s, sass.ipdom[current]) for s in block.successors}
            chosen = max(block.successors, key=lambda s: sum(len(blocks[b].instructions) for b in regions[s]))
        current = chosen
    return MainPath(count, ambiguous, walked, rules)


# --------------------------------------------------------------------------------------------------------------
# Measuring


def _names(config: LaunchConfig) -> dict:
    return {**{k: getattr(v, "value", v) for k, v in config.constexprs.items()}, **config.facts}


def measure(config: LaunchConfig, arch: str, compiled: Compiled | None = None) -> dict:
    """One table row: ``config`` compiled for ``arch`` (or its ``compiled`` binary) and read back.

    Args:
        config: the configuration.
        arch: a key of :data:`ARCHES`.
        compiled (default None): its binary for ``arch`` from :func:`compile_config` (compiled here when None).
    """
    if compiled is None:
        compiled = compile_config(config, arch)
    limits = ARCHES[arch]
    res = resources(compiled)
    sass = read_sass(compiled.cubin)
    local = sum(1 for ins in sass.instructions if ins.opcode.split(".")[0] in ("LDL", "STL"))
    smem = compiled.dynamic_smem + max(res["static_smem"], limits.reserved_smem)
    occ, blocks, limiter = occupancy(res["regs"], smem, compiled.num_warps, limits)
    row = {"config": config.name, "group": config.group, "arch": arch, "num_warps": compiled.num_warps, **res,
           "local_instructions": local, "smem": smem, "occupancy": occ, "blocks_per_sm": blocks,
           "occupancy_limiter": limiter, "sass_instructions": len(sass.instructions),
           "compile_seconds": compiled.seconds, "elements_per_program": config.elements_per_program,
           "path_instructions": None, "instructions_per_element": None, "ambiguous_branches": None,
           "loads_per_element": None}
    if config.elements_per_program:
        try:
            path = main_path(sass, _names(config))
        except RuntimeError as error:  # the binary's other numbers still stand
            row["analysis_error"] = str(error)
        else:
            row["path_instructions"] = path.instructions
            row["ambiguous_branches"] = path.ambiguous
            row["instructions_per_element"] = (path.instructions * compiled.num_warps * 32
                                               / config.elements_per_program)
            loads = sum(1 for b in path.blocks for ins in sass.blocks[b].instructions
                        if ins.opcode.split(".")[0] == "LDG")
            row["loads_per_element"] = loads * compiled.num_warps * 32 / config.elements_per_program
    if config.stream is not None:
        row["bytes_per_element"] = config.stream.bytes_per_element()
    return row


# --------------------------------------------------------------------------------------------------------------
# Prediction (Llama-3.2-1B full set)


def llama_numels() -> list[int]:
    """Element counts of the Llama-3.2-1B tensors the optimizers step (benchmarks/performance/step_time.py's set)."""
    sys.path.insert(0, str(ROOT / "benchmarks" / "performance"))
    try:
        from step_time import PRESETS  # noqa: PLC0415
    finally:
        sys.path.remove(str(ROOT / "benchmarks" / "performance"))
    return [math.prod(shape) for shape in PRESETS["llama-3.2-1b"]()]


def min_8bit_size() -> int:
    from hf_optim.optim.options import BY_NAME  # noqa: PLC0415

    return BY_NAME["min_8bit_size"].default


def predict(rows: list[dict], configs: dict[str, LaunchConfig], numels: Sequence[int]) -> None:
    """Add the H100 / T4 step-time prediction to the rows of fused elementwise configurations (in place).

    Args:
        rows: measured rows (:func:`measure`).
        configs: the configurations by name.
        numels: the tensor set's element counts.
    """
    from hf_optim.formats import FP32  # noqa: PLC0415

    small = min_8bit_size()
    by_key = {(row["config"], row["arch"]): row for row in rows}
    for row in rows:
        config = configs.get(row["config"])
        if (config is None or config.stream is None or not config.main
                or row.get("instructions_per_element") is None):
            continue
        for gpu in GPUS:
            if row["arch"] != gpu.arch:
                continue
            twin = by_key.get((config.fp32_state_twin, gpu.arch), row) if config.fp32_state_twin else row
            per_program = config.elements_per_program
            total_bytes, warp_instructions = 0.0, 0.0
            for n in numels:
                quantized = n >= small
                fmt = None if quantized else FP32
                source = row if quantized else twin
                total_bytes += n * config.stream.bytes_per_element(fmt)
                padded = -(-n // per_program) * per_program
                warp_instructions += padded * source["instructions_per_element"] / 32
            bandwidth = total_bytes / gpu.bandwidth
            issue = gpu.issue_seconds(warp_instructions)
            row[f"{gpu.name}_bandwidth_ms"] = bandwidth * 1e3
            row[f"{gpu.name}_issue_ms"] = issue * 1e3
            row[f"{gpu.name}_predicted_ms"] = max(bandwidth, issue) * 1e3


# --------------------------------------------------------------------------------------------------------------
# Facts of the main path

FULL_TILE = {"first_block": 0, "n": 1 << 40}
"""Run-time facts of a program whose tile lies wholly inside its tensor (for kernels that test it at run time)."""
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _dtype_facts(dtype: str) -> dict:
    """The kernels' code of parameter dtype ``dtype`` (``fp32``, ``bf16``, ``fp16``) and its bytes per element."""
    import torch  # noqa: PLC0415

    from hf_optim.kernels.triton_path.tile import dtype_code  # noqa: PLC0415

    torch_dtype = getattr(torch, DTYPE_NAMES[dtype])
    return {"dtype": dtype_code(torch_dtype), "param_bytes": torch_dtype.itemsize}


# --------------------------------------------------------------------------------------------------------------
# The configurations: the kernels layer's enumerator (hf_optim.kernels.triton_path.configs)


def kernel_layer_configs() -> tuple[list[LaunchConfig], list[str]]:
    """(every configuration ``hf_optim.kernels.triton_path.configs.kernel_specs`` lists for the registered algorithms,
    the configurations one AdamW8bit step with bf16 parameters launches: ``step_specs``). The layer enumerates per
    arch (a few configurations take another tile width on some arches): each configuration is kept for the arches
    it is launched on."""
    import hf_optim  # noqa: F401, PLC0415  (registers the algorithms)
    from hf_optim.kernels.triton_path import configs as layer  # noqa: PLC0415
    from hf_optim.optim import registry  # noqa: PLC0415

    algorithms = [(family.algorithm, family.base._supported_formats()) for family in registry.families()]
    configs = [_from_spec(spec, arch) for arch in ARCHES
               for spec in layer.kernel_specs(algorithms, arch=ARCHES[arch].cc)]
    dtype = _dtype_facts("bf16")["dtype"]
    cold = [spec.name for spec in layer.step_specs(registry.lookup_algorithm("adamw").algorithm, "blockwise8", dtype)]
    return configs, cold


def _from_spec(spec, arch: str | None = None) -> LaunchConfig:
    """A :class:`LaunchConfig` of a ``triton_configs.LaunchSpec`` (its bytes model from its dtype and formats),
    launched on ``arch`` (None: every arch)."""
    stream = None
    if spec.param_dtype is not None and spec.group in ("fused", "lamb"):
        param_bytes = _dtype_facts(spec.param_dtype)["param_bytes"]
        if spec.state_rows:  # a fused update (LAMB's direction pass writes the fp32 direction, not the parameter)
            stream = Stream(param_bytes, spec.state_format, spec.state_rows, param_write=not spec.writes_direction,
                            out_write=4 if spec.writes_direction else 0)
        elif spec.group == "lamb":  # LAMB's apply pass: p -= lr * ratio * direction
            stream = Stream(param_bytes, None, 0, grad_read=False, out_read=4)
    facts = dict(FULL_TILE) if spec.main else {"first_block": 0, "n": 1}
    config = LaunchConfig(spec.name, spec.kernel, spec.signature, spec.constexprs, num_warps=spec.num_warps,
                          options=dict(spec.options), facts=facts, elements_per_program=spec.elements_per_program,
                          stream=stream, group=spec.group, fp32_state_twin=spec.fp32_state_twin,
                          launched_by=spec.launched_by, main=spec.main, specialization=spec.attrs(), arch=arch)
    return config


# --------------------------------------------------------------------------------------------------------------
# Running: one compile per distinct binary and arch, in parallel processes if asked

_PLAN: list[tuple[list[LaunchConfig], str]] = []
"""(configurations sharing one binary, arch) per task; module state so forked workers inherit it."""


def _binary_id(config: LaunchConfig) -> str:
    import hashlib  # noqa: PLC0415

    return hashlib.sha1(repr(config.binary_key()).encode()).hexdigest()[:10]


def _run_task(index: int) -> list[dict]:
    configs, arch = _PLAN[index]
    try:
        compiled = compile_config(configs[0], arch)
    except Exception as error:  # one failure is a row, not the end of the run
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return [{"config": c.name, "group": c.group, "arch": arch, "binary": _binary_id(c), "error": first}
                for c in configs]
    rows = []
    for config in configs:
        row = measure(config, arch, compiled)
        row["binary"] = _binary_id(config)
        rows.append(row)
    return rows


def run(configs: Sequence[LaunchConfig], arches: Sequence[str], jobs: int = 1,
        progress: Callable[[str], None] | None = None) -> list[dict]:
    """Rows for every configuration and arch, compiling each distinct binary once per arch.

    Args:
        configs: the configurations.
        arches: keys of :data:`ARCHES`.
        jobs (default 1): parallel compile processes.
        progress (default None): called with a line per compiled binary.
    """
    groups: dict[tuple, list[LaunchConfig]] = {}
    for config in configs:
        groups.setdefault((config.binary_key(), config.arch), []).append(config)
    _PLAN[:] = [(members, arch) for arch in arches for members in groups.values() if members[0].arch in (None, arch)]
    results: list[list[dict]] = []
    if jobs > 1:
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            for rows in pool.imap(_run_task, range(len(_PLAN))):
                results.append(rows)
                if progress:
                    progress(_progress_line(rows, len(results), len(_PLAN)))
    else:
        for index in range(len(_PLAN)):
            results.append(_run_task(index))
            if progress:
                progress(_progress_line(results[-1], len(results), len(_PLAN)))
    order = {(c.name, a): i for i, (c, a) in enumerate((c, a) for c in configs for a in arches
                                                      if c.arch in (None, a))}
    rows = sorted((row for chunk in results for row in chunk), key=lambda r: order[(r["config"], r["arch"])])
    predict(rows, {c.name: c for c in configs}, llama_numels())
    return rows


def _progress_line(rows: list[dict], done: int, total: int) -> str:
    first = rows[0]
    what = first.get("error") or f"{first['regs']} regs, {first['compile_seconds']:.1f} s"
    return f"[{done}/{total}] {first['arch']} {first['config']} (+{len(rows) - 1} rows on this binary): {what}"


# --------------------------------------------------------------------------------------------------------------
# Checks (the CI test asserts these)


def problems(rows: Iterable[dict]) -> list[str]:
    """One line per row that failed to compile, spills, or uses local memory."""
    found = []
    for row in rows:
        where = f"{row['config']} on {row['arch']}"
        if "error" in row:
            found.append(f"{where}: does not compile: {row['error']}")
            continue
        if row["spill_stores"] or row["spill_loads"]:
            found.append(f"{where}: spills {row['spill_stores']} B stored, {row['spill_loads']} B loaded")
        if row["local_bytes"] or row["local_instructions"]:
            found.append(f"{where}: local memory {row['local_bytes']} B, {row['local_instructions']} LDL/STL")
    return found


def cold_start(rows: Sequence[dict], config_names: Iterable[str], arch: str) -> float | None:
    """Seconds to compile every distinct binary behind ``config_names`` on ``arch`` (one step's first launch)."""
    seconds = {row["binary"]: row["compile_seconds"] for row in rows
               if row["config"] in config_names and row["arch"] == arch and "error" not in row}
    return sum(seconds.values()) if seconds else None


# --------------------------------------------------------------------------------------------------------------
# Output

COLUMNS = ("config", "arch", "warps", "regs", "spill st/ld", "local", "smem", "occ", "inst/el", "ld/el", "compile s",
           "bw-bound ms", "predicted ms")


def _cells(row: dict) -> list[str]:
    if "error" in row:
        return [row["config"], row["arch"], "compile error: " + row["error"][:60]] + [""] * (len(COLUMNS) - 3)
    ipe = row["instructions_per_element"]
    ipe_text = "-" if ipe is None else f"{ipe:.0f}" + ("?" if row["ambiguous_branches"] else "")
    if "analysis_error" in row:
        ipe_text = "err"
    gpu = next((g for g in GPUS if g.arch == row["arch"]), None)
    bw = row.get(f"{gpu.name}_bandwidth_ms") if gpu else None
    predicted = row.get(f"{gpu.name}_predicted_ms") if gpu else None
    bound = ""
    if predicted is not None:
        bound = " issue" if predicted > bw * 1.0001 else ""
    return [row["config"], row["arch"], str(row["num_warps"]), str(row["regs"]),
            f"{row['spill_stores']}/{row['spill_loads']}", str(row["local_instructions"]), str(row["smem"]),
            f"{row['occupancy']:.0%} ({row['occupancy_limiter']})", ipe_text, _loads_text(row),
            f"{row['compile_seconds']:.1f}",
            "" if bw is None else f"{gpu.name} {bw:.2f}", "" if predicted is None else f"{predicted:.2f}{bound}"]


def _loads_text(row: dict) -> str:
    loads = row.get("loads_per_element")  # absent in --json files written before the column
    return "-" if loads is None or "analysis_error" in row else f"{loads:.2f}"


def caption(environment: dict) -> str:
    return (f"Triton {environment['triton']}, {environment['date']}, {environment['machine']}; "
            "occupancy at the launch's warps (limiter); inst/el: main-path SASS instructions per element; "
            "ld/el: main-path global loads (LDG) per element; "
            "step times: Llama-3.2-1B full set, sm_90 rows on an H100 SXM, sm_75 rows on a T4 "
            "('issue': issue-bound)")


def summary(rows: Sequence[dict], cold_start_configs: Iterable[str] = ()) -> list[str]:
    """Lines under the table: the cold start of ``cold_start_configs`` (the binaries one AdamW8bit step with bf16
    parameters launches), the problems, undecided branches and main paths not found."""
    lines = []
    for arch in sorted({row["arch"] for row in rows}):
        seconds = cold_start(rows, cold_start_configs, arch)
        if seconds is not None:
            lines.append(f"cold start on {arch}: compiling every binary one AdamW8bit step (bf16 params, "
                         f"Llama-3.2-1B set) launches takes {seconds:.1f} s here")
    found = problems(rows)
    lines.append(f"{len(rows)} rows, {len({(r['binary'], r['arch']) for r in rows})} binaries compiled; "
                 + ("no spills, no local memory, every configuration compiles" if not found
                    else f"{len(found)} problems:"))
    lines.extend("  " + line for line in found)
    ambiguous = [r for r in rows if r.get("ambiguous_branches")]
    if ambiguous:
        lines.append(f"{len(ambiguous)} rows have branches the main-path analysis could not decide (marked '?')")
    lines.extend(f"main path of {r['config']} on {r['arch']} not found: {r['analysis_error']}" for r in rows
                 if "analysis_error" in r)
    return lines


def print_table(rows: Sequence[dict], environment: dict) -> None:
    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    table = Table(title="Triton kernels compiled ahead of time", caption=caption(environment))
    for column in COLUMNS:
        table.add_column(column, justify="left" if column in ("config", "arch") else "right",
                         no_wrap=column == "config")
    for row in rows:
        table.add_row(*_cells(row))
    console = Console(width=max(160, Console().width))
    console.print(table)
    for line in summary(rows, environment.get("cold_start", ())):
        console.print(line)


def markdown(rows: Sequence[dict], environment: dict) -> str:
    """The rows as one Markdown table with a line per configuration and the arches side by side (``a/b/...`` in
    the order of the header), for docs/benchmarks.md; then the caption and the summary."""
    arches = [arch for arch in ARCHES if any(row["arch"] == arch for row in rows)]
    by_config: dict[str, dict[str, dict]] = {}
    for row in rows:
        by_config.setdefault(row["config"], {})[row["arch"]] = row
    each = "/".join(arch.removeprefix("sm_") for arch in arches)
    gpus = [gpu for gpu in GPUS if gpu.arch in arches]
    header = (["config", "warps", f"regs ({each})", f"occupancy % ({each})", f"spill B ({each})", f"smem B ({each})",
               f"inst/el ({each})", f"ld/el ({each})", f"compile s ({each})"]
              + [f"{gpu.name} ms: bw / predicted" for gpu in gpus])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]

    def joined(cells: dict[str, dict], value: Callable[[dict], str]) -> str:
        return "/".join(value(cells[a]) if a in cells and "error" not in cells[a] else "err" for a in arches)

    for name, cells in by_config.items():
        first = next((row for row in cells.values() if "error" not in row), None)
        if first is None:
            lines.append(f"| {name} | compile error on every arch: {next(iter(cells.values()))['error'][:80]} |")
            continue
        ipe = joined(cells, lambda r: "err" if "analysis_error" in r else "-" if r["instructions_per_element"] is None
                     else f"{r['instructions_per_element']:.0f}" + ("?" if r["ambiguous_branches"] else ""))
        line = [name, str(first["num_warps"]), joined(cells, lambda r: str(r["regs"])),
                joined(cells, lambda r: f"{100 * r['occupancy']:.0f}"),
                joined(cells, lambda r: str(r["spill_stores"] + r["spill_loads"])),
                joined(cells, lambda r: str(r["smem"])), ipe, joined(cells, _loads_text),
                joined(cells, lambda r: f"{r['compile_seconds']:.1f}")]
        for gpu in gpus:
            row = cells.get(gpu.arch, {})
            bw, predicted = row.get(f"{gpu.name}_bandwidth_ms"), row.get(f"{gpu.name}_predicted_ms")
            issue = " (issue)" if bw is not None and predicted > bw * 1.0001 else ""
            line.append("" if bw is None else f"{bw:.2f} / {predicted:.2f}{issue}")
        lines.append("| " + " | ".join(line) + " |")
    notes = [("  - " + line.strip()) if line.startswith("  ") else "- " + line
             for line in summary(rows, environment.get("cold_start", ()))]
    return "\n".join([*lines, "", caption(environment) + ".", "", *notes])


def environment(argv: Sequence[str]) -> dict:
    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    return {"triton": triton.__version__, "date": datetime.date.today().isoformat(),
            "machine": f"{platform.machine()} {os.cpu_count()} cores, load {load[0]:.1f} at start",
            "command": "python benchmarks/gpu/gpu_static.py " + " ".join(argv)}


def merge(runs: Sequence[dict]) -> dict:
    """One saved run from several (``--json`` files of arch subsets): rows in configuration order, a later run's row
    replacing an earlier one for the same configuration and arch."""
    configs = list(dict.fromkeys(name for run in runs for name in run["configs"]))
    arches = [arch for arch in ARCHES if any(arch in run["arches"] for run in runs)]
    rows = {(row["config"], row["arch"]): row for run in runs for row in run["rows"]}
    order = {key: i for i, key in enumerate((c, a) for c in configs for a in arches)}
    environment = dict(runs[0]["environment"])
    if len(runs) > 1:
        environment["command"] = " ; ".join(run["environment"]["command"] for run in runs)
        environment["machine"] = " ; ".join(dict.fromkeys(run["environment"]["machine"] for run in runs))
    return {"environment": environment, "arches": arches, "configs": configs,
            "rows": sorted(rows.values(), key=lambda row: order.get((row["config"], row["arch"]), len(order)))}


def select(configs: Sequence[LaunchConfig], kernels: str | None) -> list[LaunchConfig]:
    """The configurations whose name contains one of the comma-separated ``kernels`` substrings."""
    if not kernels:
        return list(configs)
    wanted = [word.strip() for word in kernels.split(",") if word.strip()]
    chosen = [c for c in configs if any(word in c.name for word in wanted)]
    if not chosen:
        groups = sorted({c.name.split(" ")[0] for c in configs})
        raise SystemExit(f"--kernels {kernels!r} matches no configuration; names look like: {', '.join(groups)}")
    return chosen


def parse_arches(text: str) -> list[str]:
    arches = [a.strip() if a.strip().startswith("sm_") else f"sm_{a.strip()}" for a in text.split(",") if a.strip()]
    unknown = [a for a in arches if a not in ARCHES]
    if unknown or not arches:
        raise SystemExit(f"--arch {text!r}: unknown {', '.join(unknown) or 'empty'}; use some of {', '.join(ARCHES)}")
    return arches


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default=",".join(ARCHES), help="comma-separated arches (default: all five)")
    parser.add_argument("--kernels", help="comma-separated substrings of configuration names (e.g. adamw,lamb/)")
    parser.add_argument("--json", type=Path, help="also write every row as JSON to this file")
    parser.add_argument("--jobs", type=int, default=1, help="parallel compile processes (default 1)")
    parser.add_argument("--from-json", type=Path, nargs="+", help="render saved --json runs (merged) instead of "
                        "compiling")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    parser.add_argument("--list", action="store_true", help="list the configurations and exit")
    parser.add_argument("--check", action="store_true", help="exit 1 if a configuration spills, uses local memory "
                        "or fails to compile")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: must be at least 1")
    if args.from_json:
        unreadable = [str(path) for path in args.from_json if not path.is_file()]
        if unreadable:
            parser.error(f"--from-json: no such file: {', '.join(unreadable)} (write one with --json)")
        saved = merge([json.loads(path.read_text()) for path in args.from_json])
        rows, env = saved["rows"], saved["environment"]
        if args.json:
            args.json.write_text(json.dumps(saved, indent=1))
    else:
        every, cold = kernel_layer_configs()
        configs = select(every, args.kernels)
        if args.list:
            for name in dict.fromkeys(config.name for config in configs):
                print(name)
            return 0
        arches = parse_arches(args.arch)
        env = {**environment(argv), "cold_start": cold}
        with tempfile.TemporaryDirectory(prefix="gpu_static_cache_") as cache:
            os.environ.setdefault("TRITON_CACHE_DIR", cache)  # cold compiles, and no other run's cache touched
            knobs.cache.dir = os.environ["TRITON_CACHE_DIR"]
            rows = run(configs, arches, args.jobs, progress=lambda line: print(line, file=sys.stderr, flush=True))
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            names = list(dict.fromkeys(c.name for c in configs))  # one per name: the layer enumerates per arch
            saved = {"environment": env, "arches": arches, "configs": names, "rows": rows}
            args.json.write_text(json.dumps(saved, indent=1))
    if args.markdown:
        print(markdown(rows, env))
    else:
        print_table(rows, env)
    return 1 if args.check and problems(rows) else 0


if __name__ == "__main__":
    sys.exit(main())
