"""What hf_optim does about console noise that is not the user's concern, wherever hf_optim runs.

Every mute here is narrow: a filter on one logger that drops the records whose message starts with a known text,
or the lines of a native print that match a known pattern. No logger's level, handlers or propagation change, and
nothing else that logger or the process prints is hidden.

- :data:`OPTIONAL_KERNEL_NOTICES`: notices that optional accelerated code is not there, when everything works
  without it (bitsandbytes asks the `kernels` package for a CPU kernel at import on CPUs with AVX512-BF16, and both
  log; DeepSpeed logs one when it finds no GPU, at an import accelerate makes whenever DeepSpeed is installed).
  ``import hf_optim`` hides them for the rest of the process (:func:`hide_optional_kernel_notices`) unless their
  logger is set to DEBUG, so that ``hf-optim plot``, ``import hf_optim.monitor`` and a training script do not print
  them; ``hf-optim train -v`` shows them (:func:`show_optional_kernel_notices`).
- :func:`native_lines_hidden`: lines a library's C++ side writes straight to file descriptor 2 during a block,
  dropped by pattern; every other line written there meanwhile is printed after the block.
- :func:`one_line_warnings`: hf_optim's own warnings as one ``[hf_optim] warning: ...`` line instead of Python's
  two-line ``file:line: UserWarning: ...`` with a source line; ``hf-optim run`` turns it on in the processes it
  starts (``hf-optim train`` formats every warning itself: :mod:`hf_optim.recipes.console`).

Standard library only: ``hf_optim/__init__`` imports it first.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

_BNB_CPU_KERNEL = "kernels-community/quantization-bitsandbytes"  # the Hub kernel bitsandbytes asks `kernels` for

OPTIONAL_KERNEL_NOTICES = {
    # bitsandbytes >= 0.49 on CPUs with AVX512-BF16: a faster 4-bit matmul fetched from the Hub by the `kernels`
    # package; without it bitsandbytes runs its own CPU kernel (and the message is logged once per import).
    "bitsandbytes.backends.cpu.ops": ("Failed to load CPU gemm_4bit_forward from kernels-community",),
    # `kernels` >= 0.19 (transformers 5.25 installs it), asked for that kernel with the Hub offline: it cannot check
    # the publisher, and says so before it looks in its local cache (a kernel there was checked when downloaded).
    # Only that one kernel's notice: any other repository's is the user's concern.
    "kernels._internals.hf_hub": (f"Skipping publisher trust check for '{_BNB_CPU_KERNEL}' ",),
    # DeepSpeed on a machine where torch finds no GPU: it runs on its CPU accelerator (what a CPU run wants). accelerate
    # imports DeepSpeed in every Trainer run once it is installed (to recognise its engine), so without this the line
    # appears in runs that do not use DeepSpeed at all.
    "DeepSpeed": ("Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it",),
}
"""Logger name -> message prefixes of the notices :func:`hide_optional_kernel_notices` hides."""

_state = {"shown": False, "installed": False, "one_line": None}


class _Notice(logging.Filter):
    """Drops the records of one logger whose message starts with one of ``prefixes``, unless notices are shown
    (``hf-optim train -v``) or that logger is set to DEBUG; passes every other record."""

    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        if _state["shown"] or not str(record.msg).startswith(self.prefixes):
            return True
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def hide_optional_kernel_notices() -> None:
    """Hide :data:`OPTIONAL_KERNEL_NOTICES` from now on in this process (a filter on each logger, installed before
    the package that logs them is imported). Idempotent."""
    if _state["installed"]:
        return
    for name, prefixes in OPTIONAL_KERNEL_NOTICES.items():
        logging.getLogger(name).addFilter(_Notice(prefixes))
    _state["installed"] = True


def show_optional_kernel_notices(shown: bool = True) -> None:
    """Show (``True``) or hide again (``False``) the notices :func:`hide_optional_kernel_notices` and
    :func:`native_lines_hidden` hide."""
    _state["shown"] = bool(shown)


@contextlib.contextmanager
def native_lines_hidden(pattern: str) -> Iterator[None]:
    """Within the block, file descriptor 2 goes to a temporary file; after it, the lines written there that do not
    fully match ``pattern`` (a regular expression) are written back to it, so only the matching ones are lost. For a
    library's C++ side, which prints past Python's ``sys.stderr`` and its logging. Under ``-v`` nothing is hidden."""
    if _state["shown"]:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        try:
            os.dup2(held.fileno(), 2)
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [line for line in held.read().splitlines(keepends=True)
                    if not re.fullmatch(pattern.encode(), line.rstrip(b"\r\n"))]
            data = b"".join(kept)
            while data:  # os.write may write part of it (a pipe)
                data = data[os.write(2, data):]


def warning_source(filename: str) -> str:
    """The top-level package of the code that called ``warnings.warn`` (its ``stacklevel`` may point elsewhere:
    hf_optim's point at the user's line), else ``filename``'s name. Call it from a ``warnings.showwarning`` hook."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__") in _NOT_THE_CALLER:
        frame = frame.f_back
    package = str(frame.f_globals.get("__name__", "")).split(".")[0] if frame is not None else ""
    return package or Path(filename).name


_NOT_THE_CALLER = {"warnings", __name__, "hf_optim.recipes.console"}  # warnings' code and the showwarning hooks


def hf_optim_line(message) -> str:
    """``[hf_optim] warning: ...``: one of hf_optim's warnings as one line (its ``hf_optim:`` prefix dropped)."""
    return f"[hf_optim] warning: {str(message).removeprefix('hf_optim: ')}"


def one_line_warnings() -> None:
    """From now on, print hf_optim's warnings as one :func:`hf_optim_line` each on stderr; other packages' warnings
    keep Python's format. Idempotent."""
    if _state["one_line"] is not None:
        return
    previous = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if warning_source(filename) == "hf_optim" or str(message).startswith("hf_optim: "):
            print(hf_optim_line(message), file=sys.stderr if file is None else file)
        else:
            previous(message, category, filename, lineno, file, line)

    _state["one_line"] = show
    warnings.showwarning = show
