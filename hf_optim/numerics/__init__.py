"""Exact math shared by both compute paths and the state formats, below all of them.

:mod:`exact_math` (division, square root and ``lerp`` as torch's CPU and CUDA kernels round them) and
:mod:`rounding` (the counter-based random bits of stochastic rounding, and bf16 rounding with them). Nothing here
imports another part of hf_optim.
"""

import torch
import torch.nn.functional as F

BLOCK_SIZE = 256
"""Elements per block: bitsandbytes' quantization block (0.44 and later), whose absmax every blockwise format keeps,
and the unit in which the rounding streams number their counters."""


def padded_blocks(values: torch.Tensor, block: int = BLOCK_SIZE) -> torch.Tensor:
    """``(rows, n)`` as ``(rows, blocks, block)``, the last block zero-padded; the multi-tensor kernels' block form
    ``(rows, B, width)`` is regrouped into blocks of ``block`` (returned as it is when ``width`` is ``block``)."""
    if values.dim() == 3:
        return values if values.shape[-1] == block else values.reshape(values.shape[0], -1, block)
    pad = -values.shape[-1] % block
    return (F.pad(values, (0, pad)) if pad else values).view(values.shape[0], -1, block)
