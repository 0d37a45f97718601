"""When the CPU path's update is compiled by inductor, on which inputs, and what runs meanwhile.

The multi-tensor path (:mod:`hf_optim.kernels.torch_path.multi_tensor`) calls
:func:`hf_optim.kernels.torch_path.elementwise.update` once per chunk. Compiled by inductor it runs several times faster
than eagerly (8-bit state most), but compiling costs seconds to minutes the first time
(docs/performance.md#first-step-and-compilation-cpu): dynamo traces the rule, inductor writes C++ and gcc builds it.
``HF_OPTIM_COMPILE`` says when to pay:

- ``auto`` (the default, also when unset or empty): in the background. The first chunk of a kernel queues it for
  the background compiler and runs eagerly, as does every chunk of that kernel until it is compiled and loaded: the
  worker saves the compiled kernel whole (:mod:`hf_optim.kernels.torch_path.compiled_artifact`), the training
  process loads it between two kernel runs (about 0.2 s, in the thread that steps), and from then on the steps use
  it. A short run never waits for a compiler.
- ``1``: before the first step that needs it, which waits for the compilation.
- ``0``: never; every step runs eagerly (no C++ compiler needed).

The background compiler is one process per machine and inductor cache directory
(:mod:`hf_optim.kernels.torch_path.cpu_compile_worker`, at a lower priority), however many training processes,
notebooks or test runs need kernels: a lock in the cache directory admits one, and the kernels wait in a queue there
(:mod:`hf_optim.kernels.torch_path.compile_queue`), one job per kernel whichever processes asked for it. It compiles
them one after another into inductor's on-disk cache, saves each compiled kernel whole beside its warm marker
(:func:`warm_marker`, :func:`save_kernel`; a later process that finds them loads that kernel beside its first steps)
and exits once no queued kernel has a
live requester: after the processes that asked for kernels have exited it finishes the kernel it is compiling (that
warms the cache) and starts no other. A process that finds its kernel queued or being compiled by another's request
waits for the marker, running eagerly meanwhile. A compile error reaches each requester (one WARNING; the kernel runs
eagerly).

Why switching in mid-run changes no result: eager and compiled updates compute the same bits (the rules use
single-rounding operations only, see :mod:`hf_optim.numerics.exact_math`; inductor compiles without
contraction; every reduction is within one 256-element block), and ``tests/kernels/test_multi_tensor.py`` compares
them bit for bit, a run that switches after its first steps included. So the step at which a run switches depends on the
machine's speed, the optimizer's results do not, and neither do the model's.

Why a process and not a thread of the training process: dynamo and inductor running in a thread beside the training
changed the training thread's results (measured on the quickstart: the losses left the eager run's from step 5 on;
dynamo also sets the process's random state back after tracing). In a separate process they touch none of the
training's state: the quickstart with ``auto`` prints the eager run's losses bit for bit, the mid-run switch
included. What the training process does itself is load the saved kernel, in the thread that steps, between two
kernel runs (:mod:`hf_optim.kernels.torch_path.compiled_artifact`: no tracing, so no random state is touched; no
thread of hf_optim's runs beside the user's, so nothing races the user's Python); only where torch cannot save a
compiled function does it compile from inductor's warm cache in the training thread, between two steps (1-3 s).

The background worker compiles exactly what the training process compiles afterwards (:func:`_run_probe`: the same
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

Log lines (logger ``hf_optim``): one INFO line when a compilation starts (which kernel, where it is cached), one when
it has taken more than a second (in the background: how long since it was queued, and the cache hit here), and a
WARNING when it fails (that kernel then keeps running eagerly), with the worker's error line.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils.dlpack import from_dlpack, to_dlpack

from hf_optim.formats import SlotLayout
from hf_optim.formats.base import zeroed_buffer
from hf_optim.kernels.torch_path import compile_queue, compiled_artifact, cpu_threads, elementwise
from hf_optim.numerics import BLOCK_SIZE

logger = logging.getLogger("hf_optim")

COMPILE_ENV = "HF_OPTIM_COMPILE"
MODES = ("auto", "1", "0")
"""Valid values of ``HF_OPTIM_COMPILE``: compile in the background, before the first step, never."""

PROBE_BLOCKS = 37
"""Blocks of the probe inputs a kernel is compiled on: a prime, so that no static size of any format (1 or 2 rows,
256 elements or 128 bytes per block, maps and tables) is a multiple of it and only the block dimensions vary."""

EAGER_WHILE_COMPILING = 1 << 20
"""Largest run of a kernel's chunks (elements per step) that runs eagerly while the kernel compiles in the background; a
larger one waits for the compilation. Eagerly an 8-bit chunk costs 20-50x its compiled time (measured; eager against
compiled runs: docs/lab/2026-measurements.md#cpu-first-step-and-busy-machines-issue-23), so a large step would take
longer than the compilation, and an eager step competes with the compiler for the cores and for Python's GIL: on
Llama-3.2-1B's LoRA set (11.3M elements) one eager AdamW8bit step outlasted the whole compilation. A 1M-element eager
step takes well under a second on an idle 2-core machine."""

INDUCTOR_OPTIONS = {"compile_threads": 1, "cpp_cache_precompile_headers": False, "cpp.vec_isa_ok": True}
"""Inductor settings for these compilations only (see the module docstring)."""


def compile_mode() -> str:
    """``HF_OPTIM_COMPILE``: ``auto`` (unset or empty too), ``1`` or ``0``; anything else raises ValueError."""
    raw = os.environ.get(COMPILE_ENV, "")
    value = raw.strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(
            f"{COMPILE_ENV}={raw!r} is not valid; valid values are 'auto' (compile the CPU kernels in the background, "
            "the default), '1' (compile them before the first step) and '0' (never compile: eager)"
        )
    return value


def compile_enabled() -> bool:
    """Whether CPU updates are compiled by inductor at all (``HF_OPTIM_COMPILE`` is not ``0``)."""
    return compile_mode() != "0"


def cache_location() -> str:
    """Where inductor keeps compiled kernels (``TORCHINDUCTOR_CACHE_DIR``, else its default), as an absolute path."""
    found = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if found:
        return os.path.abspath(found)
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # older torch: its default, computed the same way
        import getpass

        return os.path.join(tempfile.gettempdir(), "torchinductor_" + getpass.getuser().replace("\\", "_"))
    return os.path.abspath(default_cache_dir())


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


def _twin(rule: Callable) -> Callable:
    """:func:`elementwise.update` under a code object of its own, compiled: dynamo keeps its graphs per code object
    and stops compiling one after ``recompile_limit`` (8) variants, which every kernel would share otherwise."""
    base = elementwise.update
    code = base.__code__.replace(co_name=f"update_{getattr(rule, '__name__', 'rule')}")
    twin = types.FunctionType(code, base.__globals__, code.co_name, base.__defaults__, base.__closure__)
    return torch.compile(twin, fullgraph=True, options=dict(INDUCTOR_OPTIONS))


@dataclass
class _Entry:
    """A kernel's compiled functions and which thread counts its graphs are compiled (or being compiled) for."""

    rule: Callable
    ready: set[int] = field(default_factory=set)
    pending: set[int] = field(default_factory=set)
    failed: str | None = None
    probe: Callable[[int], tuple] | None = None  # blocks -> probe arguments (after `update`'s rule and layouts)
    hyper: tuple = ()  # the probe inputs' scalars and rounding key (copies), for a background process's job
    key: torch.Tensor | None = None
    warmups: dict[int, QueuedCompile] = field(default_factory=dict)  # thread count -> its request to the worker
    threads: cpu_threads.ThreadChoice | None = None
    loaded: dict[int, Callable] = field(default_factory=dict)  # thread count -> the saved kernel, loaded
    misfits: int = 0  # calls whose tensors the loaded kernel's guards refused (they ran eagerly)
    _compiled: Callable | None = None

    @property
    def compiled(self) -> Callable:
        """The update compiled by ``torch.compile`` (created when first needed: a run that only loads saved kernels
        never imports dynamo in its training thread)."""
        if self._compiled is None:
            self._compiled = _twin(self.rule)
        return self._compiled

    def function(self, threads: int) -> Callable:
        """What runs the kernel's graph for ``threads`` threads: its saved kernel if one was loaded."""
        return self.loaded.get(threads) or self.compiled


_lock = threading.Lock()
_entries: dict[Kernel, _Entry] = {}


def _after_fork_in_child() -> None:
    """A forked process (a dataloader worker, say) has nothing pending: the requests and the worker are its
    parent's (it neither waits for them nor reaps the worker); it queues its own if it ever needs a kernel."""
    global _lock
    _lock = threading.Lock()
    for entry in _entries.values():
        entry.pending.clear()
        entry.warmups = {}
    _requests.clear()
    _spawned.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _entry(kernel: Kernel) -> _Entry:
    with _lock:
        found = _entries.get(kernel)
        if found is None:
            found = _entries[kernel] = _Entry(kernel.rule)
        return found


def _set_probe(kernel: Kernel, entry: _Entry, hyper: tuple, key: torch.Tensor | None) -> None:
    """Give ``entry`` its probe inputs: copies of the rule's scalars ``hyper`` and of the rounding ``key``."""
    entry.hyper = type(hyper)(*(value.detach().clone() for value in hyper))
    entry.key = None if key is None else key.detach().clone()
    entry.probe = _probe_factory(kernel, entry.hyper, entry.key)


def _probe_factory(kernel: Kernel, hyper: tuple, key: torch.Tensor | None) -> Callable[[int], tuple]:
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


def _mark_block_dims(probe: tuple, other: tuple) -> None:
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


def _what(kernel: Kernel, entry: _Entry, threads: int) -> str:
    """The kernel a compilation is for, as the log lines name it."""
    variant = threads == 1 and bool(entry.ready)  # the one-thread variant of a compiled kernel (cpu_threads)
    return kernel.describe() + (", 1 thread (the machine is busy)" if variant else "")


def _hint(entry: _Entry, threads: int) -> str:
    """What the log lines of a one-thread variant add where waiting OpenMP threads spin."""
    if threads == 1 and entry.ready and cpu_threads.spinning_waits():
        return (f"; {cpu_threads.WAIT_POLICY_ENV}=PASSIVE, set before Python starts, runs the kernel with all threads "
                "2-3x faster than with one on a busy machine")
    return ""


def _announce(kernel: Kernel, entry: _Entry, threads: int, how: str) -> None:
    """The log line that says a compilation (``how``: ``here`` or ``background``) starts."""
    meanwhile = f"the {max(entry.ready)}-thread kernel" if threads == 1 and entry.ready else "eagerly"
    hint = _hint(entry, threads)
    what = _what(kernel, entry, threads)
    where = f" in a background process; the steps run {meanwhile} until it is ready" if how == "background" else ""
    logger.info("compiling the optimizer's CPU kernel for %s%s (once, cached in %s%s)", what, where, cache_location(),
                hint)


def _import_cpp_extension_quietly() -> None:
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


def _run_probe(kernel: Kernel, entry: _Entry, threads: int) -> None:
    """Run ``entry``'s compiled function once on probe inputs of :data:`PROBE_BLOCKS` blocks, block dimensions
    marked dynamic, with ``threads`` OpenMP threads: this compiles its graph (or loads it from inductor's cache).
    The background process (:mod:`hf_optim.kernels.torch_path.cpu_compile_worker`) runs the same, so the cache key is
    the same."""
    _import_cpp_extension_quietly()
    probe = entry.probe(PROBE_BLOCKS)
    _mark_block_dims(probe, entry.probe(PROBE_BLOCKS + 1))
    with cpu_threads.threads(threads), torch.no_grad():
        entry.compiled(kernel.rule, kernel.layouts, *probe)


def save_kernel(kernel: Kernel, entry: _Entry, threads: int, marker: Path) -> None:
    """Compile ``kernel``'s graph for ``threads`` threads ahead of time, on the same probe inputs and dynamic marks as
    :func:`_run_probe`, and save it beside its warm marker (:mod:`compiled_artifact`). The background worker calls it
    instead of :func:`_run_probe` where torch can save a compiled function, before writing the marker."""
    probe = entry.probe(PROBE_BLOCKS)
    _mark_block_dims(probe, entry.probe(PROBE_BLOCKS + 1))
    with cpu_threads.threads(threads), torch.no_grad():
        compiled_artifact.save(entry.compiled, (kernel.rule, kernel.layouts, *probe),
                               compiled_artifact.path_beside(marker), INDUCTOR_OPTIONS)


class QueuedCompile:
    """This process's request for a kernel in the background compiler's queue (:func:`start_warmup`)."""

    CHECK_EVERY_S = 0.05
    """Between two looks at the queue from the steps (a few file system calls each)."""
    HEAL_EVERY_S = 1.0
    """Between two checks that the request is still queued and a worker runs for it."""

    def __init__(self, queue: compile_queue.Queue, key: str, job: bytes):
        self.queue, self.key, self.job = queue, key, job
        self.marker = marker_of(key)
        self.started = time.perf_counter()
        self.status: int | None = None
        self._error = ""
        self._checked = self._healed = float("-inf")
        queue.request(key, job)
        self._ensure_worker()

    def _ensure_worker(self) -> None:
        _reap()
        process = self.queue.ensure_worker(str(PACKAGE_ROOT))
        if process is not None:
            _spawned.append(process)

    def poll(self) -> int | None:
        """0 once the kernel is in the cache (its marker exists), 1 when the worker failed on it (:meth:`error`),
        None while it is queued or compiling (a request or worker that went missing is replaced)."""
        if self.status is not None:
            return self.status
        now = time.perf_counter()
        if now - self._checked < self.CHECK_EVERY_S:
            return None
        self._checked = now
        if self.marker.exists():
            self.status = 0
        elif (error := self.queue.failure(self.key)) is not None:
            self.status, self._error = 1, error
        elif now - self._healed >= self.HEAL_EVERY_S:
            self._healed = now
            if not (self.queue.requested(self.key) and self.queue.queued(self.key)):
                if self.marker.exists():  # done meanwhile (the worker removes the job after the marker is written)
                    self.status = 0
                    return self.status
                self.queue.request(self.key, self.job)
            self._ensure_worker()  # one that exited just before this request was queued
        if self.status is not None:
            self.queue.withdraw(self.key)
        return self.status

    def wait(self) -> int:
        while self.poll() is None:
            time.sleep(self.CHECK_EVERY_S)
        return self.status

    def error(self) -> str:
        """The worker's error line (type and first line of the exception) when it failed."""
        return self._error[:300]

    def close(self, kill: bool = False) -> None:
        """Withdraw the request: the worker skips the kernel unless another process waits for it. ``kill`` is
        ignored: the worker is shared, and it exits by itself after its current kernel when nobody waits."""
        self.queue.withdraw(self.key)


Warmup = QueuedCompile  # its name before the queue


_spawned: list[subprocess.Popen] = []
"""Workers this process started: reaped once they have exited (they outlive it when it exits first)."""


def _reap() -> None:
    _spawned[:] = [process for process in _spawned if process.poll() is None]


def queue() -> compile_queue.Queue:
    """The background compiler's queue for inductor's current cache directory."""
    return compile_queue.Queue(Path(cache_location()) / "hf_optim" / "queue")


def start_warmup(kernel: Kernel, hyper: tuple, key: torch.Tensor | None, threads: int) -> QueuedCompile:
    """Queue ``kernel``'s graph for ``threads`` threads for the background compiler (started unless it runs;
    :mod:`hf_optim.kernels.torch_path.compile_queue`): the job is the kernel, the probe inputs' scalars and rounding
    key and the thread count, pickled; it compiles into the same ``TORCHINDUCTOR_CACHE_DIR``."""
    job = pickle.dumps((kernel, hyper, key, threads))
    request = QueuedCompile(queue(), kernel_key(kernel, threads), job)
    _requests.append(request)
    return request


_requests: list[QueuedCompile] = []
"""This process's requests, withdrawn at its exit (the worker would notice the exit anyway, a little later)."""


@atexit.register
def _withdraw_all() -> None:
    for request in _requests:
        if request.status is None:
            with contextlib.suppress(OSError):
                request.close()


def release_compiled() -> None:
    """Drop what dynamo and inductor keep in memory of the kernels compiled so far (the background worker, between
    kernels; inductor's cache on disk stays)."""
    torch._dynamo.reset()


PACKAGE_ROOT = Path(__file__).resolve().parents[3]
"""The directory hf_optim is imported from (the background worker imports it from there too)."""


def kernel_key(kernel: Kernel, threads: int) -> str:
    """A name for ``kernel``'s graph for ``threads`` threads, the same in every process: it digests what inductor's
    cache key depends on (the kernel: its rule by module and name, its layouts' formats, rows, dtypes; the thread
    count, the torch version, the compile options and the source of the update and of the rule's module)."""
    # A description, not the pickled kernel: a format object's pickle carries what it cached since it was first
    # used, so the same kernel pickled differently in the process that ran it and in a fresh one.
    rule = f"{getattr(kernel.rule, '__module__', '')}.{getattr(kernel.rule, '__qualname__', kernel.rule)}"
    layouts = [(layout.format.name, layout.format.bits, layout.signed) for layout in kernel.layouts]
    described = (rule, layouts, kernel.rows, kernel.spread, kernel.has_out, str(kernel.param_dtype),
                 str(kernel.grad_dtype), kernel.stochastic, threads, torch.__version__,
                 sorted(INDUCTOR_OPTIONS.items()), compiled_artifact.FORMAT if compiled_artifact.supported() else None)
    digest = hashlib.sha256(repr(described).encode())
    for module in sorted({elementwise.__name__, getattr(kernel.rule, "__module__", None) or ""}):
        source = getattr(sys.modules.get(module), "__file__", None)
        if source and os.path.exists(source):
            digest.update(Path(source).read_bytes())
    return digest.hexdigest()[:32]


def marker_of(key: str) -> Path:
    """The warm marker of the graph named ``key`` (:func:`kernel_key`) in inductor's current cache directory."""
    return Path(cache_location()) / "hf_optim" / f"{key}.ready"


def warm_marker(kernel: Kernel, threads: int) -> Path | None:
    """The file the background worker leaves in inductor's cache directory once it has compiled ``kernel`` for
    ``threads`` threads there. A later process that finds it compiles in the training thread at once (a cache hit)
    instead of queueing the kernel and running eagerly meanwhile; if the cache was cleared since, that compilation is
    a full one, as with ``HF_OPTIM_COMPILE=1``."""
    return marker_of(kernel_key(kernel, threads))


def _fail(kernel: Kernel, entry: _Entry, threads: int, error: str) -> None:
    """A compilation failed (``error``: its exception's type and first line): warn once; the kernel runs eagerly."""
    entry.failed = error
    logger.warning("compiling the optimizer's CPU kernel for %s failed (%s); it runs eagerly (same results, "
                   "slower; HF_OPTIM_COMPILE=0 skips compiling)", _what(kernel, entry, threads), error)


def _compile(kernel: Kernel, entry: _Entry, threads: int, background: float | None = None) -> None:
    """Compile ``kernel``'s graph for ``threads`` OpenMP threads by running it once on probe inputs; ``background``:
    the seconds a background process took to compile it into the cache (this then loads it from there)."""
    what = _what(kernel, entry, threads)
    start = time.perf_counter()
    try:
        _run_probe(kernel, entry, threads)
    except Exception as error:  # a missing or failing C++ compiler: the kernel keeps running eagerly
        first_line = (str(error).strip().splitlines() or [""])[0][:300]
        _fail(kernel, entry, threads, f"{type(error).__name__}: {first_line}")
    else:
        entry.ready.add(threads)
        elapsed = time.perf_counter() - start
        if background is not None:
            logger.info("compiled the optimizer's CPU kernel for %s in %.1f s (in a background process; loaded "
                        "from the cache in %.1f s)", what, background, elapsed)
        elif elapsed > 1.0:
            logger.info("compiled the optimizer's CPU kernel for %s in %.1f s", what, elapsed)
    finally:
        entry.pending.discard(threads)


def _finish(kernel: Kernel, entry: _Entry, threads: int, block: bool) -> None:
    """If the background worker is done with ``kernel`` for ``threads`` threads (``block``: wait for it), take its
    result: load the kernel it saved (else compile it from the warm cache) in this thread, or warn with its error."""
    warmup = entry.warmups.get(threads)
    if warmup is None:
        return
    status = warmup.wait() if block else warmup.poll()
    if status is None:
        return
    del entry.warmups[threads]
    seconds = time.perf_counter() - warmup.started
    error = "" if status == 0 else warmup.error()
    warmup.close()
    if status == 0:
        if not _load(kernel, entry, threads, background=seconds):
            _compile(kernel, entry, threads, background=seconds)
        return
    entry.pending.discard(threads)
    _fail(kernel, entry, threads, error or f"the compiler process exited with status {status}")


def _load(kernel: Kernel, entry: _Entry, threads: int, background: float | None = None,
          marker: Path | None = None) -> bool:
    """The background worker has compiled ``kernel`` for ``threads`` threads into the cache (``background``: the
    seconds since it was queued, None when an earlier process's worker did): load the kernel it saved, here, in the
    thread that steps (:func:`compiled_artifact.load`), and run on it from now on. False where there is none to load
    (this torch cannot save one, or the file is gone) or it failed to load: the caller then compiles the kernel from
    inductor's cache in this thread. ``marker``: the kernel's warm marker when the caller has it."""
    marker = marker or warm_marker(kernel, threads)
    path = None if marker is None else compiled_artifact.path_beside(marker)
    if path is None or not (compiled_artifact.supported() and path.exists()):
        return False
    loaded = compiled_artifact.load(path, INDUCTOR_OPTIONS, before=_import_cpp_extension_quietly)
    if loaded.function is None:
        logger.debug("loading the saved CPU kernel %s failed (%s); compiling it from the cache", path, loaded.error)
        return False
    what = _what(kernel, entry, threads) + _hint(entry, threads)
    entry.loaded[threads] = loaded.function
    entry.ready.add(threads)
    entry.pending.discard(threads)
    if background is not None:
        logger.info("compiled the optimizer's CPU kernel for %s in %.1f s (in a background process; loaded in "
                    "%.1f s)", what, background, loaded.seconds)
    else:
        logger.info("loaded the optimizer's CPU kernel for %s, compiled before, in %.1f s", what, loaded.seconds)
    return True


def _start(kernel: Kernel, entry: _Entry, threads: int) -> None:
    """Load ``kernel`` for ``threads`` threads now (a warm marker and a saved kernel), compile it now
    (``HF_OPTIM_COMPILE=1``, a warm marker without a saved kernel, or no ``flock`` on this platform) or queue it for
    the background worker, which compiles it into inductor's cache."""
    entry.pending.add(threads)
    marker = warm_marker(kernel, threads) if compile_mode() == "auto" else None
    compiled_before = marker is not None and marker.exists()  # by an earlier process's background worker
    if compiled_before and _load(kernel, entry, threads, marker=marker):
        return
    background = compile_mode() != "1" and compile_queue.supported() and not compiled_before
    _announce(kernel, entry, threads, "background" if background else "here")
    if not background:
        _compile(kernel, entry, threads)
        return
    try:
        entry.warmups[threads] = start_warmup(kernel, entry.hyper, entry.key, threads)
    except (OSError, pickle.PicklingError, TypeError, AttributeError) as error:  # cannot queue it: run eagerly
        entry.pending.discard(threads)
        _fail(kernel, entry, threads, f"{type(error).__name__}: {str(error).strip()[:300]}")


def _available(kernel: Kernel, entry: _Entry, threads: int) -> bool:
    """Whether ``kernel``'s graph for ``threads`` threads can run now; starts its compilation if it has not."""
    if threads in entry.ready:
        return True
    if threads in entry.pending:
        _finish(kernel, entry, threads, block=False)
    elif entry.failed is None and entry.probe is not None:
        _start(kernel, entry, threads)
    return threads in entry.ready


def prepare(kernel: Kernel, hyper: tuple, key: torch.Tensor | None, elements: int) -> None:
    """Before a run of ``elements`` elements of ``kernel``'s chunks (``hyper``: the rule's scalars as 0-d tensors,
    ``key``: the stochastic rounding key or None): start compiling its graph if it has not been, and when it is
    still compiling and the run exceeds :data:`EAGER_WHILE_COMPILING` elements, wait for it."""
    entry = _entries.get(kernel) or _entry(kernel)
    if entry.probe is None:
        _set_probe(kernel, entry, hyper, key)
    threads = torch.get_num_threads()
    if _available(kernel, entry, threads) or elements <= EAGER_WHILE_COMPILING:
        return
    _finish(kernel, entry, threads, block=True)


def run_compiled(rule, layouts, param, grad, out, tensors, hyper, stochastic=None, kernel: Kernel | None = None
                 ) -> bool:
    """Run the compiled :func:`elementwise.update` on one block-form chunk (``param`` of shape ``(blocks, 256)``,
    at least 2 blocks) if its graph is ready, and return True; else start compiling it (unless it is compiling or
    failed) and return False: the caller runs the chunk eagerly."""
    kernel = kernel or kernel_of(rule, layouts, param, grad, out, tensors, stochastic)
    entry = _entries.get(kernel) or _entry(kernel)
    if entry.probe is None:
        _set_probe(kernel, entry, hyper, None if stochastic is None else stochastic[1])
    threads = torch.get_num_threads()
    if not _available(kernel, entry, threads):
        return False
    stochastic = None if stochastic is None else (canonical(stochastic[0]), canonical(stochastic[1]))
    args = (rule, kernel.layouts, canonical(param), canonical(grad), None if out is None else canonical(out),
            [canonical(t) for t in tensors], hyper, stochastic)
    function = entry.function(threads)
    try:
        function(*args)
    except RuntimeError:
        if not _refused_by_guards(function, args):
            raise
        _misfit(kernel, entry)
        return False
    return True


def _refused_by_guards(function: Callable, args: tuple) -> bool:
    """Whether a loaded kernel's guards refuse ``args``: it then raised before running anything (torch's saved
    functions check their guards first and raise where ``torch.compile`` would compile again)."""
    guard_check = getattr(function, "guard_check", None)
    return guard_check is not None and not guard_check(*args)


def _misfit(kernel: Kernel, entry: _Entry) -> None:
    """A loaded kernel's guards refused a call's tensors (its probe did not have their layout): the call runs
    eagerly, with the same results; warn once per kernel, since every such call is slower."""
    entry.misfits += 1
    if entry.misfits == 1:
        logger.warning("the compiled CPU kernel for %s does not fit some of its calls' tensors; those calls run "
                       "eagerly (same results, slower). Please report it to hf_optim with this line.",
                       kernel.describe())


def threads_for(kernel: Kernel) -> int | None:
    """The OpenMP thread count to run ``kernel``'s next chunks with (None: leave it as it is)."""
    if not cpu_threads.adjustable():
        return None
    entry = _entries.get(kernel)
    if entry is None or not entry.ready:
        return None
    many = torch.get_num_threads()
    if entry.threads is None or entry.threads.many != many:
        entry.threads = cpu_threads.ThreadChoice(many)
    choice = entry.threads
    return choice.pick(lambda count: _available(kernel, entry, count) if choice.wants_one else count in entry.ready)


def record(kernel: Kernel, threads: int, seconds: float, elements: int) -> None:
    """Account a run of ``kernel``'s compiled chunks (all of them compiled) for the thread-count choice."""
    entry = _entries.get(kernel)
    if entry is not None and entry.threads is not None:
        entry.threads.record(threads, seconds, elements)


def wait(timeout: float | None = None) -> bool:
    """Wait until no compilation is pending (tests, benchmarks): each kernel the background worker compiled is then
    loaded in this thread; False if ``timeout`` seconds passed first."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        for kernel, entry in list(_entries.items()):
            for threads in list(entry.warmups):
                _finish(kernel, entry, threads, block=False)
        if not any(entry.pending for entry in list(_entries.values())):
            return True
        if deadline is not None and time.monotonic() > deadline:
            return False
        time.sleep(0.01)


def forget() -> None:
    """Drop every compiled kernel and thread choice of this process (tests), and withdraw its requests from the
    background worker's queue (the worker is shared: it finishes its current kernel and exits when nobody waits)."""
    with _lock:
        for entry in _entries.values():
            for warmup in entry.warmups.values():
                warmup.close(kill=True)
        _entries.clear()
        _requests.clear()
        _reap()
