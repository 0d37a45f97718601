"""A compiled CPU kernel: what it is specialized on, the probe inputs it is compiled on, and the compiled function.

Used by the training process (:mod:`hf_optim.kernels.torch_path.cpu_compile`: when to compile, what runs meanwhile)
and by the background worker (:mod:`hf_optim.kernels.torch_path.cpu_compile_worker`), which compile the same kernel the
same way.

The background worker compiles exactly what the training process compiles afterwards (:func:`run_probe`: the same
compiled function and code object name, probe inputs, dynamic marks, options and thread count), so the key of
inductor's cache is the same.

One graph per kernel: a kernel (:class:`Kernel`: rule, slot layouts, output mode, parameter and gradient dtypes,
stochastic rounding, and which stacked slots are slices of longer rows) is compiled once, on probe inputs of
:data:`PROBE_BLOCKS` blocks whose block dimension is marked dynamic and whose layout is the calls' (a stacked slot is
contiguous where its buffer is one chunk long, strided where it is longer), so every chunk length from 2 blocks up
shares the graph from the start (a chunk of one block runs eagerly: dynamo would specialize a dimension of size 1).
The calls pass aliases of their tensors that start at storage offset 0, are not views and have standard strides where
they are contiguous (:func:`canonical`, a DLPack round trip: no copy): dynamo guards on where a view starts, on the
shape of the tensor it views and on the stride of a dimension of size 1, and would compile again for the first chunk
of a buffer, for a tensor updated in place rather than gathered, and so on. A saved kernel whose guards still refuse
a call (a layout its probe did not have) never raises: that call runs eagerly, with the same results, and one
WARNING says so. The OpenMP thread count is part of a graph's guards too: the one-thread variant that
:mod:`hf_optim.kernels.torch_path.cpu_threads` may ask for is a second graph, compiled the same way when it is asked
for.

Compile options (:data:`INDUCTOR_OPTIONS`; the quickstart's AdamW8bit on a cold cache took 22 CPU seconds with them,
34 with inductor's defaults, ``benchmarks/performance/first_step.py``): ``cpp.vec_isa_ok=True`` trusts the CPU's flags
for its vector instruction sets instead of compiling a test program per set (an old compiler that lacks one then fails
the kernel's own compilation: a warning, the kernel runs eagerly); ``cpp_cache_precompile_headers=False`` skips a 150 MB
precompiled header that only pays off over many kernels; ``compile_threads=1``: one generated kernel per graph gains
nothing from a pool of compile processes, and none is started.
"""

from __future__ import annotations

import logging
import sys
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.dlpack import from_dlpack, to_dlpack

from hf_optim.formats import SlotLayout
from hf_optim.formats.base import zeroed_buffer
from hf_optim.kernels.torch_path import compiled_artifact, cpu_threads, elementwise
from hf_optim.numerics import BLOCK_SIZE

PROBE_BLOCKS = 37
"""Blocks of the probe inputs a kernel is compiled on: a prime, so that no static size of any format (1 or 2 rows,
256 elements or 128 bytes per block, maps and tables) is a multiple of it and only the block dimensions vary."""

INDUCTOR_OPTIONS = {"compile_threads": 1, "cpp_cache_precompile_headers": False, "cpp.vec_isa_ok": True}
"""Inductor settings for these compilations only (see the module docstring)."""


@dataclass(frozen=True)
class Kernel:
    """What a compiled graph is specialized on (besides the OpenMP thread count)."""

    rule: Callable
    layouts: tuple[SlotLayout, ...]
    rows: tuple[int, ...]
    """Stacked EMAs per slot (AdEMAMix's first slot has 2)."""
    has_out: bool
    param_dtype: torch.dtype
    grad_dtype: torch.dtype
    stochastic: bool
    spread: tuple[bool, ...]
    """Per slot: whether its raw tensors are not contiguous, because the slot stacks rows (AdEMAMix's two EMAs) and
    the call's chunk is a slice of longer rows. The compiled graph's guards tell the two layouts apart (a stacked slot
    whose buffer is one chunk long is contiguous), so each is a kernel of its own, compiled on probes of its layout."""

    def describe(self) -> str:
        """``adamw_rule, blockwise8 + blockwise8 state, float32 parameters`` (for the log lines: each slot's format by
        its name, which tells fp8 from blockwise8 where a bit count would not)."""
        state = " + ".join(layout.format.name for layout in self.layouts)
        text = f"{getattr(self.rule, '__name__', 'rule')}, {state} state, {str(self.param_dtype)[6:]} parameters"
        if self.grad_dtype != self.param_dtype:
            text += f" ({str(self.grad_dtype)[6:]} gradients)"
        if any(self.spread):
            text += ", rows of a longer buffer"
        return text + (", stochastic rounding" if self.stochastic else "")


def kernel_of(rule: Callable, layouts: Sequence[SlotLayout], param: torch.Tensor, grad: torch.Tensor,
              out: torch.Tensor | None, tensors: Sequence[torch.Tensor], stochastic) -> Kernel:
    """The :class:`Kernel` of a block-form call of :func:`elementwise.update` with these arguments."""
    rows, index = [], 0
    for layout in layouts:
        rows.append(tensors[index].shape[0])
        index += layout.width
    return Kernel(rule, tuple(layouts), tuple(rows), out is not None, param.dtype, grad.dtype, stochastic is not None,
                  spread_slots(layouts, tensors))


def spread_slots(layouts: Sequence[SlotLayout], tensors: Sequence[torch.Tensor]) -> tuple[bool, ...]:
    """:attr:`Kernel.spread` of a call's raw slot tensors ``tensors`` (in :func:`canonical` form)."""
    spread, index = [], 0
    for layout in layouts:
        spread.append(not all(tensor.is_contiguous() for tensor in tensors[index : index + layout.width]))
        index += layout.width
    return tuple(spread)


def _standard_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def canonical(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself, or an alias of the same memory (no copy; it keeps ``tensor`` alive) that starts its storage,
    is not a view and, when contiguous, has the standard strides: dynamo guards on where a view starts, on the shape
    of the tensor it views, and on the stride of a dimension of size 1 (a single row of a longer buffer keeps the
    buffer's row stride), none of which changes the values."""
    contiguous = tensor.is_contiguous()
    if contiguous and tensor.stride() != _standard_strides(tensor.shape):
        tensor = tensor.as_strided(tensor.shape, _standard_strides(tensor.shape), tensor.storage_offset())
    elif tensor._base is None and tensor.storage_offset() == 0:
        return tensor
    return from_dlpack(to_dlpack(tensor))


def twin(rule: Callable) -> Callable:
    """:func:`elementwise.update` under a code object of its own, compiled: dynamo keeps its graphs per code object
    and stops compiling one after ``recompile_limit`` (8) variants, which every kernel would share otherwise."""
    base = elementwise.update
    code = base.__code__.replace(co_name=f"update_{getattr(rule, '__name__', 'rule')}")
    twin = types.FunctionType(code, base.__globals__, code.co_name, base.__defaults__, base.__closure__)
    return torch.compile(twin, fullgraph=True, options=dict(INDUCTOR_OPTIONS))


def probe_factory(kernel: Kernel, hyper: tuple, key: torch.Tensor | None) -> Callable[[int], tuple]:
    """A function of a block count that makes probe arguments for ``kernel``: zeroed parameters, gradients, output
    and flat state buffers laid out as the calls' are (:attr:`Kernel.spread`: a spread slot's chunk is the middle
    one of a buffer three chunks long, another slot's buffer is the chunk), the formats' shared maps and tables,
    ``hyper`` and the rounding ``key``."""
    device = torch.device("cpu")

    def make(blocks: int) -> tuple:
        shape = (blocks, BLOCK_SIZE)
        param = torch.zeros(shape, dtype=kernel.param_dtype)
        grad = torch.zeros(shape, dtype=kernel.grad_dtype)
        out = torch.zeros(shape) if kernel.has_out else None
        tensors = []
        n = blocks * BLOCK_SIZE
        for layout, rows, spread in zip(kernel.layouts, kernel.rows, kernel.spread):
            length, start = (3 * n, n) if spread else (n, 0)
            buffers = layout.format.flat_buffers(rows, length, layout.signed, device, zeroed_buffer)
            chunk = layout.format.kernel_chunk(buffers, start, start + n, layout.signed, device)
            tensors += [canonical(t) for t in chunk]
        stochastic = (torch.zeros(blocks, dtype=torch.int64), key) if kernel.stochastic else None
        return param, grad, out, tensors, hyper, stochastic

    return make


def mark_block_dims(probe: tuple, other: tuple) -> None:
    """Mark dynamic every dimension of ``probe``'s tensors that differs in ``other`` (made for another block count)."""
    def tensors(args):
        param, grad, out, slots, _, stochastic = args
        return [param, grad, out, *slots, *(stochastic or ())]

    for tensor, twin in zip(tensors(probe), tensors(other)):
        if tensor is None:
            continue
        dims = [dim for dim, (a, b) in enumerate(zip(tensor.shape, twin.shape)) if a != b]
        if dims:
            torch._dynamo.maybe_mark_dynamic(tensor, dims)


def import_cpp_extension_quietly() -> None:
    """Import ``torch.utils.cpp_extension`` (inductor's C++ build does) with its logger muted: on a CUDA build of
    torch on a machine without a CUDA runtime it warns "No CUDA runtime is found" once, at import, about a CUDA
    toolkit that a CPU kernel never uses."""
    if "torch.utils.cpp_extension" in sys.modules:
        return
    log = logging.getLogger("torch.utils.cpp_extension")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        import torch.utils.cpp_extension  # noqa: F401
    finally:
        log.setLevel(level)


def run_probe(kernel: Kernel, compiled: Callable, probe: Callable[[int], tuple], threads: int) -> None:
    """Run ``compiled`` (:func:`twin`) once on ``probe``'s inputs (:func:`probe_factory`) of :data:`PROBE_BLOCKS`
    blocks, block dimensions marked dynamic, with ``threads`` OpenMP threads: this compiles its graph (or loads it from
    inductor's cache). The background process runs the same, so the cache key is the same."""
    import_cpp_extension_quietly()
    args = probe(PROBE_BLOCKS)
    mark_block_dims(args, probe(PROBE_BLOCKS + 1))
    with cpu_threads.threads(threads), torch.no_grad():
        compiled(kernel.rule, kernel.layouts, *args)


def save(kernel: Kernel, compiled: Callable, probe: Callable[[int], tuple], threads: int, path: Path) -> None:
    """Compile ``kernel``'s graph for ``threads`` threads ahead of time, on the same probe inputs and dynamic marks as
    :func:`run_probe`, and save it to ``path`` (:mod:`compiled_artifact`). The background worker calls it instead of
    :func:`run_probe` where torch can save a compiled function, before writing the kernel's warm marker."""
    args = probe(PROBE_BLOCKS)
    mark_block_dims(args, probe(PROBE_BLOCKS + 1))
    with cpu_threads.threads(threads), torch.no_grad():
        compiled_artifact.save(compiled, (kernel.rule, kernel.layouts, *args), path, INDUCTOR_OPTIONS)


def release_compiled() -> None:
    """Drop what dynamo and inductor keep in memory of the kernels compiled so far (the background worker, between
    kernels; inductor's cache on disk stays)."""
    torch._dynamo.reset()
