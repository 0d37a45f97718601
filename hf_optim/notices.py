"""What hf_optim does about console noise that is not the user's concern, wherever hf_optim runs.

- :data:`OPTIONAL_KERNEL_NOTICES`: notices that optional accelerated code is not there, when everything works
  without it (bitsandbytes logs one at import on CPUs with AVX512-BF16; DeepSpeed one when it finds no GPU, at an
  import accelerate makes whenever DeepSpeed is installed). ``import hf_optim`` hides them for the
  rest of the process (:func:`hide_optional_kernel_notices`) unless their logger is set to DEBUG, so that
  ``hf-optim plot``, ``import hf_optim.monitor`` and a training script do not print them;
  ``hf-optim train -v`` shows them (:func:`show_optional_kernel_notices`).
- :func:`one_line_warnings`: hf_optim's own warnings as one ``[hf_optim] warning: ...`` line instead of Python's
  two-line ``file:line: UserWarning: ...`` with a source line; ``hf-optim run`` turns it on in the processes it
  starts (``hf-optim train`` formats every warning itself: :mod:`hf_optim.recipes.console`).

Standard library only: ``hf_optim/__init__`` imports it first.
"""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path

OPTIONAL_KERNEL_NOTICES = {
    # bitsandbytes >= 0.49 on CPUs with AVX512-BF16: a faster 4-bit matmul fetched from the Hub by the `kernels`
    # package; without it bitsandbytes runs its own CPU kernel (and the message is logged once per import).
    "bitsandbytes.backends.cpu.ops": ("Failed to load CPU gemm_4bit_forward from kernels-community",),
    # DeepSpeed on a machine where torch finds no GPU: it runs on its CPU accelerator (what a CPU run wants). accelerate
    # imports DeepSpeed in every Trainer run once it is installed (to recognise its engine), so without this the line
    # appears in runs that do not use DeepSpeed at all.
    "DeepSpeed": ("Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it",),
}
"""Logger name -> message prefixes of the notices :func:`hide_optional_kernel_notices` hides."""

_state = {"shown": False, "installed": False, "one_line": None}


class _OptionalKernelNotice(logging.Filter):
    """Drops the notices of one logger unless they are shown, or that logger is set to DEBUG."""

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
        logging.getLogger(name).addFilter(_OptionalKernelNotice(prefixes))
    _state["installed"] = True


def show_optional_kernel_notices(shown: bool = True) -> None:
    """Show (``True``) or hide again (``False``) the notices :func:`hide_optional_kernel_notices` hides."""
    _state["shown"] = bool(shown)


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
