"""A compiled CPU kernel saved whole by the background compiler, and loaded between two steps by the training process.

Why: loading a kernel through ``torch.compile`` from inductor's warm cache still traces the update with dynamo in
the calling thread (1-2 s on an idle 2-core machine, 10 s and more on a busy one), and dynamo sets the process's
random state back after tracing. torch's ahead-of-time compilation (``torch.compile(fn).aot_compile``, torch 2.10 and
later) saves the traced graph, its guards and inductor's code in one file; loading it
(:func:`torch.compiler.load_compiled_function`) traces nothing, touches no random state and takes about 0.2 s. The
training process loads it in the thread that steps, between two kernels' runs (:func:`load`): hf_optim runs no thread
of its own beside the user's.

The file is written by the background worker next to the kernel's warm marker (``<key>.aot`` beside
``<key>.ready``); where torch lacks the API, or a file is missing or fails to load, the training process falls back
to compiling from inductor's cache in its own thread, as before (same results: every path computes the same bits).
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger("hf_optim")

SUFFIX = ".aot"
FORMAT = 1
"""Part of a kernel's cache key (``compile_requests.kernel_key``): a warm marker left by a worker that saved no file, or
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


@dataclass
class Loaded:
    """A saved kernel read back (:func:`load`): the function, or None with :attr:`error` saying why."""

    function: Callable | None
    error: str
    seconds: float


def load(path: Path, options: dict, before: Callable[[], None] | None = None) -> Loaded:
    """Load the saved kernel at ``path`` in the calling thread: the training thread, between two steps' kernels.

    Not in a thread of its own beside the steps: loading imports modules and runs Python's compiler (inductor's
    generated wrapper, dynamo's guards), and a thread doing that beside the user's broke the user's process
    (``dictionary changed size during iteration`` in a loop over ``sys.modules``, and Python 3.11's AST validation,
    which is not thread-safe, aborting a pytest session); a second runnable thread also made every OpenMP barrier of
    the steps beside it wait for a core (steps 10-40x slower while it loaded). Here it costs the step that loads
    once: about 0.2 s per kernel where dynamo and inductor are imported already (any Trainer run), plus their
    import, 2-4 s, in a plain script (docs/guide/backends.md#when-the-cpu-kernels-compile).

    ``options``: the inductor settings it was compiled with. Loading builds the kernel's C++ library again unless it
    finds it in inductor's cache under the same build settings (a cold cache's first load took 16.8 s instead of
    1.6 s without them); they are patched while it loads. ``before``: run first (imports the load needs)."""
    started = time.perf_counter()
    function, error = None, ""
    try:
        if before is not None:
            before()
        from torch._inductor import config

        with config.patch(options), open(path, "rb") as file:
            function = torch.compiler.load_compiled_function(file)
    except Exception as failure:  # an unreadable or incompatible file: the caller compiles the kernel itself
        error = f"{type(failure).__name__}: {(str(failure).strip().splitlines() or [''])[0][:300]}"
    return Loaded(function, error, time.perf_counter() - started)
