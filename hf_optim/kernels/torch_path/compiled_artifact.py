"""A compiled CPU kernel saved whole by the background compiler, and loaded beside the steps by the training process.

Why: loading a kernel through ``torch.compile`` from inductor's warm cache still traces the update with dynamo in
the calling thread (1-2 s on an idle 2-core machine, 10 s and more on a busy one), and dynamo must not run beside
the training in another thread: it sets the process's random state back after tracing. torch's ahead-of-time
compilation (``torch.compile(fn).aot_compile``, torch 2.10 and later) saves the traced graph, its guards and
inductor's code in one file; loading it (:func:`torch.compiler.load_compiled_function`) traces nothing and touches no
random state, so it runs in a thread of its own while the steps go on eagerly.

The file is written by the background worker next to the kernel's warm marker (``<key>.aot`` beside
``<key>.ready``); where torch lacks the API, or a file is missing or fails to load, the training process falls back
to compiling from inductor's cache in its own thread, as before (same results: every path computes the same bits).
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger("hf_optim")

SUFFIX = ".aot"
FORMAT = 1
"""Part of a kernel's cache key (``cpu_compile.kernel_key``): a warm marker left by a worker that saved no file, or
an older kind of file, names another key, so the kernel is compiled once more and saved."""


def supported() -> bool:
    """Whether this torch can load a saved compiled function."""
    return hasattr(torch.compiler, "load_compiled_function")


def path_beside(marker: Path) -> Path:
    """The saved kernel of the warm marker ``marker`` (``<key>.ready`` -> ``<key>.aot``)."""
    return marker.with_suffix(SUFFIX)


def save(compiled: Callable, args: tuple, path: Path, options: dict) -> None:
    """Where this torch can (:func:`supported`), compile ``compiled`` (a ``torch.compile`` result) ahead of time on
    ``args`` and save it to ``path`` atomically (a reader never sees half a file). The dynamic marks and the thread
    count in effect are the caller's; ``options`` are inductor settings (``aot_compile`` does not take those given to
    ``torch.compile``: without them it built inductor's precompiled header, 13 s more on a cold cache). Run it in a
    process of its own: the settings are patched process-wide while it compiles."""
    aot_compile = getattr(compiled, "aot_compile", None)
    if aot_compile is None or not supported():
        return  # an older torch: the training process compiles from inductor's cache instead
    from torch._inductor import config

    with config.patch(options):
        artifact = aot_compile((args, {}))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    os.close(fd)
    try:
        artifact.save_compiled_function(temporary)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


SWITCH_INTERVAL_S = 1e-4
"""Python's thread switch interval while a kernel loads (the default is 5 ms). The loading thread is busy in Python
(imports, unpickling) and the training thread gives up the GIL in every torch operation; it then waits up to the
switch interval to get it back, which made a 15 ms eager step of the quickstart's optimizer take up to 0.8-1.1 s
beside a load. With 0.1 ms its longest step was 0.25-0.4 s and the load took 2.5-3 s instead of 2 s
(docs/performance.md#first-step-and-compilation-cpu)."""

_one_load_at_a_time = threading.Lock()
"""Kernels load one after another: they compete for the same GIL, so loading two at once only slows the steps."""


def _after_fork_in_child() -> None:
    """A forked child has none of its parent's loading threads: a lock one of them held would never be released."""
    global _one_load_at_a_time
    _one_load_at_a_time = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Loading:
    """A saved kernel being loaded in a daemon thread of this process; :meth:`result` once :meth:`done`.

    ``options``: the inductor settings it was compiled with. Loading builds the kernel's C++ library again unless it
    finds it in inductor's cache under the same build settings (a cold cache's first load took 16.8 s instead of
    1.6 s without them). They are patched process-wide while it loads; a compilation of the user's own elsewhere in
    the process meanwhile would only compile with them too (one compile thread, no precompiled header)."""

    def __init__(self, path: Path, options: dict, background: float | None = None,
                 before: Callable[[], None] | None = None):
        self.path, self.options, self._before = path, options, before
        self.background = background
        """Seconds the background worker took to compile it, when this process queued it (for the log line)."""
        self.started = time.perf_counter()
        self.seconds = 0.0
        self._function: Callable | None = None
        self.error = ""
        self._thread = threading.Thread(target=self._load, name=f"hf_optim load {path.stem[:8]}", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        with _one_load_at_a_time:
            interval = sys.getswitchinterval()
            sys.setswitchinterval(SWITCH_INTERVAL_S)
            try:
                if self._before is not None:  # in this thread too: it may import what the load needs
                    self._before()
                from torch._inductor import config

                with config.patch(self.options), open(self.path, "rb") as file:
                    self._function = torch.compiler.load_compiled_function(file)
            except Exception as error:  # an unreadable or incompatible file: the caller compiles the kernel itself
                self.error = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:300]}"
            finally:
                sys.setswitchinterval(interval)
        self.seconds = time.perf_counter() - self.started

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        self._thread.join(timeout)
        return self.done()

    def result(self) -> Callable | None:
        """The loaded kernel, or None when loading failed (:attr:`error` says why)."""
        return self._function
