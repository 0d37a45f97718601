"""Exact math shared by both compute paths and the state formats, below all of them.

:mod:`exact_math` (division, square root and ``lerp`` as torch's CPU and CUDA kernels round them) and
:mod:`rounding` (the counter-based random bits of stochastic rounding, and bf16 rounding with them). Nothing here
imports another part of hf_optim.
"""

BLOCK_SIZE = 256
"""Elements per block: bitsandbytes' quantization block (0.44 and later), whose absmax every blockwise format keeps,
and the unit in which the rounding streams number their counters."""
