"""The elementwise update rules of the algorithms as ``@triton.jit`` functions, keyed by algorithm.

Each rule is the Triton twin of the PyTorch rule in ``hf_optim/optim/<algorithm>.py`` and performs the same
fp32 operations in the same order, so both paths round identically: one IEEE rounding per PyTorch operation
(``tl.div_rn`` and ``tl.sqrt_rn`` for division and square root; the kernels are launched with floating-point
contraction off); ``lerp`` is ``hf_optim.kernels.exact_math.lerp``'s twin.

Signature: ``rule(p, g, s0, s1, s2, h) -> (out, s0, s1, s2)`` on fp32 tiles, where ``s0..s2`` are the state
rows (unused rows are zeros and come back unchanged), ``h`` the tuple of scalars named by
:data:`HYPER_KEYS` (the PyTorch path's ``_hyper`` values, computed on the host in double precision and passed
as fp32 kernel arguments, exactly as torch converts a Python scalar), and ``out`` the new parameter or, for
LAMB, the update direction.
"""

from __future__ import annotations

import struct

import triton
import triton.language as tl


@triton.jit
def lerp(start, end, weight):
    """Twin of ``hf_optim.kernels.exact_math.lerp``: torch's formula, one rounding per operation."""
    diff = end - start
    small = tl.abs(weight) < 0.5
    return tl.where(small, start + weight * diff, end + (weight - 1.0) * diff)


@triton.jit
def adamw(p, g, m, v, unused, h):
    """Twin of ``adamw_rule``."""
    p = p * h[0]
    m = lerp(m, g, h[1])
    v = v * h[2] + h[3] * g * g
    denom = tl.sqrt_rn(v) * h[4] + h[5]
    p = p - h[6] * tl.div_rn(m, denom)
    return p, m, v, unused


@triton.jit
def ademamix(p, g, m1, m2, nu, h):
    """Twin of ``ademamix_rule`` (rows: fast EMA, slow EMA, second moment)."""
    p = p * h[0]
    m1 = h[1] * m1 + h[4] * g
    m2 = h[3] * m2 + h[6] * g
    nu = h[2] * nu + h[5] * g * g
    denom = tl.sqrt_rn(nu) * h[9] + h[10]
    p = p - tl.div_rn(h[11] * (m1 * h[8] + h[7] * m2), denom)
    return p, m1, m2, nu


@triton.jit
def lion(p, g, m, unused1, unused2, h):
    """Twin of ``lion_rule``."""
    p = p * h[0]
    mixed = h[2] * m + h[4] * g
    direction = tl.where(mixed > 0, 1.0, tl.where(mixed < 0, -1.0, 0.0))
    p = p - h[1] * direction
    m = h[3] * m + h[5] * g
    return p, m, unused1, unused2


@triton.jit
def rmsprop(p, g, v, unused1, unused2, h):
    """Twin of ``rmsprop_rule``."""
    g = g + h[0] * p
    v = h[1] * v + h[2] * g * g
    p = p - tl.div_rn(h[4] * g, tl.sqrt_rn(v) + h[3])
    return p, v, unused1, unused2


@triton.jit
def lamb(p, g, m, v, unused, h):
    """Twin of ``lamb_rule``: returns the direction ``u`` (the parameter is updated by the trust-ratio pass)."""
    g = g + h[0] * p
    m = h[2] * m + h[4] * g
    v = h[3] * v + h[5] * g * g
    direction = tl.div_rn(m * h[6], tl.sqrt_rn(v * h[7]) + h[8])
    direction = direction + h[1] * p
    return direction, m, v, unused


RULES = {"adamw": adamw, "ademamix": ademamix, "lion": lion, "rmsprop": rmsprop, "lamb": lamb}

HYPER_KEYS = {
    "adamw": ("decay", "one_minus_beta1", "beta2", "one_minus_beta2", "1/bias_correction2_sqrt", "eps", "step_size"),
    "ademamix": (
        "decay", "beta1", "beta2", "beta3", "one_minus_beta1", "one_minus_beta2", "one_minus_beta3", "alpha",
        "1/bias_correction1", "1/bias_correction2_sqrt", "eps", "lr",
    ),
    "lion": ("decay", "lr", "beta1", "beta2", "one_minus_beta1", "one_minus_beta2"),
    "rmsprop": ("weight_decay", "alpha", "one_minus_alpha", "eps", "lr"),
    "lamb": (
        "l2", "decoupled", "beta1", "beta2", "one_minus_beta1", "one_minus_beta2", "1/bias_correction1",
        "1/bias_correction2", "eps",
    ),
}
"""The order in which each rule reads its scalars from ``h`` (the keys of the algorithm's ``_hyper`` dict)."""


def fp32(value: float) -> float:
    """``value`` rounded to fp32 (as a Python float, exactly representable in fp32)."""
    return struct.unpack("f", struct.pack("f", value))[0]


def hyper_tuple(algorithm: str, hyper: dict) -> tuple[float, ...]:
    """The rule's scalars, as Python floats (ints would make Triton specialize and recompile on their value).

    A key ``"1/name"`` is the fp32 reciprocal of ``hyper["name"]``: torch divides a tensor by a Python scalar
    as ``a * (1.0f / float(b))`` on CUDA and XPU (the devices Triton runs on), so the rule multiplies too. The
    division is done in double and rounded once to fp32, which equals the fp32 IEEE division. (torch's CPU
    kernels divide instead; the two differ by at most an ulp in that intermediate.)
    """
    values = []
    for key in HYPER_KEYS[algorithm]:
        if key.startswith("1/"):
            values.append(fp32(1.0 / fp32(float(hyper[key[2:]]))))
        else:
            values.append(float(hyper[key]))
    return tuple(values)
