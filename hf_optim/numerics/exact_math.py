"""Elementwise operations that every backend rounds the same way, for the update rules.

The rules in ``hf_optim/optim/`` run eagerly (the reference), compiled by inductor (CPU) and as Triton twins. Plain
``+ - * /`` are single IEEE roundings everywhere (inductor compiles with floating-point contraction off, the Triton
kernels too). Two torch operations are not:

- ``torch.sqrt`` on CPU tensors calls a vectorized library routine that is not correctly rounded (on an AVX-512
  host about 0.5% of float32 inputs come out one ulp off), while inductor's code and Triton's ``sqrt_rn`` are.
- ``torch.lerp`` rounds once through a fused multiply-add in its CPU and CUDA kernels; inductor's C++ backend
  computes the same formula with two roundings.
- A division with a Python number on one side is not one division: ``number / tensor`` is
  ``tensor.reciprocal() * number`` (``Tensor.__rtruediv__``, two roundings: ``448.0 / t`` is an ulp off the
  quotient for about a quarter of fp32 ``t``), and on CUDA ``tensor / number`` multiplies by the number's fp32
  reciprocal.

:func:`sqrt` is correctly rounded on every path (eagerly on CPU it goes through float64, whose result rounds to
the correctly rounded float32 square root; ``tests/kernels/test_exact_math.py`` checks every float32 mantissa of both
exponent parities), :func:`lerp` spells torch's formula out with one rounding per operation, and :func:`div`
divides tensor by tensor (Triton's ``div_rn``). With these, an algorithm's eager, compiled and Triton paths agree
bit for bit.
"""

from __future__ import annotations

import torch


def sqrt(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded square root of an fp32 tensor, eager or compiled."""
    if torch.compiler.is_compiling() or x.device.type != "cpu":
        return x.sqrt()  # inductor's and CUDA's square roots are IEEE-exact
    return x.double().sqrt().to(x.dtype)


def lerp(start: torch.Tensor, end: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``torch.lerp(start, end, weight)`` for a 0-d fp32 ``weight``, one rounding per operation: from the nearer
    end, so ``weight == 1`` gives ``end`` exactly."""
    diff = end - start
    return torch.where(weight.abs() < 0.5, start + weight * diff, end + (weight - 1.0) * diff)


def div(numerator: torch.Tensor | float, denominator: torch.Tensor | float) -> torch.Tensor:
    """The correctly rounded quotient, elementwise, where either side may be a Python number (made a tensor like the
    other side first, so torch divides rather than multiplying by a reciprocal), eager or compiled."""
    if not isinstance(numerator, torch.Tensor):
        numerator = torch.full_like(denominator, numerator)
    elif not isinstance(denominator, torch.Tensor):
        denominator = torch.full_like(numerator, denominator)
    return torch.div(numerator, denominator)
