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


if _enabled("HF_OPTIM_FIRST") or _enabled("HF_OPTIM_SWAP") or _enabled("HF_OPTIM_EXPECT"):
    import hf_optim  # noqa: F401  (first, before the peer's modules)
if _enabled("HF_OPTIM_SWAP"):
    _swap_bitsandbytes()


def pytest_collection_modifyitems(session, config, items) -> None:
    if not _enabled("HF_OPTIM_EXPECT"):
        return
    seen = set()
    for item in items:
        cls = getattr(item, "cls", None)
        if cls is not None and cls not in seen and hasattr(cls, "check_optim_and_kwargs"):
            seen.add(cls)
            _expect_hf_optim(cls)


def pytest_report_header(config) -> str:
    return (
        f"hf_optim first: {_enabled('HF_OPTIM_FIRST')}; bitsandbytes classes swapped: {', '.join(SWAPPED) or 'none'};"
        f" Trainer class checks expect hf_optim's: {_enabled('HF_OPTIM_EXPECT')}"
    )
