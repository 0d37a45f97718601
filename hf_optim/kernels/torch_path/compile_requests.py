"""This process's requests to the background compiler, and where its results are found.

The background compiler is one process per machine and inductor cache directory
(:mod:`hf_optim.kernels.torch_path.cpu_compile_worker`, at a lower priority), however many training processes,
notebooks or test runs need kernels: a lock in the cache directory admits one, and the kernels wait in a queue there
(:mod:`hf_optim.kernels.torch_path.compile_queue`), one job per kernel whichever processes asked for it. It compiles
them one after another into inductor's on-disk cache, saves each compiled kernel whole beside its warm marker
(:func:`warm_marker`, :func:`cpu_kernel.save`; a later process that finds them loads that kernel at its first step)
and exits once no queued kernel has a
live requester: after the processes that asked for kernels have exited it finishes the kernel it is compiling (that
warms the cache) and starts no other. A process that finds its kernel queued or being compiled by another's request
waits for the marker, running eagerly meanwhile. A compile error reaches each requester (one WARNING; the kernel runs
eagerly).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from hf_optim.kernels.torch_path import compile_queue, compiled_artifact, elementwise
from hf_optim.kernels.torch_path.cpu_kernel import INDUCTOR_OPTIONS, Kernel


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


def _after_fork_in_child() -> None:
    """A forked process (a dataloader worker, say) has no requests and started no worker: they are its parent's."""
    _requests.clear()
    _spawned.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


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


def forget() -> None:
    """Drop this process's requests (tests; :func:`cpu_compile.forget` withdraws them first) and reap exited workers."""
    _requests.clear()
    _reap()
