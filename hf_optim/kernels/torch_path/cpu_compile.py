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

The background compiler, and this process's requests to it: :mod:`hf_optim.kernels.torch_path.compile_requests`.
What a kernel is and the probe inputs it compiles on: :mod:`hf_optim.kernels.torch_path.cpu_kernel`.

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

Log lines (logger ``hf_optim``): one INFO line when a compilation starts (which kernel, where it is cached), one when
it has taken more than a second (in the background: how long since it was queued, and the cache hit here), and a
WARNING when it fails (that kernel then keeps running eagerly), with the worker's error line.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hf_optim.kernels.torch_path import compile_queue, compile_requests, compiled_artifact, cpu_threads
from hf_optim.kernels.torch_path.compile_requests import QueuedCompile, cache_location, start_warmup, warm_marker
from hf_optim.kernels.torch_path.cpu_kernel import (
    INDUCTOR_OPTIONS,
    Kernel,
    canonical,
    import_cpp_extension_quietly,
    kernel_of,
    probe_factory,
    run_probe,
)
from hf_optim.kernels.torch_path.cpu_kernel import twin as _twin

logger = logging.getLogger("hf_optim")

COMPILE_ENV = "HF_OPTIM_COMPILE"
MODES = ("auto", "1", "0")
"""Valid values of ``HF_OPTIM_COMPILE``: compile in the background, before the first step, never."""

EAGER_WHILE_COMPILING = 1 << 20
"""Largest run of a kernel's chunks (elements per step) that runs eagerly while the kernel compiles in the background; a
larger one waits for the compilation. Eagerly an 8-bit chunk costs 20-50x its compiled time (measured; eager against
compiled runs: docs/lab/2026-measurements.md#cpu-first-step-and-busy-machines-issue-23), so a large step would take
longer than the compilation, and an eager step competes with the compiler for the cores and for Python's GIL: on
Llama-3.2-1B's LoRA set (11.3M elements) one eager AdamW8bit step outlasted the whole compilation. A 1M-element eager
step takes well under a second on an idle 2-core machine."""


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
    entry.probe = probe_factory(kernel, entry.hyper, entry.key)


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
        run_probe(kernel, entry.compiled, entry.probe, threads)
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
    loaded = compiled_artifact.load(path, INDUCTOR_OPTIONS, before=import_cpp_extension_quietly)
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
        compile_requests.forget()
