"""When the CPU path's update is compiled by inductor, on which inputs, and what runs meanwhile.

The multi-tensor path (:mod:`hf_optim.kernels.multi_tensor`) calls :func:`hf_optim.kernels.elementwise.update` once
per chunk. Compiled by inductor it runs several times faster than eagerly (8-bit state most), but compiling costs
seconds to minutes the first time (docs/benchmarks.md, the first-step table): dynamo traces the rule, inductor writes
C++ and gcc builds it; the first compilation of a process also probes the CPU's vector instructions by compiling
test programs, and the first of a machine precompiles torch's headers. ``HF_OPTIM_COMPILE`` says when to pay:

- ``auto`` (the default, also when unset or empty): in the background. The first chunk of a kernel starts its
  compilation in a background thread and runs eagerly, and so does every chunk of that kernel until the compiled
  kernel is ready; from then on the steps use it. A short run never waits for a compiler; a long one runs compiled
  after the first seconds (a few steps on a large model, more on a small one, whose eager steps are short).
- ``1``: before the first step that needs it, which waits for the compilation.
- ``0``: never; every step runs eagerly (no C++ compiler needed).

Why switching in mid-run changes no result: eager and compiled updates compute the same bits (the rules use
single-rounding operations only, see :mod:`hf_optim.kernels.exact_math`; inductor compiles without contraction; every
reduction is within one 256-element block), and ``tests/test_multi_tensor.py`` compares them bit for bit, a run that
switches after its first steps included; and the background compiler does not rewind the training thread's random
numbers, as dynamo would (:func:`_keep_other_threads_rng`). So the step at which a run switches depends on the
machine's speed, the optimizer's results do not. (A whole quickstart run whose compilation overlapped tens of steps
was still seen to drift from the eager run at rounding level, in the model's forward or backward: cause open,
docs/benchmarks.md.)

One graph per kernel: a kernel (:class:`Kernel`: rule, slot layouts, output mode, parameter and gradient dtypes,
stochastic rounding) is compiled once, on probe inputs of :data:`PROBE_BLOCKS` blocks whose block dimension is marked
dynamic, so every chunk length from 2 blocks up shares the graph from the start (a chunk of one block runs eagerly:
dynamo would specialize a dimension of size 1). The calls pass aliases of their tensors that start at storage offset
0 and are not views (:func:`canonical`, a DLPack round trip: no copy): dynamo guards on where a view starts and on the
shape of the tensor it views, and would compile again for the first chunk of a buffer, for a tensor updated in place
rather than gathered, and so on. The OpenMP thread count is part of a graph's guards too: the one-thread variant that
:mod:`hf_optim.kernels.cpu_threads` may ask for is a second graph, compiled the same way when it is asked for.

Compile options (:data:`INDUCTOR_OPTIONS`), measured as CPU seconds of the whole process tree for the quickstart's
AdamW8bit on a cold cache (``benchmarks/first_step.py``): 34 s with inductor's defaults, 22 s with these:

- ``cpp.vec_isa_ok=True``: inductor trusts the CPU's flags (``/proc/cpuinfo``) for its vector instruction sets
  instead of compiling and loading a test program per instruction set, which cost 11 CPU seconds the first time a
  cache directory is used and 3 in every later process. An old compiler that lacks those instructions then fails
  the kernel's own compilation (a warning; the kernel runs eagerly). The result is cached per process by inductor,
  so a later ``torch.compile`` of the user's in the same process skips the test programs too.
- ``cpp_cache_precompile_headers=False``: inductor would precompile torch's headers once per user and machine (a
  150 MB file in the temporary directory, 10 CPU seconds) to save about a second per later kernel; an optimizer has
  one to four kernels.
- ``compile_threads=1``: one generated kernel per graph gains nothing from a pool of compile workers (the same CPU
  time measured with 2), and no worker processes are started.

Log lines (logger ``hf_optim``): one INFO line when a compilation starts (which kernel, where it is cached), one when
it has taken more than a second, and a WARNING when it fails (that kernel then keeps running eagerly).
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import queue
import sys
import threading
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch.utils.dlpack import from_dlpack, to_dlpack

from hf_optim.kernels import cpu_threads, elementwise
from hf_optim.kernels.dynamic_map import BLOCK_SIZE
from hf_optim.kernels.formats import SlotLayout

logger = logging.getLogger("hf_optim")

COMPILE_ENV = "HF_OPTIM_COMPILE"
MODES = ("auto", "1", "0")
"""Valid values of ``HF_OPTIM_COMPILE``: compile in the background, before the first step, never."""

PROBE_BLOCKS = 37
"""Blocks of the probe inputs a kernel is compiled on: a prime, so that no static size of any format (1 or 2 rows,
256 elements or 128 bytes per block, maps and tables) is a multiple of it and only the block dimensions vary."""

EAGER_WHILE_COMPILING = 1 << 20
"""Largest run of a kernel's chunks (elements per step) that runs eagerly while the kernel compiles in the
background; a larger one waits for the compilation. Eagerly an 8-bit chunk costs 20-50x its compiled time (measured:
docs/benchmarks.md), so a large step would take longer than the compilation, and an eager step competes with the
compiler for the cores and for Python's GIL: on Llama-3.2-1B's LoRA set (11.3M elements) one eager AdamW8bit step
outlasted the whole compilation. A 1M-element eager step takes well under a second on an idle 2-core machine."""

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
    """Where inductor keeps compiled kernels (``TORCHINDUCTOR_CACHE_DIR``, else its default), for the log line."""
    found = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if found:
        return found
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # older torch
        return "inductor's cache directory"
    return default_cache_dir()


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

    def describe(self) -> str:
        """``adamw_rule, 8-bit + 8-bit state, float32 parameters`` (for the log lines)."""
        state = " + ".join(f"{layout.format.bits}-bit" for layout in self.layouts)
        text = f"{getattr(self.rule, '__name__', 'rule')}, {state} state, {str(self.param_dtype)[6:]} parameters"
        if self.grad_dtype != self.param_dtype:
            text += f" ({str(self.grad_dtype)[6:]} gradients)"
        return text + (", stochastic rounding" if self.stochastic else "")


def kernel_of(rule: Callable, layouts: Sequence[SlotLayout], param: torch.Tensor, grad: torch.Tensor,
              out: torch.Tensor | None, tensors: Sequence[torch.Tensor], stochastic) -> Kernel:
    """The :class:`Kernel` of a block-form call of :func:`elementwise.update` with these arguments."""
    rows, index = [], 0
    for layout in layouts:
        rows.append(tensors[index].shape[0])
        index += layout.width
    return Kernel(rule, tuple(layouts), tuple(rows), out is not None, param.dtype, grad.dtype, stochastic is not None)


def canonical(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself, or, for a view or a tensor that does not start its storage, an alias of the same memory
    that does and is not a view (a DLPack round trip: no copy; the alias keeps ``tensor`` alive)."""
    if tensor._base is None and tensor.storage_offset() == 0:
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
    """A kernel's compiled function and which thread counts its graphs are compiled (or being compiled) for."""

    compiled: Callable
    ready: set[int] = field(default_factory=set)
    pending: set[int] = field(default_factory=set)
    failed: str | None = None
    probe: Callable[[int], tuple] | None = None  # blocks -> probe arguments (after `update`'s rule and layouts)
    threads: cpu_threads.ThreadChoice | None = None


_lock = threading.Lock()
_entries: dict[Kernel, _Entry] = {}
_jobs: queue.SimpleQueue = queue.SimpleQueue()
_worker: threading.Thread | None = None
_exit_hook: list[bool] = []  # registered once per process (a forked child inherits it)


def _after_fork_in_child() -> None:
    """A forked process (a dataloader worker, say) has no background compiler thread: it starts its own if it ever
    needs one, and what the parent was compiling is not pending in it."""
    global _worker, _jobs, _lock
    _worker, _jobs, _lock = None, queue.SimpleQueue(), threading.Lock()
    for entry in _entries.values():
        entry.pending.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _entry(kernel: Kernel) -> _Entry:
    with _lock:
        found = _entries.get(kernel)
        if found is None:
            found = _entries[kernel] = _Entry(_twin(kernel.rule))
        return found


def _probe_factory(kernel: Kernel, hyper: tuple, key: torch.Tensor | None) -> Callable[[int], tuple]:
    """A function of a block count that makes probe arguments for ``kernel``: zeroed parameters, gradients, output
    and flat state buffers (three chunks long, the chunk in the middle, as the real buffers are longer than a
    chunk), the formats' shared maps and tables, copies of ``hyper`` and of the rounding ``key``."""
    hyper = type(hyper)(*(value.detach().clone() for value in hyper))
    key = None if key is None else key.detach().clone()
    device = torch.device("cpu")

    def make(blocks: int) -> tuple:
        shape = (blocks, BLOCK_SIZE)
        param = torch.zeros(shape, dtype=kernel.param_dtype)
        grad = torch.zeros(shape, dtype=kernel.grad_dtype)
        out = torch.zeros(shape) if kernel.has_out else None
        tensors = []
        for layout, rows in zip(kernel.layouts, kernel.rows):
            n = blocks * BLOCK_SIZE
            buffers = layout.format.flat_buffers(rows, 3 * n, layout.signed, device, torch.zeros)
            tensors += [canonical(t) for t in layout.format.kernel_chunk(buffers, n, 2 * n, layout.signed, device)]
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


def _announce(kernel: Kernel, entry: _Entry, threads: int, background: bool) -> None:
    """The log line that says a compilation starts, from the thread that asks for it (a short run may end before
    the background compiler gets to run)."""
    where = ""
    if background:
        meanwhile = f"the {max(entry.ready)}-thread kernel" if threads == 1 and entry.ready else "eagerly"
        where = f" in the background; the steps run {meanwhile} until it is ready"
    logger.info("compiling the optimizer's CPU kernel for %s%s (once, cached in %s)", _what(kernel, entry, threads),
                where, cache_location())


def _compile(kernel: Kernel, entry: _Entry, threads: int) -> None:
    """Compile ``kernel``'s graph for ``threads`` OpenMP threads by running it once on probe inputs."""
    what = _what(kernel, entry, threads)
    start = time.perf_counter()
    try:
        probe = entry.probe(PROBE_BLOCKS)
        _mark_block_dims(probe, entry.probe(PROBE_BLOCKS + 1))
        with cpu_threads.threads(threads), torch.no_grad():
            entry.compiled(kernel.rule, kernel.layouts, *probe)
    except Exception as error:  # a missing or failing C++ compiler: the kernel keeps running eagerly
        first_line = (str(error).strip().splitlines() or [""])[0][:300]
        entry.failed = f"{type(error).__name__}: {first_line}"
        logger.warning("compiling the optimizer's CPU kernel for %s failed (%s); it runs eagerly (same results, "
                       "slower; HF_OPTIM_COMPILE=0 skips compiling)", what, entry.failed)
    else:
        entry.ready.add(threads)
        elapsed = time.perf_counter() - start
        if elapsed > 1.0:
            logger.info("compiled the optimizer's CPU kernel for %s in %.1f s", what, elapsed)
    finally:
        entry.pending.discard(threads)


SWITCH_INTERVAL = 0.0005
"""Python's thread switch interval (seconds) while a compilation runs in the background (the default is 0.005)."""


NICENESS = 10
"""How much lower than the process's the background compiler thread's scheduling priority is (Linux: ``nice`` is
per thread, and the C++ compiler it starts inherits it)."""


def _lower_priority() -> None:
    """Make the calling thread (the background compiler) yield the cores to the training's threads: on a busy
    machine an eager step waits for the CPU at each of its hundreds of GIL hand-offs, and a compiler running at the
    same priority stretched each step of a 3-step quickstart run to seconds. Linux only (elsewhere a thread id is
    not a process id ``setpriority`` accepts)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        thread = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + NICENESS))
    except OSError:  # not permitted (a sandbox): compile at the same priority
        pass


_compiling = threading.local()
"""``_compiling.here`` is True in the background compiler thread while it compiles."""


def _keep_other_threads_rng() -> None:
    """Stop dynamo from rewinding the training's random numbers from the background compiler thread.

    Dynamo saves the process's CPU random state before it traces a function and sets it back afterwards
    (``preserve_global_state`` in ``torch/_dynamo/convert_frame.py``, through ``torch.random.set_rng_state``). From a
    background thread that rewinds the generator the training thread has drawn from meanwhile (dropout masks,
    data shuffling): measured on the quickstart, the run whose compilation overlapped its first steps drew the same
    dropout masks twice and its losses left the eager run's from step 5 on. The rule traced here draws no random
    numbers (stochastic rounding takes its key as a tensor), so in that thread, while it compiles, the restore is
    skipped; every other caller of ``torch.random.set_rng_state`` is unaffected."""
    original = torch.random.set_rng_state
    if getattr(original, "keeps_other_threads_rng", False):
        return

    @functools.wraps(original)
    def set_rng_state(new_state: torch.Tensor) -> None:
        if not getattr(_compiling, "here", False):
            original(new_state)

    set_rng_state.keeps_other_threads_rng = True
    torch.random.set_rng_state = set_rng_state


def _work() -> None:
    """The background compiler: one job at a time, for the life of the process.

    While it compiles, Python's thread switch interval is :data:`SWITCH_INTERVAL`: dynamo and inductor are Python
    code that holds the GIL, and an eager step is hundreds of short torch calls that each need it back; with the
    default interval (5 ms) every one of them waited up to 5 ms, and a quickstart step that takes 60 ms took
    seconds while a kernel compiled."""
    interval = None  # the switch interval to restore when the queue is empty
    _lower_priority()
    while True:
        kernel, entry, threads = _jobs.get()
        if interval is None:
            interval = sys.getswitchinterval()
            sys.setswitchinterval(min(interval, SWITCH_INTERVAL))
        _compiling.here = True
        try:
            _compile(kernel, entry, threads)
        except BaseException:  # the interpreter is shutting down: nothing left to compile for
            return
        finally:
            _compiling.here = False
            if _jobs.empty():
                sys.setswitchinterval(interval)
                interval = None


def _finish_at_exit() -> None:
    """At interpreter exit: drop the compilations not yet started and wait for the one running. A process that
    exited while the background thread was inside inductor aborted ("terminate called without an active
    exception", exit status -6, measured on a 3-step quickstart run); the finished kernel is cached for the next
    run."""
    while True:
        try:
            _, entry, threads = _jobs.get_nowait()
        except queue.Empty:
            break
        entry.pending.discard(threads)
    if any(entry.pending for entry in list(_entries.values())):
        logger.info("finishing the optimizer's CPU kernel compilation before exiting (cached in %s for the next run)",
                    cache_location())
        wait()


def _start(kernel: Kernel, entry: _Entry, threads: int) -> None:
    """Compile ``kernel`` for ``threads`` threads now (``HF_OPTIM_COMPILE=1``) or in the background."""
    global _worker
    entry.pending.add(threads)
    background = compile_mode() != "1"
    _announce(kernel, entry, threads, background)
    if not background:
        _compile(kernel, entry, threads)
        return
    with _lock:
        if _worker is None:
            _keep_other_threads_rng()
            if not _exit_hook:
                atexit.register(_finish_at_exit)
                _exit_hook.append(True)
            # A daemon thread: a run that ends before its compilation does not wait for it.
            _worker = threading.Thread(target=_work, name="hf_optim-compile", daemon=True)
            _worker.start()
    _jobs.put((kernel, entry, threads))


def _available(kernel: Kernel, entry: _Entry, threads: int) -> bool:
    """Whether ``kernel``'s graph for ``threads`` threads can run now; starts its compilation if it has not."""
    if threads in entry.ready:
        return True
    if entry.failed is None and threads not in entry.pending and entry.probe is not None:
        _start(kernel, entry, threads)
    return threads in entry.ready


def prepare(kernel: Kernel, hyper: tuple, key: torch.Tensor | None, elements: int) -> None:
    """Before a run of ``elements`` elements of ``kernel``'s chunks (``hyper``: the rule's scalars as 0-d tensors,
    ``key``: the stochastic rounding key or None): start compiling its graph if it has not been, and when it is
    still compiling and the run exceeds :data:`EAGER_WHILE_COMPILING` elements, wait for it."""
    entry = _entries.get(kernel) or _entry(kernel)
    if entry.probe is None:
        entry.probe = _probe_factory(kernel, hyper, key)
    threads = torch.get_num_threads()
    if _available(kernel, entry, threads) or elements <= EAGER_WHILE_COMPILING:
        return
    while threads in entry.pending:
        time.sleep(0.005)


def run_compiled(rule, layouts, param, grad, out, tensors, hyper, stochastic=None, kernel: Kernel | None = None
                 ) -> bool:
    """Run the compiled :func:`elementwise.update` on one block-form chunk (``param`` of shape ``(blocks, 256)``,
    at least 2 blocks) if its graph is ready, and return True; else start compiling it (unless it is compiling or
    failed) and return False: the caller runs the chunk eagerly."""
    kernel = kernel or kernel_of(rule, layouts, param, grad, out, tensors, stochastic)
    entry = _entries.get(kernel) or _entry(kernel)
    if entry.probe is None:
        entry.probe = _probe_factory(kernel, hyper, None if stochastic is None else stochastic[1])
    if not _available(kernel, entry, torch.get_num_threads()):
        return False
    stochastic = None if stochastic is None else (canonical(stochastic[0]), canonical(stochastic[1]))
    entry.compiled(rule, kernel.layouts, canonical(param), canonical(grad), None if out is None else canonical(out),
                   [canonical(t) for t in tensors], hyper, stochastic)
    return True


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
    """Wait until no compilation is pending (tests, benchmarks); False if ``timeout`` seconds passed first."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while any(entry.pending for entry in list(_entries.values())):
        if deadline is not None and time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def forget() -> None:
    """Drop every compiled kernel and thread choice of this process (tests); waits for pending compilations."""
    wait()
    with _lock:
        _entries.clear()
