"""pytest plugin that runs another project's own optimizer tests against hf_optim (see run_peer_suites.py).

Loaded with ``-p hf_optim_peer_plugin``; what it does is chosen by environment variables, so the peer's test files
run unmodified from the peer's own checkout:

- ``HF_OPTIM_FIRST=1``: ``import hf_optim`` before the peer's tests are collected (hf_optim then builds the
  Trainer's ``optim=`` names it takes over, as a user's ``import hf_optim`` first does).
- ``HF_OPTIM_SWAP=1``: every class of ``bitsandbytes.optim`` that hf_optim has a namesake for is replaced by
  hf_optim's (``bitsandbytes.optim.AdamW8bit`` is ``hf_optim.AdamW8bit``), the "one-line switch" claim;
  ``GlobalOptimManager`` stays bitsandbytes' own (hf_optim reads it, it is no optimizer).
- ``HF_OPTIM_EXPECT=1`` (transformers' Trainer tests): where a test checks the class the Trainer built for an
  ``optim`` name against the class it expects (``check_optim_and_kwargs``), the expected class becomes the one
  hf_optim builds for that name, for the names hf_optim takes over; every other check is the test's own.
- ``HF_OPTIM_TORCH=1`` (PyTorch's test/test_optim.py): ``optim_db`` holds one entry per hf_optim class, built by
  ``torch_standins`` from the torch.optim algorithm it stands in for; ``HF_OPTIM_TORCH=plain``: ``optim_db`` holds
  torch's own entries of those algorithms (the baseline). ``HF_OPTIM_TORCH_CLASSES``: ``representative`` (the
  default, ``torch_standins.REPRESENTATIVE``), ``all``, or class names separated by commas. The rules that leave
  inputs out, and what they left out, are printed at the end of the run.
"""

from __future__ import annotations

import os

SWAPPED: list[str] = []


def _enabled(name: str) -> bool:
    return os.environ.get(name) == "1"


def _swap_bitsandbytes() -> None:
    import bitsandbytes

    import hf_optim

    for name, theirs in list(vars(bitsandbytes.optim).items()):
        ours = getattr(hf_optim, name, None)
        if isinstance(theirs, type) and isinstance(ours, type) and name != "GlobalOptimManager":
            setattr(bitsandbytes.optim, name, ours)
            SWAPPED.append(name)


def _hf_optim_class(optim_name: object) -> type | None:
    from hf_optim.integrations.names import OPTIMIZER_NAMES
    from hf_optim.integrations.transformers import handles

    name = str(getattr(optim_name, "value", optim_name))
    return OPTIMIZER_NAMES[name].cls if handles(name) else None


def _expect_hf_optim(test_class: type) -> None:
    original = test_class.check_optim_and_kwargs

    def check_optim_and_kwargs(self, training_args, expected_cls, expected_kwargs, *args, **kwargs):
        ours = _hf_optim_class(training_args.optim)
        return original(self, training_args, ours or expected_cls, expected_kwargs, *args, **kwargs)

    test_class.check_optim_and_kwargs = check_optim_and_kwargs


TORCH_MODE = os.environ.get("HF_OPTIM_TORCH", "")
PLACEHOLDERS: list[str] = []

# test/test_optim.py imports three sibling modules of test/optim/ for their test classes, which the runner does not
# select; a lone copy of the file (no test/optim/ beside it) gets empty stand-ins for them, named in the header
TORCH_SIBLINGS = {"optim.test_lrscheduler": "TestLRScheduler", "optim.test_optim": "TestDifferentiableOptimizer",
                  "optim.test_swa_utils": "TestSWAUtils"}


def _placeholder_siblings() -> None:
    import importlib.util
    import sys
    import types

    for name, cls_name in TORCH_SIBLINGS.items():
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if found:
            continue
        package = sys.modules.setdefault("optim", types.ModuleType("optim"))
        package.__path__ = getattr(package, "__path__", [])
        module = types.ModuleType(name)
        setattr(module, cls_name, type(cls_name, (), {"__doc__": "placeholder: not part of TestOptimRenewed"}))
        sys.modules[name] = module
        setattr(package, name.split(".")[1], module)
        PLACEHOLDERS.append(name)


def _replace_optim_db() -> None:
    import torch_standins
    from torch.testing._internal import common_optimizers

    torch_db = list(common_optimizers.optim_db)
    selection = os.environ.get("HF_OPTIM_TORCH_CLASSES", "representative")
    new = (torch_standins.standin_infos(torch_db, selection) if TORCH_MODE == "1"
           else torch_standins.plain_infos(torch_db))
    common_optimizers.optim_db[:] = new  # in place: test_optim.py's ``from ... import optim_db`` gets this list


if _enabled("HF_OPTIM_FIRST") or _enabled("HF_OPTIM_SWAP") or _enabled("HF_OPTIM_EXPECT") or TORCH_MODE == "1":
    import hf_optim  # noqa: F401  (first, before the peer's modules)
if _enabled("HF_OPTIM_SWAP"):
    _swap_bitsandbytes()
if TORCH_MODE in ("1", "plain"):
    _placeholder_siblings()
    _replace_optim_db()


def pytest_collection_modifyitems(session, config, items) -> None:
    if not _enabled("HF_OPTIM_EXPECT"):
        return
    seen = set()
    for item in items:
        cls = getattr(item, "cls", None)
        if cls is not None and cls not in seen and hasattr(cls, "check_optim_and_kwargs"):
            seen.add(cls)
            _expect_hf_optim(cls)


def pytest_report_header(config) -> str | list[str]:
    if TORCH_MODE:
        from torch.testing._internal.common_optimizers import optim_db

        names = ", ".join(info.optim_cls.__name__ for info in optim_db)
        return [f"torch optim_db ({'hf_optim stand-ins' if TORCH_MODE == '1' else 'torch.optim itself'}): {names}",
                f"test/optim/ siblings replaced by empty placeholders: {', '.join(PLACEHOLDERS) or 'none'}"]
    return (
        f"hf_optim first: {_enabled('HF_OPTIM_FIRST')}; bitsandbytes classes swapped: {', '.join(SWAPPED) or 'none'};"
        f" Trainer class checks expect hf_optim's: {_enabled('HF_OPTIM_EXPECT')}"
    )


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if TORCH_MODE != "1":
        return
    import torch_standins

    terminalreporter.section("hf_optim stand-ins: the rules")
    for line in torch_standins.rules_text():
        terminalreporter.write_line(line)
    terminalreporter.section("hf_optim stand-ins: what the rules left out in this run")
    for line in torch_standins.report() or ["nothing"]:
        terminalreporter.write_line(line)
