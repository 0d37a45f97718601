"""Lion's Triton rule: the twin of :func:`hf_optim.optim.lion.lion_rule`, the same fp32 operations in the same order
(conventions: :mod:`hf_optim.kernels.triton_path.exact_math`). Imported only when a Triton step runs.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def lion(p, g, m, unused1, unused2, h):
    """Twin of ``lion_rule``."""
    p = p * h.decay
    mixed = h.beta1 * m + h.one_minus_beta1 * g
    direction = tl.where(mixed > 0, 1.0, tl.where(mixed < 0, -1.0, 0.0))
    p = p - h.lr * direction
    m = h.beta2 * m + h.one_minus_beta2 * g
    return p, m, unused1, unused2
