"""The fixed-precision and paged twins of each algorithm (``AdamW8bit``, ``PagedAdamW32bit``, ...).

bitsandbytes ships each algorithm as a family of classes that differ only in ``optim_bits`` and ``is_paged``.
Here each twin is derived from its algorithm class, so the math lives in one place; the twin's signature and
docstring are the algorithm's minus the arguments it fixes, which gives bitsandbytes' signature of the namesake
(tests/test_bitsandbytes_signatures.py compares them).
"""

from __future__ import annotations

import difflib
import inspect

BNB_COMPAT_BITS = 32
"""The ``optim_bits`` default bitsandbytes' AdamW twins take (and ignore): accepted by every twin that keeps it."""


def precision_variant(base: type, name: str, *, optim_bits: int | None = None, is_paged: bool = False) -> type:
    """Subclass of ``base`` with ``optim_bits`` (if given) fixed, and paged state if ``is_paged``.

    The twin's signature is bitsandbytes' for its namesake: the base's arguments minus the fixed ones, in the same
    order, and positional arguments bind to it (``LAMB8bit(params, lr, ..., adam_w_mode, args)`` as in
    bitsandbytes). An unpaged twin keeps ``is_paged`` (default False: ``AdamW8bit(..., is_paged=True)`` is paged, as
    in bitsandbytes). When ``base.twins_keep_optim_bits`` (AdamW), the 8-bit and 32-bit twins also keep
    ``optim_bits`` with bitsandbytes' default 32: they accept 32 (ignored, as bitsandbytes ignores it) or their own
    width, and refuse anything else. A fixed argument passed by keyword is accepted when it equals the fixed value.
    """
    signature = inspect.signature(base.__init__)
    fixed = {}
    if is_paged:
        fixed["is_paged"] = True
    if optim_bits is not None:
        fixed["optim_bits"] = optim_bits
    keeps_bits = (optim_bits in (8, BNB_COMPAT_BITS) and getattr(base, "twins_keep_optim_bits", False)
                  and "optim_bits" in signature.parameters)
    shown = [
        p.replace(default=BNB_COMPAT_BITS) if keeps_bits and p.name == "optim_bits" else p
        for p in signature.parameters.values()
        if p.name not in fixed or (p.name == "optim_bits" and keeps_bits)
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
        if keeps_bits and arguments.get("optim_bits", BNB_COMPAT_BITS) not in (optim_bits, BNB_COMPAT_BITS):
            raise ValueError(
                f"Invalid optim_bits: {arguments['optim_bits']!r}; {name} keeps {optim_bits}-bit state and takes "
                f"optim_bits={optim_bits} or {BNB_COMPAT_BITS} (bitsandbytes' default for this argument, ignored as "
                "bitsandbytes ignores it)"
            )
        arguments.update(fixed)
        base.__init__(**arguments)

    __init__.__signature__ = own
    settings = []
    if optim_bits is not None:
        settings.append(f"{optim_bits}-bit state")
    if is_paged:
        settings.append("paged state")
    doc = (
        f"{base.__name__} with {' and '.join(settings)}: ``{base.__name__}(..., "
        + ", ".join(f"{k}={v!r}" for k, v in fixed.items())
        + ")``."
        + (f" ``optim_bits`` is kept for bitsandbytes' signature (default {BNB_COMPAT_BITS}, ignored as there): "
           f"{optim_bits} or {BNB_COMPAT_BITS}." if keeps_bits else "")
        + "\n\n"
        + (base.__doc__ or "")
    )
    return type(name, (base,), {"__init__": __init__, "__doc__": doc, "__module__": base.__module__})


def family(base: type, prefix: str, bits: tuple[int, ...] = (8, 32)) -> dict[str, type]:
    """The bitsandbytes family of ``base``: {prefix}{b}bit for every width in ``bits`` (8 and 32 by default; 4 too
    for AdamW, AdEMAMix, Lion) and, when ``base`` takes ``is_paged``, Paged{prefix} and Paged{prefix}{b}bit."""
    pages = "is_paged" in inspect.signature(base.__init__).parameters
    classes = {f"Paged{prefix}": precision_variant(base, f"Paged{prefix}", is_paged=True)} if pages else {}
    for width in sorted(bits):
        classes[f"{prefix}{width}bit"] = precision_variant(base, f"{prefix}{width}bit", optim_bits=width)
        if pages:
            classes[f"Paged{prefix}{width}bit"] = precision_variant(base, f"Paged{prefix}{width}bit",
                                                                    optim_bits=width, is_paged=True)
    return classes
