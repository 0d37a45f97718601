"""The start-up hook of ``hf-optim run`` (see ``sitecustomize.py``): a directory put on ``PYTHONPATH``, not an API.

Also :func:`replace_namespace_package`, which the hook, ``hf-optim run`` and the ``hf-optim`` command call. Standard
library only: the hook loads this file by its path, before hf_optim is importable.
"""

import importlib.util
import os
import sys

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def replace_namespace_package() -> str | None:
    """Make ``sys.modules["hf_optim"]`` this package when ``import hf_optim`` found a folder named hf_optim without
    ``__init__.py`` first (an empty namespace package: importing it does nothing, so the Trainer would build other
    libraries' optimizers for hf_optim's names, without a word). Setuptools' editable install finds the package
    with a finder that Python asks only after ``sys.path``, so such a folder on ``PYTHONPATH`` (or beside a script)
    wins. Returns the line to print when it replaced one, else None."""
    found = sys.modules.get("hf_optim")
    if found is None or getattr(found, "__file__", None) is not None:
        return None
    spec = importlib.util.spec_from_file_location("hf_optim", os.path.join(PACKAGE_DIR, "__init__.py"),
                                                  submodule_search_locations=[PACKAGE_DIR])
    package = importlib.util.module_from_spec(spec)
    sys.modules["hf_optim"] = package
    try:
        spec.loader.exec_module(package)
    except BaseException:
        sys.modules["hf_optim"] = found
        raise
    for name, module in list(sys.modules.items()):  # submodules imported through the namespace package
        if name.count(".") == 1 and name.startswith("hf_optim.") and not hasattr(package, name[9:]):
            setattr(package, name[9:], module)
    shadows = ", ".join(getattr(found, "__path__", None) or ["?"])
    return (f"[hf_optim] note: {shadows} (a folder named hf_optim without __init__.py) shadows the hf_optim "
            f"package on this path; imported {PACKAGE_DIR} instead")
