"""AdamW's Triton rule: the twin of :func:`hf_optim.optim.adamw.adamw_rule`, the same fp32 operations in the same order
(conventions: :mod:`hf_optim.kernels.triton_path.exact_math`). Imported only when a Triton step runs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hf_optim.kernels.triton_path.exact_math import lerp


@triton.jit
def adamw(p, g, m, v, unused, h):
    """Twin of ``adamw_rule``."""
    p = p * h.decay
    m = lerp(m, g, h.one_minus_beta1)
    v = v * h.beta2 + h.one_minus_beta2 * g * g
    denom = tl.sqrt_rn(v) * h.inv_bias_correction2_sqrt + h.eps
    p = p - h.step_size * tl.div_rn(m, denom)
    return p, m, v, unused
