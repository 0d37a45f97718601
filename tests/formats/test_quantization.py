"""The 8-bit format itself: the dynamic maps' landmarks, and the encoder is exact nearest (the maps against
bitsandbytes and the spec: tests/formats/test_dynamic_map.py)."""

import bitsandbytes.functional as bnbF
import pytest
import torch
from format_helpers import reference_codes

from hf_optim.formats import quant8 as blockwise
from hf_optim.formats.dynamic_map import dynamic_map, encoder_table
from hf_optim.numerics import padded_blocks


def test_dynamic_map_landmarks():
    signed, unsigned = dynamic_map(True), dynamic_map(False)
    assert signed[127] == 0 and signed[255] == 1 and abs(signed[0].item() + 0.99297) < 1e-5
    assert unsigned[0] == 0 and unsigned[255] == 1
    assert len(set(signed.tolist())) == 256 and len(set(unsigned.tolist())) == 256


def awkward_values(n: int, signed: bool) -> torch.Tensor:
    """Wide dynamic range, exact zeros, a zero block, and values sitting exactly on midpoints."""
    x = torch.randn(n) * 10 ** torch.empty(n).uniform_(-8, 0)
    x[::7] = 0.0
    x[256:512] = 0.0
    qmap = dynamic_map(signed)
    mids = (qmap[1:] + qmap[:-1]) * 0.5
    x[1024:1024 + 255] = mids  # block 4: absmax will be the largest midpoint, so y != mids exactly; still exercised
    x[768] = 1.0  # block 3 has absmax exactly 1, so these land exactly on midpoints:
    x[769:769 + 200] = mids[-200:]
    return x if signed else x.abs()


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("n", [4096, 5000, 256 * 7 + 1])
def test_quantize_is_exact_nearest_with_sign_fix(signed, n):
    values = awkward_values(max(n, 1300), signed)[:n] if n >= 1300 else awkward_values(1300, signed)[:n]
    table = encoder_table(signed, torch.device("cpu"))
    codes, absmax = blockwise.quantize(values.view(1, -1), table, signed)
    assert codes.dtype == torch.uint8 and absmax.shape == (1, blockwise.num_blocks(n))
    assert torch.equal(codes.view(-1), reference_codes(values, signed))
    expected_absmax = padded_blocks(values.view(1, -1)).abs().amax(-1)
    assert torch.equal(absmax, expected_absmax)


def test_sign_fix_keeps_tiny_negatives_negative():
    table = encoder_table(True, torch.device("cpu"))
    values = torch.tensor([[1.0, -1e-9, 1e-9, -0.0, 0.0]])
    codes, _ = blockwise.quantize(values, table, True)
    # -0.0 has its sign bit set and takes the smallest negative code, as bitsandbytes' CUDA signbit test does.
    assert codes.tolist()[0] == [255, 126, 127, 126, 127]


@pytest.mark.parametrize("signed", [True, False])
def test_dequantize_matches_bitsandbytes(signed):
    n = 3000
    codes = torch.randint(0, 256, (n,), dtype=torch.uint8)
    absmax = torch.rand(blockwise.num_blocks(n)) * 3
    qmap = dynamic_map(signed)
    ours = blockwise.dequantize(codes.view(1, -1), absmax.view(1, -1), qmap).view(-1)
    theirs = bnbF.dequantize_blockwise(codes, absmax=absmax, code=qmap, blocksize=256)
    assert torch.equal(ours, theirs)


