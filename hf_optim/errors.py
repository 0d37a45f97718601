"""The error types for problems in what a user gave hf_optim, as opposed to bugs.

A :class:`UserError` is raised for a bad recipe, value, path or environment variable. The ``hf-optim`` command
prints its message (one line per problem) without a traceback and exits with status 2; any other exception is a
bug and keeps its traceback. The subclasses keep the built-in type code already catches (``ValueError``,
``FileNotFoundError``), so raising one changes nothing for Python callers.

Standard library only: every layer of the package may import it.
"""

from __future__ import annotations


def suggest(name: str, candidates: list[str], count: int = 3) -> list[str]:
    """The closest valid names to a misspelled one, best first (the did-you-mean of every user error)."""
    import difflib

    return difflib.get_close_matches(str(name), candidates, n=count, cutoff=0.6)



def did_you_mean(key: str, candidates: list[str]) -> str:
    """``; did you mean 'r'?``: the candidate closest to the key or to the key without its leading words
    (``lora_rr`` -> ``rr`` -> ``r``), else one the key contains or is contained in; empty if none."""
    import difflib

    parts = key.split("_")
    scored = []
    for variant in ["_".join(parts[i:]) for i in range(len(parts))]:
        for close in suggest(variant, candidates, count=1):
            scored.append((difflib.SequenceMatcher(None, variant, close).ratio(), close))
    if scored:
        return f"; did you mean {max(scored)[1]!r}?"
    lowered = [c for c in candidates if key.lower() in c.lower() or c.lower() in key.lower()]
    return f"; did you mean {lowered[0]!r}?" if lowered else ""

class UserError(Exception):
    """A problem with what the user gave (a file, a value, a command line, the environment), not a bug."""


class UserValueError(UserError, ValueError):
    """A bad value given by the user."""


class UserFileNotFoundError(UserError, FileNotFoundError):
    """A file or directory the user named does not exist (or is not what the command needs)."""


OFFLINE_HINT = ("without network: `--smoke` runs any recipe on the builtin tiny model; a model downloaded once (`hf "
                "download MODEL_ID`) runs offline with HF_HUB_OFFLINE=1; or set model.id to a local directory")
"""What to do when the Hugging Face Hub cannot be reached, as the ``hf-optim`` command says it."""


def hub_unreachable(exc: BaseException) -> BaseException | None:
    """The Hub error behind ``exc`` when it failed because the Hugging Face Hub could not be reached (offline mode,
    no network) and the files were not cached; None for anything else. Walks the exception's causes:
    transformers and datasets wrap huggingface_hub's error in their own."""
    import sys

    errors = sys.modules.get("huggingface_hub.errors")  # never imported here: only a hub call can have failed so
    if errors is None:
        return None
    kinds = tuple(getattr(errors, name) for name in ("OfflineModeIsEnabled", "LocalEntryNotFoundError")
                  if hasattr(errors, name))
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, kinds):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None
