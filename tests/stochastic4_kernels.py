"""Test kernels that quantize and dequantize one ``stochastic4`` row through the format's Triton row I/O, tiled exactly
like the fused optimizer kernels (``tile.tile``): whole tiles unmasked, the last one masked."""

import torch
import triton
import triton.language as tl

from hf_optim.formats.quant4_sr import signed_table
from hf_optim.kernels.triton_path.stochastic4 import load_stochastic4, store_stochastic4
from hf_optim.kernels.triton_path.tile import masked_load, tile

BLOCKS = 2


@triton.jit
def _store_kernel(values_ptr, codes_ptr, scale_ptr, n, SIGNED: tl.constexpr, BLOCKS: tl.constexpr, W: tl.constexpr,
                  FULL: tl.constexpr):
    blocks, halves, rows, offs = tile(tl.program_id(0) * BLOCKS, BLOCKS, W)
    mask = None if FULL else offs < n
    values = masked_load(values_ptr + offs, mask, 0.0)
    store_stochastic4(codes_ptr, scale_ptr, 0, blocks, halves, rows, offs, values, mask, n, SIGNED, FULL, False)


@triton.jit
def _load_kernel(codes_ptr, scale_ptr, out_ptr, table_ptr, n, SIGNED: tl.constexpr, BLOCKS: tl.constexpr,
                 W: tl.constexpr, FULL: tl.constexpr):
    blocks, halves, rows, offs = tile(tl.program_id(0) * BLOCKS, BLOCKS, W)
    mask = None if FULL else offs < n
    values = load_stochastic4(codes_ptr, scale_ptr, table_ptr, blocks, halves, rows, offs, mask, n, SIGNED, FULL,
                              False)
    tl.store(out_ptr + offs, values, mask=mask)


def _launch(kernel, tensors, per_element, n: int, signed: bool, width: int) -> None:
    """``kernel`` over the whole tiles (unmasked), then the last partial tile (masked) on views of ``tensors`` from its
    first element: ``per_element[i]`` is how many entries of ``tensors[i]`` an element takes (values 1, codes 1/2,
    scales 1/64)."""
    per_tile = BLOCKS * 256
    whole = n // per_tile
    warps = BLOCKS * 256 // (32 * width)
    if whole:
        kernel[(whole,)](*tensors, n, SIGNED=signed, BLOCKS=BLOCKS, W=width, FULL=True, num_warps=warps)
    if n % per_tile:
        offset = whole * per_tile
        views = [tensor[int(offset * share):] for tensor, share in zip(tensors, per_element)]
        kernel[(1,)](*views, n - offset, SIGNED=signed, BLOCKS=BLOCKS, W=width, FULL=False, num_warps=warps)


def quantize(values: torch.Tensor, signed: bool, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of a 1-D fp32 ``values`` through ``store_stochastic4`` (buffers pre-filled with other
    bytes: every byte and scale of the tensor's blocks must be written)."""
    n = values.numel()
    blocks = -(-n // 256)
    codes = torch.full((128 * blocks,), 0xAB, dtype=torch.uint8, device=values.device)
    scale = torch.full((4 * blocks,), -1.0, dtype=torch.float32, device=values.device)
    _launch(_store_kernel, [values.contiguous(), codes, scale], [1, 1 / 2, 1 / 64], n, signed, width)
    return codes, scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, n: int, signed: bool, width: int) -> torch.Tensor:
    """fp32 values of a row through ``load_stochastic4``."""
    out = torch.zeros(n, dtype=torch.float32, device=codes.device)
    table = signed_table(codes.device)
    _launch(_load_kernel, [codes, scale, out, table], [1 / 2, 1 / 64, 1, 0], n, signed, width)
    return out
