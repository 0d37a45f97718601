"""How ``import hf_optim`` starts: everything at once (torch, the optimizer classes, transformers' patch), except in
the ``hf-optim`` command.

The command answers ``--help``, a mistyped recipe or optimizer name, an unknown key or an output directory that
holds a run before torch is imported (which takes seconds). There ``import hf_optim``, ``hf_optim.recipes`` and
``hf_optim.monitor`` are deferred: :func:`finish` imports what they import. The command calls it once its checks
that need no torch have passed, before anything else; an attribute of one of those packages calls it too. Standard
library only.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

_state = {"deferred": None}

CLI_MODULE = "hf_optim.cli"


def started_as_cli() -> bool:
    """Whether this process is the ``hf-optim`` command: its console script (``hf-optim``, ``hf-optim.exe``,
    ``hf-optim-script.py``) or ``python -m hf_optim.cli``."""
    argv0 = sys.argv[0] if sys.argv else ""
    if re.sub(r"(-script\.pyw?|\.exe)$", "", Path(argv0).name) == "hf-optim":
        return True
    # `python -m hf_optim.cli`: while the package is imported, argv[0] is "-m" and the module is in orig_argv
    orig = list(getattr(sys, "orig_argv", ()))
    return argv0 == "-m" and (CLI_MODULE in orig and orig[orig.index(CLI_MODULE) - 1] == "-m"
                              or f"-m{CLI_MODULE}" in orig)


def deferred() -> bool:
    """Whether ``import hf_optim`` (and ``import hf_optim.recipes``) have deferred their imports (in the
    ``hf-optim`` command, until :func:`finish`)."""
    if _state["deferred"] is None:
        _state["deferred"] = started_as_cli()
    return bool(_state["deferred"])


def is_submodule(name: str) -> bool:
    """Whether ``hf_optim.<name>`` is a module or package (found, not imported)."""
    return (Path(__file__).parent / f"{name}.py").is_file() or (Path(__file__).parent / name / "__init__.py").is_file()


def deferred_getattr(module: str, names: list[str]) -> Callable[[str], object]:
    """A package's ``__getattr__`` while its imports are deferred: the first of ``names`` asked for finishes the
    start-up (:func:`finish`), which binds them all."""

    def __getattr__(name: str) -> object:
        if name not in names:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        finish()
        return sys.modules[module].__dict__[name]

    return __getattr__


def finish() -> None:
    """Import what ``import hf_optim`` and ``import hf_optim.recipes`` import (idempotent); a no-op where they
    imported it at once."""
    if not _state["deferred"]:
        return
    _state["deferred"] = False
    package = sys.modules["hf_optim"]
    from hf_optim import _exports

    for name in _exports.__all__:
        setattr(package, name, getattr(_exports, name))
    package.__all__ = list(_exports.__all__)
    for name in ("hf_optim.recipes", "hf_optim.monitor"):  # the packages that defer too, where imported
        if name in sys.modules:
            sys.modules[name]._load()  # type: ignore[attr-defined]
