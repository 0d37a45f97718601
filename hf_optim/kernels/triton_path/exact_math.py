"""How a Triton twin of an elementwise rule is written, and :func:`lerp`, the twin of
:func:`hf_optim.numerics.exact_math.lerp` that such twins use.

Each algorithm's Triton rule (``hf_optim/optim/<algorithm>/triton_rule.py``, named by its description:
``triton_rule=".triton_rule:adamw"``) is the twin of its PyTorch rule in
``hf_optim/optim/<algorithm>/__init__.py`` and performs the same fp32 operations in the same order, so both paths
round identically: one IEEE rounding per PyTorch operation (``tl.div_rn`` and ``tl.sqrt_rn`` for division and square
root; the kernels are launched with floating-point contraction off); ``lerp`` is
``hf_optim.numerics.exact_math.lerp``'s twin. Where the PyTorch rule divides a tensor by a scalar, the twin
multiplies by the scalar's fp32 reciprocal, a field of its own in the algorithm's ``hyper`` class (``inv_...``,
computed on the host by :func:`hf_optim.core.algorithm.fp32_reciprocal`): torch does exactly that on CUDA.

Signature: ``rule(p, g, s0, s1, s2, h) -> (out, s0, s1, s2)`` on fp32 tiles, where ``s0..s2`` are the state rows
(unused rows are zeros and come back unchanged), ``h`` the algorithm's ``hyper`` named tuple (read by field name;
computed on the host in double precision and passed as fp32 kernel arguments, exactly as torch converts a Python
scalar), and ``out`` the new parameter or, for LAMB, the update direction. The fused elementwise kernel
(:mod:`hf_optim.kernels.triton_path.elementwise`) calls the rule.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def lerp(start, end, weight):
    """Twin of ``hf_optim.numerics.exact_math.lerp``: torch's formula, one rounding per operation. ``weight``
    is a scalar, so which end the formula starts from is one decision for the whole tile: a uniform branch, not both
    formulas per element and a select."""
    diff = end - start
    if tl.abs(weight) < 0.5:
        result = start + weight * diff
    else:
        result = end + (weight - 1.0) * diff
    return result
