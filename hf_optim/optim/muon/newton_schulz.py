"""Muon's orthogonalization and learning-rate adjustment, as ``torch.optim.Muon`` defines them: bf16 Newton-Schulz,
batched over same-shaped matrices (one ``baddbmm`` per iteration; on CPU the same bits as torch's per-matrix
``addmm``), and ``adjust_lr_fn``."""

from __future__ import annotations

import math

import torch

NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)
"""Keller Jordan's quintic Newton-Schulz coefficients (torch.optim.Muon's defaults)."""
NS_EPS = 1e-7
NS_STEPS = 5
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")

def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: tuple[int, ...]) -> float:
    """torch.optim.Muon's learning-rate adjustment for a matrix of ``shape`` (A, B): ``sqrt(max(1, A/B))`` for
    None / ``"original"`` (Keller Jordan's), ``0.2 * sqrt(max(A, B))`` for ``"match_rms_adamw"`` (Moonshot's: the
    update's RMS matches AdamW's, so AdamW's lr and weight decay carry over)."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    return lr * (0.2 * math.sqrt(max(rows, cols)))  # torch's order of multiplication


def newton_schulz(updates: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                  eps: float) -> torch.Tensor:
    """Orthogonalize a batch of matrices ``(batch, A, B)`` as torch.optim.Muon's ``_zeropower_via_newtonschulz``
    does each one: in bf16, transposed when ``A > B``, divided by its Frobenius norm (clamped at ``eps``), then
    ``steps`` quintic iterations. Returns bf16 ``(batch, A, B)``."""
    a, b, c = coefficients
    x = updates.bfloat16()
    tall = updates.size(-2) > updates.size(-1)
    if tall:
        x = x.mT
    x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        gram_update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, gram_update, x, beta=a)
    return x.mT if tall else x
