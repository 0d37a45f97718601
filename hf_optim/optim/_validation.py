"""Hyperparameter checks shared by every optimizer; each error names the bad value and what is valid.

Where torch.optim has a message for the same mistake, the error starts with torch's words (``Invalid learning rate:
-1``, ``Invalid beta parameter at index 0: 1.0``, ``Tensor lr must be 1-element``), so code and searches written
against torch's optimizers recognise it; the valid range follows.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_real(name: str, value, *, low: float = -math.inf, low_open: bool = False, high: float = math.inf,
               high_open: bool = False, label: str | None = None) -> float:
    """Return ``float(value)`` if it is a finite real number in the interval, else raise a clear error.

    ``label``: how the ValueError names the value where torch.optim's own message has a wording users and code
    search for (``Invalid learning rate: -1 (lr); ...``: torch's words, then the argument's name).
    """
    if not _is_real(value):
        raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    number = float(value)
    below = number <= low if low_open else number < low
    above = number >= high if high_open else number > high
    if math.isnan(number) or below or above:
        left = "(" if low_open else "["
        right = ")" if high_open else "]"
        named = f"Invalid {label or name}: {value}"
        if label and name not in label.split():
            named += f" ({name})"
        raise ValueError(f"{named}; expected a value in {left}{low}, {high}{right}")
    return number


def check_lr(lr):
    """A finite ``lr >= 0``: a real number, or a 1-element floating-point tensor (torch's optimizers accept one;
    under ``torch.compile`` a tensor lr that a scheduler changes is a graph input, not a constant to recompile on).
    """
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError(f"Tensor lr must be 1-element, got shape {tuple(lr.shape)}; pass a float or e.g. "
                             "torch.tensor(1e-3)")
        if not lr.is_floating_point() or lr.is_complex():
            raise ValueError(f"Tensor lr must be a real floating-point tensor, got dtype {lr.dtype}; pass a float or "
                             "e.g. torch.tensor(1e-3)")
        check_real("lr", lr.item(), low=0.0, high=math.inf, high_open=True, label="learning rate")
        return lr
    return check_real("lr", lr, low=0.0, high=math.inf, high_open=True, label="learning rate")


def check_eps(eps, name: str = "eps", label: str = "epsilon value") -> float:
    return check_real(name, eps, low=0.0, low_open=True, high=math.inf, high_open=True, label=label)


def check_weight_decay(weight_decay) -> float:
    return check_real("weight_decay", weight_decay, low=0.0, high=math.inf, high_open=True,
                      label="weight_decay value")


def check_beta(name: str, beta, label: str | None = None) -> float:
    return check_real(name, beta, low=0.0, high=1.0, high_open=True, label=label)


def as_tuple(value):
    """``tuple(value)`` for an iterable (not a string); anything else unchanged, for its check to name it."""
    return tuple(value) if isinstance(value, Iterable) and not isinstance(value, str) else value


def check_betas(betas, count: int) -> tuple[float, ...]:
    if not isinstance(betas, Sequence) or isinstance(betas, str) or len(betas) != count:
        raise ValueError(f"betas must be a tuple of {count} floats, got {betas!r}")
    return tuple(check_beta(f"beta{i + 1}", b, f"beta parameter at index {i}") for i, b in enumerate(betas))


def check_optional_steps(name: str, value) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"Invalid {name}: {value!r}; expected None or a positive integer number of steps")
    return value


def check_optim_bits(optim_bits, supported: tuple[int, ...] = (8, 32), who: str = "") -> int:
    """``optim_bits`` if the algorithm supports it (``supported``), else a ValueError naming the valid values."""
    if optim_bits not in supported or isinstance(optim_bits, bool):
        widths = [str(bits) for bits in sorted(supported)]
        valid = widths[0] if len(widths) == 1 else ", ".join(widths[:-1]) + " or " + widths[-1]
        owner = f" (the state widths {who} runs with)" if who else ""
        raise ValueError(f"Invalid optim_bits: {optim_bits!r}; expected {valid}{owner}")
    return int(optim_bits)


def check_min_8bit_size(value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"Invalid min_8bit_size: {value!r}; expected a non-negative integer")
    return value


def check_unsupported(name: str, value, supported, why: str) -> None:
    """Reject bitsandbytes arguments hf_optim accepts for compatibility but does not implement."""
    if value != supported:
        raise ValueError(f"{name}={value!r} is not supported by hf_optim (only {supported!r}): {why}")


def check_stochastic_round(enabled, seed) -> None:
    """``bf16_stochastic_round`` is a bool and its seed (param-group key ``bf16_stochastic_round_seed``) an int
    in [0, 2**32)."""
    if not isinstance(enabled, bool):
        raise TypeError(f"bf16_stochastic_round must be True or False, got {enabled!r} ({type(enabled).__name__})")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ValueError(f"bf16_stochastic_round_seed must be an int in [0, 2**32), got {seed!r}")
