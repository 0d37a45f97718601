"""Small numeric helpers shared by the callback, the plots and compare: EMA smoothing and byte units."""

from __future__ import annotations

from collections.abc import Iterable

GIB = 2**30
_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))


def ema(values: Iterable[float], beta: float = 0.9) -> list[float]:
    """Bias-corrected exponential moving average: ``s_t = beta*s_(t-1) + (1-beta)*x_t``, divided by ``1-beta^t``.

    The bias correction keeps the first points on the scale of the data instead of pulling them toward zero, so a
    short run's smoothed curve starts where the raw curve starts.

    Args:
        values: the series, in order.
        beta: weight of the past, in [0, 1); 0 returns the series unchanged. Default 0.9.
    """
    if not 0.0 <= beta < 1.0:
        raise ValueError(f"ema beta={beta!r} is not valid: use a number in [0, 1)")
    smoothed, running = [], 0.0
    for t, value in enumerate(values, start=1):
        running = beta * running + (1.0 - beta) * float(value)
        smoothed.append(running / (1.0 - beta**t))
    return smoothed


def auto_ema_beta(count: int) -> float:
    """The EMA beta used when none is given: ``1 - 10/count`` within [0, 0.9], so the smoothing spans about a tenth
    of the run (a 20-point run is not dragged behind by a long memory; long runs get 0.9)."""
    return 0.0 if count <= 0 else round(min(0.9, max(0.0, 1.0 - 10.0 / count)), 4)


def byte_unit(largest: float) -> tuple[str, int]:
    """The unit (name, bytes) that shows ``largest`` bytes as a number >= 1 (GiB at most)."""
    for name, size in _UNITS:
        if largest >= size:
            return name, size
    return "B", 1


def format_bytes(value: float | None) -> str:
    """``1.50 GiB``, ``12.0 MiB``; ``-`` for a missing value."""
    if value is None:
        return "-"
    name, size = byte_unit(abs(value))
    return f"{value / size:.3g} {name}" if size > 1 else f"{int(value)} B"
