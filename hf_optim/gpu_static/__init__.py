"""The GPU kernels without a GPU: every Triton kernel configuration the optimizers launch, compiled ahead of time.

    python -m hf_optim.gpu_static                    # every configuration on sm_75, sm_80, sm_86, sm_89, sm_90
    python -m hf_optim.gpu_static --arch sm_90,sm_75 --kernels adamw --jobs 2
    python -m hf_optim.gpu_static --json benchmarks/gpu/results/gpu_static_after.json
    python -m hf_optim.gpu_static --from-json benchmarks/gpu/results/gpu_static_before.json --markdown

(``python benchmarks/gpu/gpu_static.py`` runs the same command line.)

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
  counted, found by a control-flow analysis of the SASS (the method: :mod:`hf_optim.gpu_static.main_path`). Loops
  count their trip count; kernels whose work is per tensor (reductions over per-tile partials) have no per-element
  count (``-``). A configuration off the main path (the masked kernel of a tensor's last, partial tile) shows its own
  count and gets no prediction.
- ``compile s``: wall seconds of ``triton.compile`` (front end, LLVM and ``ptxas``) for that arch, cold (Triton's
  cache is bypassed); one binary serves every row that shares its compile-time constants, and its seconds are shown
  on each of them. They depend on the machine and its load.
- For the fused elementwise configurations, the predicted step time on the Llama-3.2-1B full set (146 tensors,
  1.24e9 elements; tensors under ``min_8bit_size`` keep fp32 state, as the optimizers do) on an H100 SXM (sm_90:
  132 SMs, 1.98 GHz, 3.35 TB/s) and a T4 (sm_75: 40 SMs, 1.59 GHz, 320 GB/s): ``max(bandwidth bound, issue bound)``
  beside the bandwidth bound. Bandwidth bound = bytes / bandwidth, the bytes computed from the configuration's
  formats: parameter and gradient read, parameter written (or the fp32 direction written, LAMB), each state row read
  and written with its per-block absmax amortized. Issue bound = elements x instructions per element / 32 / (SMs x

Machine-readable output: ``--json PATH`` writes every row (and the environment); ``--from-json A.json [B.json ...]``
re-renders saved runs (merged: run arch subsets separately, then merge them with ``--json``); ``--markdown`` prints the
table as Markdown (for docs/benchmarks.md); ``--check`` exits 1 on a spill, local memory or a compile error.
Functions to reuse: :func:`compile_config`, :func:`measure`, :func:`resources`, :func:`read_sass`, :func:`main_path`,
:func:`occupancy`, :func:`predict`, :func:`problems`.

The modules, in the order a run uses them:

- :mod:`~hf_optim.gpu_static.targets`: the arches (their per-SM limits) and the GPUs whose step time is predicted;
- :mod:`~hf_optim.gpu_static.launch_config`: a configuration (one binary and its main path's facts), its bytes model;
- :mod:`~hf_optim.gpu_static.kernel_layer`: the configurations the kernels layer lists;
- :mod:`~hf_optim.gpu_static.compiling`: compiling one, its resources and occupancy;
- :mod:`~hf_optim.gpu_static.sass`: its disassembly, basic blocks and post-dominators;
- :mod:`~hf_optim.gpu_static.source`: the arm of each ``if`` and the trips of each ``for`` of the kernel sources;
- :mod:`~hf_optim.gpu_static.main_path`: the walk along the main path;
- :mod:`~hf_optim.gpu_static.measure`: one row, with instructions and global loads per element;
- :mod:`~hf_optim.gpu_static.predict`: the step-time prediction;
- :mod:`~hf_optim.gpu_static.runner`: every distinct binary compiled once per arch, in parallel processes if asked;
- :mod:`~hf_optim.gpu_static.report`: the checks, the summary, the rich and Markdown tables;
- :mod:`~hf_optim.gpu_static.cli`: the command line.

A tool on the package's top floor: it imports triton when imported, so nothing in hf_optim imports it (and ``import
hf_optim`` does not).
"""

import os

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    # Kernels defined under the interpreter cannot be compiled; this package only compiles. Turned off before the
    # modules below import triton, and before the kernels' modules (imported when the configurations are listed).
    os.environ["TRITON_INTERPRET"] = "0"

from hf_optim.gpu_static.cli import main, merge, parse_arches, select  # noqa: E402
from hf_optim.gpu_static.compiling import Compiled, compile_config, occupancy, resources  # noqa: E402
from hf_optim.gpu_static.control_flow import Sass, read_sass  # noqa: E402
from hf_optim.gpu_static.kernel_layer import FULL_TILE, kernel_layer_configs  # noqa: E402
from hf_optim.gpu_static.launch_config import LaunchConfig, Stream  # noqa: E402
from hf_optim.gpu_static.main_path import MainPath, main_path  # noqa: E402
from hf_optim.gpu_static.measure import measure  # noqa: E402
from hf_optim.gpu_static.predict import llama_numels, predict  # noqa: E402
from hf_optim.gpu_static.report import cold_start, markdown, print_table, problems, summary  # noqa: E402
from hf_optim.gpu_static.runner import run  # noqa: E402
from hf_optim.gpu_static.sass import Block, Instruction, disassemble  # noqa: E402
from hf_optim.gpu_static.source import Decisions  # noqa: E402
from hf_optim.gpu_static.targets import ARCHES, GPUS, Arch, Gpu  # noqa: E402

__all__ = [
    "ARCHES", "FULL_TILE", "GPUS", "Arch", "Block", "Compiled", "Decisions", "Gpu", "Instruction", "LaunchConfig",
    "MainPath", "Sass", "Stream", "cold_start", "compile_config", "disassemble", "kernel_layer_configs",
    "llama_numels", "main", "main_path", "markdown", "measure", "merge", "occupancy", "parse_arches", "predict",
    "print_table", "problems", "read_sass", "resources", "run", "select", "summary",
]
