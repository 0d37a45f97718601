"""Shared by the conformance and format tests: round-trip error bounds from a slot's map, each element's
quantization scale, the brute-force 8-bit reference encoder, and an optimizer built with test-friendly defaults."""

from __future__ import annotations

import warnings

import torch

import hf_optim
from hf_optim.core.state_store import StateSpec
from hf_optim.formats import StateFormat
from hf_optim.formats.dynamic_map import dynamic_map
from hf_optim.formats.rank1_quant4 import matrix_shape
from hf_optim.numerics import padded_blocks


def round_trip_bound(state: dict, spec: StateSpec, fmt: StateFormat) -> float:
    """Largest round-trip error of one element relative to its scale (the block absmax; a rank-1 slot's
    ``min(row, col)``), from the map stored in the slot: half the widest gap between neighbouring map values, the
    whole gap next to 0 (tiny negatives keep a negative code), and the distance from the range's ends ([-1, 1]
    signed, [0, 1] unsigned) to the nearest map value; twice that for a slot rounded stochastically. fp32: 0."""
    if not fmt.quantized:
        return 0.0
    code_values = getattr(fmt, "code_values", None)
    if code_values is not None:  # a format whose map is arithmetic (no qmapK): the format's own values
        qmap = code_values(spec.signed).double()
        if not fmt.rounds_stochastically(spec.signed):
            return map_bound(qmap, spec.signed)
        # rounded stochastically, a value goes to either neighbour: up to the widest whole gap; below the smallest
        # value (a map without zero) it rounds up to it
        low = -1.0 if spec.signed else 0.0
        return max((qmap[1:] - qmap[:-1]).max().item(), qmap[0].item() - low, 1.0 - qmap[-1].item())
    if spec.qmap_key not in state:  # a float8 format: its code book is the float8 type's finite values
        root = getattr(fmt, "stores_root", lambda _: False)(spec.signed)
        bound = float8_bound(state[spec.key].dtype, spec.signed, root)
        # rounded stochastically, a value goes to either neighbour: up to the whole gap, not half of it
        return 2 * bound if getattr(fmt, "rounds_stochastically", lambda _: False)(spec.signed) else bound
    qmap = state[spec.qmap_key].detach().double().sort().values
    return map_bound(qmap, spec.signed)


def float8_bound(dtype: torch.dtype, signed: bool, root: bool) -> float:
    """:func:`map_bound` of the map of every finite value of a float8 ``dtype`` over its largest (the block absmax
    maps to it), from the 256 bit patterns; a slot storing square roots squares its values on decoding, so its error
    relative to the block's absmax ``A`` is ``(r + b)**2 - r**2 <= 2b + b**2`` for ``r <= 1``."""
    values = torch.arange(256, dtype=torch.uint8).view(dtype).double()
    values = values[values.isfinite()].unique()
    qmap = values / values.max()
    bound = map_bound(qmap if signed else qmap[qmap >= 0], signed)
    return 2 * bound + bound * bound if root else bound


def map_bound(qmap: torch.Tensor, signed: bool) -> float:
    """The bound of a sorted map of values in [-1, 1] (see :func:`round_trip_bound`)."""
    low = -1.0 if signed else 0.0
    bound = max((qmap[1:] - qmap[:-1]).max().item() / 2, qmap[0].item() - low, 1.0 - qmap[-1].item())
    if signed and bool((qmap == 0).any()):
        zero = int((qmap == 0).nonzero()[0])
        bound = max(bound, (qmap[zero] - qmap[zero - 1]).item(), (qmap[zero + 1] - qmap[zero]).item())
    return bound


def element_scale(fmt: StateFormat, values: torch.Tensor, signed: bool, shape: tuple[int, ...]) -> torch.Tensor:
    """Each element's quantization scale for ``values`` ``(rows, n)``: its block's absmax, or for a rank-1 unsigned
    slot (a whole-tensor format) ``min(row max, column max)`` of the parameter seen as a matrix."""
    rows, n = values.shape
    magnitude = values.detach().abs().float()
    if getattr(fmt, "whole_tensor", False) and not signed:
        r, c = matrix_shape(shape)
        matrix = magnitude.view(rows, r, c)
        return torch.minimum(matrix.amax(2, keepdim=True), matrix.amax(1, keepdim=True)).view(rows, n)
    size = fmt.block_size or 1
    blocks = fmt.num_blocks(n) if fmt.quantized else n
    padded = torch.nn.functional.pad(magnitude, (0, blocks * size - n))
    return padded.view(rows, blocks, size).amax(2).repeat_interleave(size, dim=1)[:, :n]


def build(cls, params, **kwargs):
    """``cls(params, **kwargs)`` without its warnings (paged classes on CPU); Adafactor with a first moment to store."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # paged classes on CPU
        if cls is hf_optim.Adafactor:
            kwargs = {"beta1": 0.9, "lr": 1e-2, "relative_step": False, **kwargs}  # a first moment to store
        return cls(params, **kwargs)


def reference_codes(values: torch.Tensor, signed: bool) -> torch.Tensor:
    """Brute force: nearest map value to value/absmax (exact ties to the code nearer zero), then the sign fix."""
    qmap = dynamic_map(signed).double()
    blocks = padded_blocks(values.view(1, -1))
    absmax = blocks.abs().amax(-1, keepdim=True)
    y = (blocks / torch.where(absmax > 0, absmax, torch.ones_like(absmax))).double().flatten()[: values.numel()]
    mids = ((qmap[1:].float() + qmap[:-1].float()) * 0.5).double()
    above = torch.where(y.unsqueeze(-1) < 0, y.unsqueeze(-1) >= mids, y.unsqueeze(-1) > mids)
    codes = above.sum(-1)
    if signed:
        codes = torch.where(torch.signbit(y) & (codes == 127), 126, codes)
    return codes.to(torch.uint8)
