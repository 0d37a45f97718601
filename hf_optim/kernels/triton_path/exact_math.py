"""The Triton twins of hf_optim's elementwise rules, as ``@triton.jit`` functions.

Each rule is the twin of a PyTorch rule in ``hf_optim/optim/<algorithm>.py`` and performs the same fp32 operations
in the same order, so both paths round identically: one IEEE rounding per PyTorch operation (``tl.div_rn`` and
``tl.sqrt_rn`` for division and square root; the kernels are launched with floating-point contraction off);
``lerp`` is ``hf_optim.kernels.exact_math.lerp``'s twin. Where the PyTorch rule divides a tensor by a scalar, the
twin multiplies by the scalar's fp32 reciprocal, a field of its own in the algorithm's ``hyper`` class
(``inv_...``, computed on the host by :func:`hf_optim.kernels.algorithm.fp32_reciprocal`): torch does exactly that
on CUDA.

Signature: ``rule(p, g, s0, s1, s2, h) -> (out, s0, s1, s2)`` on fp32 tiles, where ``s0..s2`` are the state rows
(unused rows are zeros and come back unchanged), ``h`` the algorithm's ``hyper`` named tuple (read by field name;
computed on the host in double precision and passed as fp32 kernel arguments, exactly as torch converts a Python
scalar), and ``out`` the new parameter or, for LAMB, the update direction. Each algorithm's description names its
twin (``triton_rule="hf_optim.kernels.triton_rules:adamw"``).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def lerp(start, end, weight):
    """Twin of ``hf_optim.kernels.exact_math.lerp``: torch's formula, one rounding per operation. ``weight`` is a
    scalar, so which end the formula starts from is one decision for the whole tile: a uniform branch, not both
    formulas per element and a select."""
    diff = end - start
    if tl.abs(weight) < 0.5:
        result = start + weight * diff
    else:
        result = end + (weight - 1.0) * diff
    return result


@triton.jit
def adamw(p, g, m, v, unused, h):
    """Twin of ``adamw_rule``."""
    p = p * h.decay
    m = lerp(m, g, h.one_minus_beta1)
    v = v * h.beta2 + h.one_minus_beta2 * g * g
    denom = tl.sqrt_rn(v) * h.inv_bias_correction2_sqrt + h.eps
    p = p - h.step_size * tl.div_rn(m, denom)
    return p, m, v, unused


@triton.jit
def ademamix(p, g, m1, m2, nu, h):
    """Twin of ``ademamix_rule`` (rows: fast EMA, slow EMA, second moment)."""
    p = p * h.decay
    m1 = h.beta1 * m1 + h.one_minus_beta1 * g
    m2 = h.beta3 * m2 + h.one_minus_beta3 * g
    nu = h.beta2 * nu + h.one_minus_beta2 * g * g
    denom = tl.sqrt_rn(nu) * h.inv_bias_correction2_sqrt + h.eps
    p = p - tl.div_rn(h.lr * (m1 * h.inv_bias_correction1 + h.alpha * m2), denom)
    return p, m1, m2, nu


@triton.jit
def lion(p, g, m, unused1, unused2, h):
    """Twin of ``lion_rule``."""
    p = p * h.decay
    mixed = h.beta1 * m + h.one_minus_beta1 * g
    direction = tl.where(mixed > 0, 1.0, tl.where(mixed < 0, -1.0, 0.0))
    p = p - h.lr * direction
    m = h.beta2 * m + h.one_minus_beta2 * g
    return p, m, unused1, unused2


@triton.jit
def rmsprop(p, g, v, unused1, unused2, h):
    """Twin of ``rmsprop_rule``."""
    g = g + h.weight_decay * p
    v = h.alpha * v + h.one_minus_alpha * g * g
    p = p - tl.div_rn(h.lr * g, tl.sqrt_rn(v) + h.eps)
    return p, v, unused1, unused2


@triton.jit
def lamb(p, g, m, v, unused, h):
    """Twin of ``lamb_rule``: returns the direction ``u`` (the parameter is updated by the trust-ratio pass)."""
    g = g + h.l2 * p
    m = h.beta1 * m + h.one_minus_beta1 * g
    v = h.beta2 * v + h.one_minus_beta2 * g * g
    direction = tl.div_rn(m * h.inv_bias_correction1, tl.sqrt_rn(v * h.inv_bias_correction2) + h.eps)
    direction = direction + h.decoupled * p
    return direction, m, v, unused
