"""4-bit state with a rank-1 normalized second moment (Li et al. 2023's best setting, "B128/DE + Rank-1/Linear").

- Signed slots (first moments) are stored exactly as :mod:`hf_optim.formats.blockwise4` stores them:
  packed codes of the signed tree map, one fp32 absmax per 128 elements (torchao's ``AdamW4bit``).
- Unsigned slots (second moments) are rank-1 normalized (:mod:`hf_optim.formats.rank1_quant4`): packed codes of
  the linear map without zero, and per slot row an fp32 maximum per matrix row (``absmaxK``) and per matrix
  column (``absmaxK_col``) of the parameter seen as :func:`~hf_optim.formats.rank1_quant4.matrix_shape`.

Measured (``benchmarks/quality/quality4.py``, docs/performance.md#quality-of-quantized-state): on a 3-layer MLP
regression where the torchao-compatible format ends 5-8% off 32-bit AdamW's final loss, this one ends within 1.3%; on
the tiny fine-tunes both are within 1.5%. State: v costs 0.5 byte/element plus ``4 * (rows + cols)`` bytes, less than
``blockwise4``'s 4 bytes per 128 elements for large matrices, more for small or thin ones.

Limits: the column scales span the whole matrix, so a slot cannot be quantized in independent chunks
(:attr:`whole_tensor`): this format has no flat-buffer (multi-tensor) form and no Triton twin (:attr:`triton_rows` is
None); the optimizers step its tensors one by one on the PyTorch path (``optim/runner.py``), also on a GPU, and its
:meth:`flat_buffers` and friends raise. ``multi_tensor.step_tensor`` steps it eagerly over the whole tensor, with
fp32 temporaries the size of the parameter (the chunked paths bound theirs). Kernels take a slot as ``[codes as int8,
scale A, scale B, qmap, encoder thresholds]``: for a signed slot A is the per-block absmax and B is empty, for an
unsigned slot A and B are the row and column scales.

Which algorithms: only those with an unsigned (second-moment) slot (:meth:`suits`): AdamW, AdEMAMix and LAMB. A
signed slot is stored exactly as ``blockwise4`` stores it (:meth:`stored_as`; a loaded state's first moment is
recognised as ``blockwise4``), so for Lion and RMSprop, whose only slot is signed, this format would be
``blockwise4`` under another name.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from hf_optim.formats import quant4, rank1_quant4
from hf_optim.formats.base import Scales, StateDictError, StateFormat, register_format
from hf_optim.formats.blockwise4 import BLOCKWISE4
from hf_optim.formats.quant4 import BLOCK_SIZE, encoder_thresholds, packed_length, qmap4
from hf_optim.formats.rank1_quant4 import matrix_shape

NO_FLAT_FORM = ("the rank1_4bit state format has no flat-buffer (multi-tensor) form: its column scales span the "
                "whole matrix; step such parameters on the per-tensor path")


def col_key(spec) -> str:
    """State key of an unsigned slot's column scales: ``absmax2_col`` for ``state2``."""
    return spec.absmax_key + "_col"


class Rank1Blockwise4(StateFormat):
    name, bits, code, width, block_size, packed = "rank1_4bit", 4, 3, 5, BLOCK_SIZE, True
    # no bitsandbytes alias: optim_bits=4 stays blockwise4 (torchao's format); chosen only by state_format
    class_suffix, optim_suffix, label, rank, optim_bits = "4bitRank1", "4bit_rank1", "4-bit rank-1", 4, None
    whole_tensor = True  # its column scales span the whole tensor: stepped in one piece (multi_tensor.step_tensor)
    triton_rows = None  # the column scales span the whole tensor: no tile can quantize its own blocks
    ahead_of = "blockwise4"  # whose recognises() also accepts this format's second-moment slot

    def suits(self, slots) -> bool:
        return any(not spec.signed for spec in slots)

    def stored_as(self, spec) -> StateFormat:
        return BLOCKWISE4 if spec.signed else self

    def main_length(self, numel: int) -> int:
        return packed_length(numel)

    # -- allocation -------------------------------------------------------------------------------------------
    def init_slot(self, state: dict, spec, param: torch.Tensor, allocate: Callable) -> None:
        if spec.signed:
            BLOCKWISE4.init_slot(state, spec, param, allocate)
            return
        n = param.numel()
        rows, cols = matrix_shape(param.shape)
        lead = () if spec.rows == 1 else (spec.rows,)
        # All-zero codes and scales: code 0 times a zero scale decodes to exactly 0.
        state[spec.key] = allocate((*lead, packed_length(n)), dtype=torch.uint8, device=param.device,
                                   elements=n)
        state[spec.qmap_key] = qmap4(False, param.device)
        state[spec.absmax_key] = torch.zeros((*lead, rows), dtype=torch.float32, device=param.device)
        state[col_key(spec)] = torch.zeros((*lead, cols), dtype=torch.float32, device=param.device)

    def raw(self, state: dict, spec) -> list[torch.Tensor]:
        codes = state[spec.key].view(spec.rows, -1)
        scale_a = state[spec.absmax_key].view(spec.rows, -1)
        if spec.signed:
            scale_b = scale_a.new_empty((spec.rows, 0))
        else:
            scale_b = state[col_key(spec)].view(spec.rows, -1)
        return [codes.view(torch.int8), scale_a, scale_b, state[spec.qmap_key],
                encoder_thresholds(spec.signed, codes.device)]

    def slice_raw(self, raw, start, stop, block_form):
        raise NotImplementedError(NO_FLAT_FORM)

    def flat_buffers(self, rows, total, signed, device, allocate):
        raise NotImplementedError(NO_FLAT_FORM)

    def kernel_chunk(self, buffers, start, stop, signed, device):
        raise NotImplementedError(NO_FLAT_FORM)

    def flat_views(self, buffers, offset, numel):
        raise NotImplementedError(NO_FLAT_FORM)

    def bind(self, state, spec, views, shape):
        raise NotImplementedError(NO_FLAT_FORM)

    def main_offset_bytes(self, offset: int) -> int:
        raise NotImplementedError(NO_FLAT_FORM)

    def main_dtype(self) -> torch.dtype:
        return torch.uint8

    # -- math -------------------------------------------------------------------------------------------------
    def dequantize(self, raw: Sequence[torch.Tensor], signed: bool, n: int | None = None) -> torch.Tensor:
        codes, scale_a, scale_b, qmap = raw[:4]
        if signed:
            return BLOCKWISE4.dequantize([codes, scale_a, qmap], True, n)
        return rank1_quant4.dequantize(codes, scale_a, scale_b, qmap, n)

    def store(self, values: torch.Tensor, raw: Sequence[torch.Tensor], signed: bool, scales=None) -> None:
        codes, scale_a, scale_b, qmap, thresholds = raw
        if signed:
            BLOCKWISE4.store(values, [codes, scale_a, qmap, thresholds], True, scales)
        else:
            rank1_quant4.quantize_into(values, thresholds, codes, scale_a, scale_b,
                                       None if scales is None else tuple(scales))

    # -- scales: a row scale per matrix row (a run of its columns), a column scale across the rows ------------
    def scales(self, spec, shape):
        if spec.signed:
            return BLOCKWISE4.scales(spec, shape)
        cols = matrix_shape(shape)[1]
        return (Scales(spec.absmax_key, cols), Scales(col_key(spec), cols, across=True))

    def span_shape(self, spec, shape, runs):
        if spec.signed:
            return BLOCKWISE4.span_shape(spec, shape, runs)
        return (runs, matrix_shape(shape)[1])  # whole matrix rows: the matrix keeps its columns

    def scales_of(self, values, raw, signed):
        if signed:
            return BLOCKWISE4.scales_of(values, raw, signed)
        return list(rank1_quant4.scales(values, raw[1].shape[-1], raw[2].shape[-1]))

    def unpack_codes(self, main: torch.Tensor, n: int) -> torch.Tensor:
        return quant4.unpack_codes(main, n)

    def pack_codes(self, codes: torch.Tensor, signed: bool) -> torch.Tensor:
        return quant4.pack_codes(codes, signed)

    # -- size and checkpoints ---------------------------------------------------------------------------------
    def state_bytes(self, numel: int, rows: int = 1, signed: bool = False,
                    shape: tuple[int, ...] | None = None) -> int:
        """Bytes of one slot of ``rows`` x ``numel`` elements.

        Args:
            numel (int): elements of the parameter.
            rows (int, default 1): stacked rows of the slot.
            signed (bool, default False): a first-moment slot (block-wise, like ``blockwise4``).
            shape (tuple | None, default None): the parameter's shape, which sets an unsigned slot's row and
                column scales; None means a 1-D parameter of ``numel`` elements.
        """
        if signed:
            return BLOCKWISE4.state_bytes(numel, rows)
        scales = rank1_quant4.scale_count(shape if shape is not None else (numel,))
        return rows * (packed_length(numel) + 4 * scales) + 4 * 16

    def slot_bytes(self, spec, shape: tuple[int, ...]) -> int:
        return self.state_bytes(math.prod(shape), spec.rows, signed=spec.signed, shape=tuple(shape))

    def keys(self, spec) -> tuple[str, ...]:
        if spec.signed:
            return BLOCKWISE4.keys(spec)
        return (spec.key, spec.absmax_key, col_key(spec), spec.qmap_key)

    def recognises(self, state: dict, spec) -> bool:
        if spec.signed:  # stored as blockwise4 stores it, and recognised as blockwise4's (stored_as)
            return False
        return isinstance(state.get(col_key(spec)), torch.Tensor) and BLOCKWISE4.recognises(state, spec)

    def check_loaded(self, param: torch.Tensor, state: dict, spec, where: str) -> None:
        if spec.signed:
            BLOCKWISE4.check_loaded(param, state, spec, where)
            return
        rows, cols = matrix_shape(param.shape)
        lead = () if spec.rows == 1 else (spec.rows,)
        expected = {spec.key: (*lead, packed_length(param.numel())), spec.absmax_key: (*lead, rows),
                    col_key(spec): (*lead, cols)}
        self.check_shapes(state, spec, expected, where, "rank-1 4-bit")
        if not torch.equal(state[spec.qmap_key].detach().cpu().float(), qmap4(False)):
            raise StateDictError(f"{where}: {spec.qmap_key} is not the 4-bit unsigned linear map this format uses")


RANK1_4BIT = register_format(Rank1Blockwise4())


def bytes_per_element(shape: tuple[int, ...]) -> float:
    """State bytes per parameter element of an AdamW-style pair (one signed and one unsigned slot) for a parameter
    of ``shape``, maps included."""
    numel = math.prod(shape)
    total = RANK1_4BIT.state_bytes(numel, signed=True) + RANK1_4BIT.state_bytes(numel, shape=tuple(shape))
    return total / numel
