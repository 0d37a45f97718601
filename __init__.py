"""Not the package: hf_optim's package is the ``hf_optim/`` folder beside this file.

Python imports this file as ``hf_optim`` only when it runs from the folder that holds this checkout under the name
``hf_optim`` (``git clone ... hf_optim``, then ``python train.py`` beside it): the script's folder comes first on
``sys.path``, and without this file the checkout would import as an empty namespace package. ``import hf_optim``
would then succeed and do nothing, and the Trainer would build bitsandbytes' optimizers for ``optim=`` names that
hf_optim takes over, without a word (issue 43). Setuptools' editable install (``pip install -e .``) finds the
package through a finder that Python consults only after ``sys.path``, so it does not prevent that.

This file puts the real package in its place: the installed hf_optim (what the same script gets from any other
folder), or, when none is installed, this checkout's own ``hf_optim/``. From any other folder this file is never
imported. Standard library only.
"""

import importlib.util
import os
import sys


def _installed_package():
    """The spec Python finds for ``hf_optim`` with this checkout's parent folder left out of the search (None when
    hf_optim is not installed elsewhere)."""
    here = os.path.dirname(os.path.abspath(__file__))
    parent = os.path.dirname(here)
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != parent]
    try:
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None)
            spec = find_spec("hf_optim", None) if find_spec is not None else None
            if spec is not None and spec.loader is not None and spec.origin not in (None, os.path.abspath(__file__)):
                return spec
        return None
    finally:
        sys.path[:] = saved


def _checkout_package():
    package = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_optim")
    return importlib.util.spec_from_file_location("hf_optim", os.path.join(package, "__init__.py"),
                                                  submodule_search_locations=[package])


def _import_in_place() -> None:
    spec = _installed_package() or _checkout_package()
    module = importlib.util.module_from_spec(spec)
    sys.modules["hf_optim"] = module  # the import statement returns what sys.modules holds when this file ends
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop("hf_optim", None)
        raise


if __name__ == "hf_optim":
    _import_in_place()
