"""LAMB's Triton rule (the direction; the trust-ratio passes are
:mod:`hf_optim.optim.lamb.triton_passes`): the twin of :func:`hf_optim.optim.lamb.lamb_rule`, the same fp32
operations in the same order (conventions: :mod:`hf_optim.kernels.triton_path.exact_math`). Imported only when a Triton
step runs.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def lamb(p, g, m, v, unused, h):
    """Twin of ``lamb_rule``: returns the direction ``u`` (the parameter is updated by the trust-ratio pass)."""
    g = g + h.l2 * p
    m = h.beta1 * m + h.one_minus_beta1 * g
    v = h.beta2 * v + h.one_minus_beta2 * g * g
    direction = tl.div_rn(m * h.inv_bias_correction1, tl.sqrt_rn(v * h.inv_bias_correction2) + h.eps)
    direction = direction + h.decoupled * p
    return direction, m, v, unused
