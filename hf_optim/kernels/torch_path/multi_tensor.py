"""One optimizer step over many tensors on the PyTorch path, whose cost grows with elements, not with tensors.

A fine-tune steps hundreds of tensors of mixed sizes (a LoRA adapter is a few thousand elements). Running the
elementwise rule tensor by tensor costs a few dozen small operations each; here the state of a whole group lives
in :class:`~hf_optim.kernels.torch_path.flat_state.FlatState` buffers and the rule runs once per chunk of ``CHUNK`` flat
elements:

1. the parameters and gradients of the chunk are gathered into flat scratch buffers (one ``torch.cat``, zeros
   between tensors), or used in place when a single tensor covers the whole chunk;
2. :func:`hf_optim.kernels.torch_path.elementwise.update` runs on the chunk, compiled by inductor once its compilation
   is ready, eagerly before that or with ``HF_OPTIM_COMPILE=0`` (:mod:`hf_optim.kernels.torch_path.cpu_compile`: when it
   compiles, one graph for every chunk length; hyperparameters are 0-d tensors, so new learning rates or bias
   corrections never recompile), with the OpenMP thread count :mod:`hf_optim.kernels.torch_path.cpu_threads` measured to
   be faster;
3. the new parameters go back with one ``torch._foreach_copy_``.

The rule sees exactly the values the per-tensor path gives it, and every operation in it is elementwise or
per 256-element block, so both paths agree bit for bit (``tests/kernels/test_multi_tensor.py``). Memory beyond the state
itself: the scratch buffers (``CHUNK`` elements of the parameter and gradient dtypes) and the block padding.
"""

from __future__ import annotations

import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hf_optim.formats import SlotLayout
from hf_optim.kernels.torch_path import compile_guard, cpu_compile, cpu_kernel, cpu_threads, elementwise
from hf_optim.kernels.torch_path.cpu_compile import (  # noqa: F401 (this module's API before)
    COMPILE_ENV,
    compile_enabled,
)
from hf_optim.kernels.torch_path.flat_state import FlatState
from hf_optim.numerics import BLOCK_SIZE, rounding

CHUNK = 1 << 18
"""Flat elements per call: large enough to amortize a call's fixed cost (about 30 us), small enough that the
compiled kernel's temporaries (a few MiB) stay in glibc's heap between calls. With 1M-element chunks glibc maps and
unmaps them on every call, and on a VM each fresh page costs a fault: the step took twice as long, and varied."""

DEVICE_CHUNK = 1 << 24
"""Elements per call of :func:`step_tensor` on a GPU, where the CPU's heap reasons do not apply and each call costs host
time instead: with :data:`CHUNK`, Muon's momentum on one 4096 x 4096 matrix took 64 calls, about 5.6 ms of host time per
step against 3.1 ms of GPU work (H200, docs/lab/2026-measurements.md, "Third H200 round"). Chunks stay whole blocks, so
the values are the same; a call's fp32 temporaries stay at 64 MiB each."""

IN_PLACE_MIN = 1 << 16
"""Tensors of at least this many elements are updated in place, chunk by chunk; smaller ones are gathered."""



_compiled: dict[tuple, Callable] = {}


def compiled_update(rule: Callable, layouts: Sequence[SlotLayout], has_out: bool, dtypes: tuple) -> Callable:
    """:func:`elementwise.update` compiled for one rule, slot layouts, output mode and parameter/gradient dtypes, for
    GPU chunks (CPU chunks compile through :mod:`hf_optim.kernels.torch_path.cpu_compile`).

    Each combination gets a code object of its own: dynamo keeps its compiled graphs per code object and stops
    compiling one after ``recompile_limit`` (8) variants, a limit every rule and precision would share otherwise.
    Shapes are dynamic, so one graph serves every chunk length (and a second one lengths that are not whole
    blocks).
    """
    key = (rule, tuple(layouts), has_out, dtypes)
    compiled = _compiled.get(key)
    if compiled is None:
        base = elementwise.update
        code = base.__code__.replace(co_name=f"update_{getattr(rule, '__name__', 'rule')}")
        twin = types.FunctionType(code, base.__globals__, code.co_name, base.__defaults__, base.__closure__)
        compiled = _compiled[key] = torch.compile(twin, fullgraph=True)
    return compiled


def run_update(rule, layouts, param, grad, out, tensors, hyper, stochastic=None,
               kernel: cpu_kernel.Kernel | None = None
               ) -> bool:
    """:func:`elementwise.update` on one chunk, compiled when it can be, eagerly otherwise; returns whether the
    compiled kernel ran.

    - CPU: compiled when the chunk is in block form of at least 2 blocks and its compiled kernel is ready
      (:mod:`hf_optim.kernels.torch_path.cpu_compile`, which starts compiling it otherwise, as ``HF_OPTIM_COMPILE``
      says). ``kernel``: the chunk's :class:`~hf_optim.kernels.torch_path.cpu_kernel.Kernel`, when the caller knows it.
    - CUDA (the PyTorch path there: Triton missing or a kernel configuration that fell back): compiled in this
      process unless ``HF_OPTIM_COMPILE=0``, compiling failed on that device (:mod:`compile_guard`) or the chunk is
      a single element, which dynamo would specialize.
    """
    if not compile_enabled():
        pass
    elif param.device.type == "cpu":
        if (param.dim() == 2 and param.shape[0] > 1
                and cpu_compile.run_compiled(rule, layouts, param, grad, out, tensors, hyper, stochastic, kernel)):
            return True
    elif param.numel() > 1 and compile_guard.compiles_on(param.device):
        # stochastic rounding is a variant of its own (a code object of its own, see compiled_update)
        variant = (param.dtype, grad.dtype) + (("bf16 stochastic rounding",) if stochastic is not None else ())
        compiled = compiled_update(rule, layouts, out is not None, variant)
        try:
            compiled(rule, tuple(layouts), param, grad, out, tensors, hyper, stochastic)
            return True
        except compile_guard.compile_errors() as error:  # raised before the compiled code ran: nothing written
            compile_guard.compile_failed(param.device, error)
    elementwise.update(rule, layouts, param, grad, out, tensors, hyper, stochastic)
    return False


def hyper_tensors(hyper: tuple) -> tuple:
    """The rule's scalars (the algorithm's ``hyper`` named tuple) as fp32 0-d CPU tensors, in the same class (made
    once per step, shared by every chunk; a CPU scalar tensor combines with tensors on any device)."""
    return elementwise.scalar_tensors(hyper)


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, start + length)`` of member ``member``, at offset ``at`` of a chunk."""

    member: int
    start: int
    length: int
    at: int


@dataclass(frozen=True)
class Chunk:
    """Flat elements ``[start, stop)`` and the member pieces in them (the rest is zero padding)."""

    start: int
    stop: int
    pieces: tuple[Piece, ...]

    @property
    def whole_member(self) -> int | None:
        """The member that fills the chunk by itself (its tensors can be used in place), else None."""
        if len(self.pieces) == 1 and self.pieces[0].length == self.stop - self.start:
            return self.pieces[0].member
        return None


def plan_chunks(flat: FlatState, indices: Sequence[int]) -> list[Chunk]:
    """Chunks over the members ``indices`` (sorted, adjacent in ``flat``), at most ``CHUNK`` elements each.

    The whole blocks of a member of at least ``IN_PLACE_MIN`` elements get chunks of their own, which the step runs
    on the tensors in place (no gather, no copy back); smaller members, and the partial last block of a large one,
    share gathered chunks.
    """
    members = {i: flat.members[i] for i in indices}
    chunks: list[Chunk] = []

    def cut(begin: int, end: int) -> None:
        for start in range(begin, end, CHUNK):
            stop = min(start + CHUNK, end)
            pieces = []
            for index, member in members.items():
                lo, hi = max(member.offset, start), min(member.stop, stop)
                if hi > lo:
                    pieces.append(Piece(index, lo - member.offset, hi - lo, lo - start))
            chunks.append(Chunk(start, stop, tuple(pieces)))

    pending = members[indices[0]].offset  # start of the region not yet cut
    for index in indices:
        member = members[index]
        whole = member.numel - member.numel % BLOCK_SIZE
        if member.numel < IN_PLACE_MIN:
            continue
        cut(pending, member.offset)
        cut(member.offset, member.offset + whole)
        pending = member.offset + whole
    cut(pending, members[indices[-1]].padded_stop)
    return chunks


def cached_chunks(flat: FlatState, indices: Sequence[int]) -> list[Chunk]:
    """:func:`plan_chunks`, remembered by ``flat`` (the same tensors step together step after step)."""
    key = tuple(indices)
    plan = flat.plans.get(key)
    if plan is None:
        plan = flat.plans[key] = plan_chunks(flat, indices)
    return plan


def adjacent_runs(flat: FlatState, indices: Sequence[int]) -> list[list[int]]:
    """Split sorted member ``indices`` into runs whose flat ranges follow each other without a gap."""
    runs: list[list[int]] = []
    for index in indices:
        if runs and flat.members[runs[-1][-1]].padded_stop == flat.members[index].offset:
            runs[-1].append(index)
        else:
            runs.append([index])
    return runs


def runs_of(flat: FlatState, members: Sequence[tuple]) -> list[tuple[list[int], dict, dict]]:
    """``members`` = ``[(index, param, grad)]`` sorted by index, as runs of adjacent members: ``(indices, flat
    params by index, flat grads by index)``."""
    params = {index: param.detach().view(-1) for index, param, _ in members}
    grads = {index: grad.reshape(-1) for index, _, grad in members}
    return [(run, params, grads) for run in adjacent_runs(flat, list(params))]


def consecutive_pieces(items: Sequence, size_of: Callable, limit: int) -> list[list]:
    """``items`` in consecutive pieces of at most ``limit`` total ``size_of(item)`` (a larger item is a piece by
    itself): how buckets, scratch batches and adoption pieces are cut."""
    pieces: list[list] = []
    size = 0
    for item in items:
        n = size_of(item)
        if not pieces or size + n > limit:
            pieces.append([])
            size = 0
        pieces[-1].append(item)
        size += n
    return pieces


def buckets(flat: FlatState, run: Sequence[int], limit: int) -> list[list[int]]:
    """Split a run of members into consecutive buckets of at most ``limit`` padded elements (a larger member
    is a bucket by itself)."""
    return consecutive_pieces(run, lambda i: flat.members[i].padded_stop - flat.members[i].offset, limit)


DEVICE_TYPES = ("cpu", "cuda")
"""Device types the multi-tensor path runs on (compiled there: :data:`compile_guard.COMPILED_DEVICE_TYPES`)."""

PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Parameter dtypes the multi-tensor path takes (the rules compute in fp32 and round back)."""


class Scratch:
    """Reusable flat buffers per (dtype, device), and zero padding to gather between tensors."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._prefixes: dict[tuple, torch.Tensor] = {}

    def buffer(self, role: str, dtype: torch.dtype, device: torch.device, numel: int) -> torch.Tensor:
        """The first ``numel`` elements of the ``role`` buffer (grown as needed), on the CPU as an alias that is not
        a view (``cpu_kernel.canonical``: what the compiled kernels take), made once per length."""
        key = (role, dtype, device)
        found = self._buffers.get(key)
        if found is None or found.numel() < numel:
            found = self._buffers[key] = torch.empty(max(numel, CHUNK), dtype=dtype, device=device)
            self._prefixes = {k: v for k, v in self._prefixes.items() if k[0] != key}
        prefix = self._prefixes.get((key, numel))
        if prefix is None:
            prefix = found[:numel]
            prefix = self._prefixes[key, numel] = cpu_kernel.canonical(prefix) if device.type == "cpu" else prefix
        return prefix

    def zeros(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = ("zeros", dtype, device)
        if key not in self._buffers:
            self._buffers[key] = torch.zeros(BLOCK_SIZE, dtype=dtype, device=device)
        return self._buffers[key]


def gather(chunk: Chunk, flats: Sequence[torch.Tensor], out: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """Copy the chunk's pieces of the flat tensors ``flats`` (by member) into ``out`` (the chunk's length), zeros in
    between."""
    parts, at = [], 0
    for piece in chunk.pieces:
        if piece.at > at:
            parts.append(zeros[: piece.at - at])
        parts.append(flats[piece.member][piece.start : piece.start + piece.length])
        at = piece.at + piece.length
    length = chunk.stop - chunk.start
    if length > at:
        parts.append(zeros[: length - at])
    return torch.cat(parts, out=out)


def scatter(chunk: Chunk, gathered: torch.Tensor, flats: Sequence[torch.Tensor]) -> None:
    """Copy the chunk's pieces of ``gathered`` back into the flat tensors ``flats``."""
    if not chunk.pieces:
        return
    destinations = [flats[p.member][p.start : p.start + p.length] for p in chunk.pieces]
    sources = [gathered[p.at : p.at + p.length] for p in chunk.pieces]
    torch._foreach_copy_(destinations, sources)


def step_run(
    rule: Callable,
    flat: FlatState,
    chunks: Sequence[Chunk],
    params: dict[int, torch.Tensor],
    grads: dict[int, torch.Tensor],
    hyper: tuple,
    scratch: Scratch,
    out: torch.Tensor | None = None,
    out_offset: int = 0,
    stream: rounding.Stream | None = None,
) -> None:
    """Run ``rule`` over ``chunks`` of ``flat``; ``params``/``grads`` map member index to flat tensors.

    ``out`` (LAMB's direction) receives the rule's output instead of the parameters: flat element ``i`` goes to
    ``out[i - out_offset]``, and the parameters are left as they are. ``stream`` (bf16 parameters): round the new
    parameters stochastically, each block with its member's own counters (:meth:`rounding.Stream.chunk_bases`).
    """
    first = next(iter(params.values()))
    device, p_dtype = first.device, first.dtype
    g_dtype = next(iter(grads.values())).dtype
    hyper_t = hyper_tensors(hyper)
    p_zeros, g_zeros = scratch.zeros(p_dtype, device), scratch.zeros(g_dtype, device)
    kernel = threads = None
    if device.type == "cpu" and compile_enabled():
        # A stacked slot's chunks are slices of longer rows unless one chunk is the whole buffer (then it is the only
        # chunk): the first chunk's layout is every chunk's.
        spread = cpu_kernel.spread_slots(flat.layouts, flat.chunk(chunks[0].start, chunks[0].stop))
        kernel = cpu_kernel.Kernel(rule, tuple(flat.layouts), tuple(spec.rows for spec in flat.specs),
                                   out is not None, p_dtype, g_dtype, stream is not None and out is None, spread)
        cpu_compile.prepare(kernel, hyper_t, stream.key if kernel.stochastic else None,
                            sum(chunk.stop - chunk.start for chunk in chunks))
        threads = cpu_compile.threads_for(kernel)
    start, compiled, elements = time.perf_counter(), True, 0
    with cpu_threads.threads(threads):
        for chunk in chunks:
            length = chunk.stop - chunk.start
            whole = chunk.whole_member
            if whole is not None:
                piece = chunk.pieces[0]
                p = params[whole][piece.start : piece.start + length]
                g = grads[whole][piece.start : piece.start + length]
            else:
                p = gather(chunk, params, scratch.buffer("param", p_dtype, device, length), p_zeros)
                g = gather(chunk, grads, scratch.buffer("grad", g_dtype, device, length), g_zeros)
            o = None if out is None else out[chunk.start - out_offset : chunk.stop - out_offset].view(-1, BLOCK_SIZE)
            stochastic = None if stream is None or out is not None else (stream.chunk_bases(chunk, device), stream.key)
            compiled &= run_update(rule, flat.layouts, p.view(-1, BLOCK_SIZE), g.view(-1, BLOCK_SIZE), o,
                                   flat.chunk(chunk.start, chunk.stop), hyper_t, stochastic, kernel)
            elements += length
            if whole is None and out is None:
                scatter(chunk, p, params)
    if threads is not None and compiled:
        cpu_compile.record(kernel, threads, time.perf_counter() - start, elements)


def step_tensor(
    rule: Callable,
    layouts: Sequence[SlotLayout],
    param: torch.Tensor,
    grad: torch.Tensor,
    out: torch.Tensor | None,
    tensors: Sequence[torch.Tensor],
    hyper: tuple,
    stream: rounding.Stream | None = None,
    index_offset: int = 0,
) -> None:
    """Run ``rule`` over one tensor's own state (``state_store.slot_tensors``): its whole blocks chunk by chunk
    in the kernels' block form, a last partial block as it is. ``stream`` (a bf16 ``param``): round the new
    values stochastically, with counters of the element's index in ``param`` (plus ``index_offset``, for a range
    of a larger tensor) and ``stream.ordinal``."""
    hyper_t = hyper_tensors(hyper)
    n = param.numel()
    whole = n - n % BLOCK_SIZE
    raws, index = [], 0
    for layout in layouts:
        raws.append(tensors[index : index + layout.width])
        index += layout.width
    if any(getattr(layout.format, "whole_tensor", False) for layout in layouts):
        # A format whose scales span the whole tensor (rank-1 4-bit) cannot be quantized chunk by chunk: one eager
        # update over the flat tensor and its (rows, n) raw tensors.
        stochastic = None
        if stream is not None and out is None:
            stochastic = (rounding.tensor_bases(stream.ordinal, index_offset, index_offset + n, False, param.device),
                          stream.key)
        elementwise.update(rule, layouts, param, grad, out, tensors, hyper_t, stochastic)
        return
    chunk_elements = CHUNK if param.device.type == "cpu" else DEVICE_CHUNK
    if whole >= 2 * BLOCK_SIZE and param.device.type == "cpu" and compile_enabled():
        first = [t for layout, raw in zip(layouts, raws)
                 for t in layout.format.slice_raw(raw, 0, min(chunk_elements, whole), True)]
        kernel = cpu_kernel.Kernel(rule, tuple(layouts), tuple(raw[0].shape[0] for raw in raws), out is not None,
                                   param.dtype, grad.dtype, stream is not None and out is None,
                                   cpu_kernel.spread_slots(layouts, first))
        cpu_compile.prepare(kernel, hyper_t, stream.key if kernel.stochastic else None, whole)
    for start in [*range(0, whole, chunk_elements), *([whole] if whole < n else [])]:
        block_form = start < whole
        stop = min(start + chunk_elements, whole) if block_form else n
        shape = (-1, BLOCK_SIZE) if block_form else (-1,)  # the partial block stays flat (padded inside)
        chunk = [t for layout, raw in zip(layouts, raws) for t in layout.format.slice_raw(raw, start, stop, block_form)]
        o = None if out is None else out[start:stop].view(shape)
        stochastic = None
        if stream is not None and out is None:
            bases = rounding.tensor_bases(stream.ordinal, index_offset + start, index_offset + stop, start < whole,
                                          param.device)
            stochastic = (bases, stream.key)
        run_update(rule, layouts, param[start:stop].view(shape), grad[start:stop].view(shape), o, chunk, hyper_t,
                   stochastic)
