"""RMSprop's Triton rule: the twin of :func:`hf_optim.optim.rmsprop.rmsprop_rule`, the same fp32 operations in the same
order (conventions: :mod:`hf_optim.kernels.triton_path.exact_math`). Imported only when a Triton step runs.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rmsprop(p, g, v, unused1, unused2, h):
    """Twin of ``rmsprop_rule``."""
    g = g + h.weight_decay * p
    v = h.alpha * v + h.one_minus_alpha * g * g
    p = p - tl.div_rn(h.lr * g, tl.sqrt_rn(v) + h.eps)
    return p, v, unused1, unused2
