"""The fixed-precision and paged twins of each algorithm (``AdamW8bit``, ``PagedAdamW32bit``, ...).

bitsandbytes ships each algorithm as a family of classes that differ only in ``optim_bits`` and ``is_paged``.
Here each twin is derived from its algorithm class, so the math lives in one place; the twin's signature and
docstring are the algorithm's minus the arguments it fixes.
"""

from __future__ import annotations

import difflib
import inspect


def precision_variant(base: type, name: str, *, optim_bits: int | None = None, is_paged: bool = False) -> type:
    """Subclass of ``base`` with ``optim_bits`` (if given) and ``is_paged`` fixed."""
    fixed = {}
    if is_paged or "is_paged" in inspect.signature(base.__init__).parameters:
        fixed["is_paged"] = is_paged
    if optim_bits is not None:
        fixed["optim_bits"] = optim_bits

    signature = inspect.signature(base.__init__)
    names = list(signature.parameters)[2:]  # after self and params

    def __init__(self, params, *args, **kwargs):
        try:
            arguments = signature.bind(self, params, *args, **kwargs).arguments
        except TypeError as error:  # Python would name the base class (AdamW), not the class the user called
            unknown = [key for key in kwargs if key not in signature.parameters]
            close = difflib.get_close_matches(unknown[0], names, n=1) if unknown else []
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"{name}.__init__() {error}{hint}") from None
        for key, value in fixed.items():
            # bitsandbytes' twins silently ignore a conflicting value; here it is an error.
            if key in arguments and arguments[key] != value:
                raise ValueError(f"{name} fixes {key}={value!r}; got {key}={arguments[key]!r}")
            arguments[key] = value
        base.__init__(**arguments)

    __init__.__signature__ = signature.replace(
        parameters=[p for p in signature.parameters.values() if p.name not in fixed]
    )
    settings = []
    if optim_bits is not None:
        settings.append(f"{optim_bits}-bit state")
    if is_paged:
        settings.append("paged state")
    doc = (
        f"{base.__name__} with {' and '.join(settings)}: ``{base.__name__}(..., "
        + ", ".join(f"{k}={v!r}" for k, v in fixed.items())
        + ")``.\n\n"
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
