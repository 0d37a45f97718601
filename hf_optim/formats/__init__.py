"""State formats: how one optimizer state slot is stored, each as one object.

A format owns everything that depends on the storage of a slot: allocating it (through the optimizer's
allocator, so paged state works for every format), the raw tensors the kernels take, dequantizing and
quantizing them in PyTorch (its Triton twin, row I/O and tuning, is one ``TritonRows`` in
``hf_optim.kernels.triton_path`` that :attr:`StateFormat.triton_rows` names by reference), the
bytes it occupies (for the estimator and ``state_memory``), its state-dict keys and the validation of a loaded
state dict. Algorithms never see a format: they read and write fp32 values.

========== ===== ======================================================================================
format     code  storage of one slot (``rows`` stacked EMAs, ``n`` elements each)
========== ===== ======================================================================================
fp32       0     fp32 values, the slot's shape
blockwise8 1     bitsandbytes' 8-bit blockwise format: uint8 codes (slot's shape), absmax per 256 elements
blockwise4 2     4-bit blockwise (Li et al. 2023): two codes per byte, absmax per 128 elements
rank1_4bit 3     first moment as blockwise4; second moment 4-bit, scaled by min(row max, column max) of
                 the parameter as a matrix (Li et al. 2023's rank-1 normalization): whole-tensor, no Triton
fp8        4     float8 e4m3 codes (the slot's shape), absmax per 256 elements
========== ===== ======================================================================================

Beside the format objects (``base``, ``fp32``, ``blockwise8``, ``blockwise4``, ``rank1_4bit``, ``fp8``), this
folder holds the PyTorch math of their codes: :mod:`dynamic_map` (bitsandbytes' 8-bit maps and encoder table),
:mod:`quant8` (8-bit blockwise quantization), :mod:`encode8` (the arithmetic 8-bit encoder's table and PyTorch
twin), :mod:`quant4` (4-bit blockwise quantization) and :mod:`rank1_quant4` (rank-1 normalized 4-bit); fp8's
conversion is in its format module. The Triton twins of this math are in ``hf_optim.kernels.triton_path``. Modules
here import torch, each other and two modules of ``hf_optim.numerics`` below them, ``exact_math`` (correctly rounded
division and ``lerp``) and ``rounding`` (the stochastic-rounding bits, which fp8's second moments use);
never ``triton``, ``triton_path`` or a higher layer (``tests/architecture/test_import_layers.py``).
"""

from hf_optim.formats.base import (
    FORMATS,
    SlotLayout,
    StateFormat,
    available_state_formats,
    format_for_bits,
    format_named,
    formats_by_rank,
    loaded_format,
    register_format,
    settings_format,
    with_overrides,
)
from hf_optim.formats.blockwise4 import BLOCKWISE4
from hf_optim.formats.blockwise8 import BLOCKWISE8
from hf_optim.formats.fp8 import FP8
from hf_optim.formats.fp32 import FP32
from hf_optim.formats.rank1_4bit import RANK1_4BIT
from hf_optim.formats.stochastic4 import STOCHASTIC4

__all__ = [
    "BLOCKWISE4",
    "BLOCKWISE8",
    "FORMATS",
    "FP32",
    "FP8",
    "RANK1_4BIT",
    "STOCHASTIC4",
    "SlotLayout",
    "StateFormat",
    "available_state_formats",
    "format_for_bits",
    "format_named",
    "formats_by_rank",
    "loaded_format",
    "register_format",
    "settings_format",
    "with_overrides",
]
