"""The fixed-precision and paged twins of each algorithm (``AdamW8bit``, ``PagedAdamW32bit``, ...).

bitsandbytes ships each algorithm as a family of classes that differ only in ``optim_bits`` and ``is_paged``.
Here each twin is derived from its algorithm class, so the math lives in one place; the twin's signature and
docstring are the algorithm's minus the arguments it fixes, which gives bitsandbytes' signature of the namesake
(tests/integrations/test_bitsandbytes_signatures.py compares them).
"""

from __future__ import annotations

import difflib
import inspect

from hf_optim.formats import StateFormat, format_named
from hf_optim.formats.base import BITSANDBYTES_FORMATS

BNB_COMPAT_BITS = 32
"""The ``optim_bits`` default bitsandbytes' AdamW twins take (and ignore): accepted by every twin that keeps it."""


def precision_variant(base: type, name: str, *, state_format: StateFormat | None = None,
                      is_paged: bool = False) -> type:
    """Subclass of ``base`` with ``state_format`` (if given) fixed, and paged state if ``is_paged``.

    The twin's signature is bitsandbytes' for its namesake: the base's arguments minus the fixed ones (the format
    fixes ``state_format`` and its ``optim_bits`` alias), in the same order, and positional arguments bind to it
    (``LAMB8bit(params, lr, ..., adam_w_mode, args)`` as in bitsandbytes). An unpaged twin keeps ``is_paged``
    (default False: ``AdamW8bit(..., is_paged=True)`` is paged, as in bitsandbytes). When
    ``base.twins_keep_optim_bits`` (AdamW), the twins of bitsandbytes' formats also keep ``optim_bits`` with
    bitsandbytes' default 32: they accept 32 (ignored, as bitsandbytes ignores it) or their own alias, and refuse
    anything else. A fixed argument passed by keyword is accepted when it equals the fixed value.
    """
    signature = inspect.signature(base.__init__)
    fixed = {}
    if is_paged:
        fixed["is_paged"] = True
    if state_format is not None:
        fixed["state_format"] = state_format.name
        if state_format.optim_bits is not None:
            fixed["optim_bits"] = state_format.optim_bits
    keeps_bits = (state_format is not None and state_format.name in BITSANDBYTES_FORMATS
                  and getattr(base, "twins_keep_optim_bits", False) and "optim_bits" in signature.parameters)
    shown = [
        p.replace(default=BNB_COMPAT_BITS) if keeps_bits and p.name == "optim_bits" else p
        for p in signature.parameters.values()
        if p.name not in fixed and not (state_format is not None and p.name in ("optim_bits", "state_format"))
        or (p.name == "optim_bits" and keeps_bits)
    ]
    own = signature.replace(parameters=shown)
    names = [p.name for p in shown][2:]  # after self and params

    def __init__(self, params, *args, **kwargs):
        given = {key: kwargs.pop(key) for key in list(kwargs) if key in fixed and key not in own.parameters}
        for key, value in given.items():
            # bitsandbytes' twins take no such argument; an equal value is harmless, another one an error
            if value != fixed[key]:
                raise ValueError(f"{name} fixes {key}={fixed[key]!r}; got {key}={value!r}")
        try:
            arguments = own.bind(self, params, *args, **kwargs).arguments
        except TypeError as error:  # Python would name the base class (AdamW), not the class the user called
            unknown = [key for key in kwargs if key not in own.parameters]
            close = difflib.get_close_matches(unknown[0], names, n=1) if unknown else []
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"{name}.__init__() {error}{hint}") from None
        bits = arguments.pop("optim_bits", BNB_COMPAT_BITS) if keeps_bits else BNB_COMPAT_BITS
        if bits not in (fixed.get("optim_bits"), BNB_COMPAT_BITS):
            raise ValueError(
                f"Invalid optim_bits: {bits!r}; {name} keeps {fixed['optim_bits']}-bit state and takes "
                f"optim_bits={fixed['optim_bits']} or {BNB_COMPAT_BITS} (bitsandbytes' default for this argument, "
                "ignored as bitsandbytes ignores it)"
            )
        arguments.update({key: value for key, value in fixed.items() if key != "optim_bits"})
        base.__init__(**arguments)

    __init__.__signature__ = own
    settings = []
    if state_format is not None:
        settings.append(f"{state_format.label} state")
    if is_paged:
        settings.append("paged state")
    shown_fixed = {key: value for key, value in fixed.items() if key != "optim_bits"}
    doc = (
        f"{base.__name__} with {' and '.join(settings)}: ``{base.__name__}(..., "
        + ", ".join(f"{k}={v!r}" for k, v in shown_fixed.items())
        + ")``."
        + (f" ``optim_bits`` is kept for bitsandbytes' signature (default {BNB_COMPAT_BITS}, ignored as there): "
           f"{fixed['optim_bits']} or {BNB_COMPAT_BITS}." if keeps_bits else "")
        + "\n\n"
        + (base.__doc__ or "")
    )
    return type(name, (base,), {"__init__": __init__, "__doc__": doc, "__module__": base.__module__})


def family(base: type, prefix: str, formats) -> dict[str, type]:
    """The family of ``base``: ``{prefix}{suffix}`` for every format (a name or :class:`StateFormat`) in ``formats``,
    its :attr:`~StateFormat.class_suffix` (``AdamW8bit``), and, when ``base`` pages, ``Paged{prefix}`` and
    ``Paged{prefix}{suffix}``."""
    pages = getattr(base, "pages", True) and "is_paged" in inspect.signature(base.__init__).parameters
    classes = {f"Paged{prefix}": precision_variant(base, f"Paged{prefix}", is_paged=True)} if pages else {}
    for fmt in sorted((format_named(f) if isinstance(f, str) else f for f in formats), key=lambda f: -f.rank):
        name = f"{prefix}{fmt.class_suffix}"
        classes[name] = precision_variant(base, name, state_format=fmt)
        if pages:
            classes[f"Paged{name}"] = precision_variant(base, f"Paged{name}", state_format=fmt, is_paged=True)
    return classes
