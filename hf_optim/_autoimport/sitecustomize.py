"""Imported by Python at start-up in every process that ``hf-optim run`` starts, directly or through a launcher.

``hf_optim.run`` puts this directory first on ``PYTHONPATH``, so Python's ``site`` imports this module as
``sitecustomize``. It runs the ``sitecustomize`` it shadows (a distribution's or a virtual environment's own), then
imports hf_optim, so that ``optim="lamb_8bit"`` and hf_optim's takeover of transformers' names hold in training
processes the user's command starts (``trl sft`` and ``accelerate launch`` run the training script as a new
process, ``torchrun`` one per rank), and hf_optim's warnings print as one line each there. Standard library only
until the hf_optim import: this runs before anything else.
"""

import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _run_shadowed_sitecustomize() -> None:
    others = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", others)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


def _import_hf_optim() -> None:
    try:
        import hf_optim
    except ModuleNotFoundError as exc:
        if exc.name != "hf_optim":
            raise
        # hf_optim ran from a directory that is not on this process's path (a source checkout): append that
        # directory, after everything else, so it never shadows an installed package.
        sys.path.append(os.path.dirname(os.path.dirname(_HERE)))
        import hf_optim
    if getattr(hf_optim, "__file__", None) is None:  # a folder named hf_optim without __init__.py came first
        spec = importlib.util.spec_from_file_location("_hf_optim_autoimport", os.path.join(_HERE, "__init__.py"))
        helpers = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(helpers)
        note = helpers.replace_namespace_package()
        if note:
            sys.stderr.write(note + "\n")
        import hf_optim
    hf_optim.notices.one_line_warnings()  # as `hf-optim run` prints them in its own process


try:
    _run_shadowed_sitecustomize()
finally:  # a failing sitecustomize of the user's is reported by site as usual; hf_optim is imported all the same
    _import_hf_optim()
