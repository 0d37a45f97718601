"""AdEMAMix's Triton rule: the twin of :func:`hf_optim.optim.ademamix.ademamix_rule`, the same fp32 operations in the
same order (conventions: :mod:`hf_optim.kernels.triton_path.exact_math`). Imported only when a Triton step runs.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
