"""The 4-bit state math (hf_optim.formats.quant4 and its Triton twin) against references written here.

The reference quantizer is the paper's, written the slow obvious way: per 128-element block divide by the
block's absmax, pick the map value nearest in float64 by brute force over all 16 (exact ties to the upper code,
torchao's rule), pack two codes per byte with integer arithmetic. Maps are checked against bitsandbytes'
``create_dynamic_map`` and against torchao's values when torchao is importable. torchao is not in the project's
environment on purpose: when it is installed, transformers imports it on every ``from transformers import
Trainer`` (1.7 s, and import warnings on the console that break test_console_output.py). To run the torchao cases:

    pip install --no-deps --target /tmp/torchao_site torchao
    PYTHONPATH=.:/tmp/torchao_site python -m pytest tests/formats/test_blockwise4.py -q
"""

import platform

import pytest
import torch

from hf_optim.formats import dynamic_map
from hf_optim.formats import quant4 as b4
from hf_optim.formats.blockwise8 import MAP_ULP_TOLERANCE

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="GPU machine: cuda cases run")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]


# ------------------------------------------------------------------------------------------------------------
# Reference implementation of the paper's quantizers


def reference_map(signed: bool) -> torch.Tensor:
    """The 16 values from bitsandbytes' own builder (its 256-entry list holds 240 padding zeros), or k/16."""
    if not signed:
        return torch.arange(1, 17, dtype=torch.float32) / 16
    import bitsandbytes.functional as bnbF

    padded = bnbF.create_dynamic_map(signed=True, max_exponent_bits=3, total_bits=4)
    nonzero = padded[padded != 0]
    return torch.cat([nonzero, torch.zeros(1)]).sort().values


def reference_quantize(values: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes (rows, ceil(n/2)) uint8, absmax (rows, ceil(n/128))) of fp32 ``values`` (rows, n)."""
    qmap = reference_map(signed).double()
    rows, n = values.shape
    blocks = -(-n // 128)
    codes = torch.empty(rows, blocks * 128, dtype=torch.int64)
    absmax = torch.empty(rows, blocks, dtype=torch.float32)
    for row in range(rows):
        for block in range(blocks):
            chunk = values[row, block * 128 : (block + 1) * 128]
            top = chunk.abs().max() if chunk.numel() else torch.tensor(0.0)
            normalized = (chunk / top if top > 0 else chunk).double()  # fp32 division, as the format defines it
            distance = (normalized.unsqueeze(-1) - qmap).abs()
            nearest = distance == distance.min(-1, keepdim=True).values
            chosen = torch.where(nearest, torch.arange(16), -1).max(-1).values  # ties: the upper code
            chosen = torch.where(normalized.isnan(), 0, chosen)
            padded = torch.full((128,), int((qmap.abs()).argmin()))  # padding holds the code of 0.0
            padded[: chosen.numel()] = chosen
            codes[row, block * 128 : (block + 1) * 128] = padded
            absmax[row, block] = top
    packed = codes[:, 0::2] * 16 + codes[:, 1::2]
    return packed[:, : -(-n // 2)].to(torch.uint8), absmax


def thresholds(signed: bool, device: str = "cpu") -> torch.Tensor:
    return b4.encoder_thresholds(signed, device)


# ------------------------------------------------------------------------------------------------------------
# Maps


@pytest.mark.parametrize("signed", [True, False])
def test_maps_equal_the_reference_construction(signed):
    ours = b4.qmap4(signed)
    assert ours.dtype == torch.float32 and ours.shape == (16,)
    assert torch.equal(ours.view(torch.int32), reference_map(signed).view(torch.int32))
    assert torch.all(ours[1:] > ours[:-1])  # sorted, distinct
    assert ours[-1] == 1.0
    if signed:
        assert ours[7] == 0.0 and ours[0] == -0.8875 and ours[8] == pytest.approx(0.0055)
    else:
        assert ours[0] == 0.0625  # no zero: a second moment never quantizes to 0


@pytest.mark.parametrize("signed", [True, False])
def test_tree_map_is_the_8bit_construction(signed):
    """Same builder, 8-bit parameters: the map the 8-bit format uses, bit for bit under torch's FMA kernels; the
    builder runs torch.linspace, so under kernels without FMA (x86 ATEN_CPU_CAPABILITY=default) it is the 8-bit
    constants within their load tolerance (tests/formats/test_dynamic_map.py)."""
    built, constant = b4.tree_map(signed, 7, 8), dynamic_map.create_dynamic_map(signed)
    if platform.machine().lower() in ("x86_64", "amd64") and torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        distance = (built.view(torch.int32).long() - constant.view(torch.int32).long()).abs()  # same signs: ulp
        assert int(distance.max()) <= MAP_ULP_TOLERANCE
    else:
        assert torch.equal(built.view(torch.int32), constant.view(torch.int32))


@pytest.mark.parametrize("signed,exponent_bits,total_bits", [(True, 2, 4), (True, 4, 8), (True, 5, 8), (False, 2, 3)])
def test_tree_map_equals_bitsandbytes_for_other_parameters(signed, exponent_bits, total_bits):
    """Fraction bits beyond the decades (signed 2/4, 4/8, 5/8) and a 3-bit unsigned map: bitsandbytes' list with
    its zero padding removed."""
    import bitsandbytes.functional as bnbF

    padded = bnbF.create_dynamic_map(signed, exponent_bits, total_bits)
    theirs = torch.cat([padded[padded != 0], torch.zeros(1)]).sort().values
    assert torch.equal(b4.tree_map(signed, exponent_bits, total_bits).view(torch.int32), theirs.view(torch.int32))


def test_tree_map_rejects_impossible_parameters():
    with pytest.raises(ValueError, match="exponent_bits must be in 1..3"):
        b4.tree_map(True, 4, 4)
    with pytest.raises(ValueError, match="unsigned map only with exponent_bits = total_bits - 1 = 3"):
        b4.tree_map(False, 2, 4)


def test_maps_equal_torchao():
    subclass_4bit = pytest.importorskip("torchao.optim.subclass_4bit")
    for signed, theirs in ((True, subclass_4bit.get_qmap_signed()), (False, subclass_4bit.get_qmap_unsigned())):
        assert torch.equal(b4.qmap4(signed), torch.tensor(theirs, dtype=torch.float32))


# ------------------------------------------------------------------------------------------------------------
# Codes


def adversarial_values(signed: bool) -> torch.Tensor:
    """Two rows of 1000 (the last block partial): ties, midpoint neighbours, zeros, -0.0, denormals, +-absmax,
    an all-zero block, a block below 1e-12 and a block of denormals."""
    qmap = b4.qmap4(signed).double()
    mids = (qmap[1:] + qmap[:-1]) / 2
    exact_ties = mids[mids.float().double() == mids].float()  # midpoints that are fp32 numbers
    near = b4.encoder_thresholds(signed)
    probes = torch.cat([
        exact_ties, near, torch.nextafter(near, torch.tensor(-2.0)), torch.nextafter(near, torch.tensor(2.0)),
        b4.qmap4(signed), torch.tensor([0.0, -0.0, 1e-40, -1e-40, 1e-30, -1e-30, -1.0, 1.0]),
    ])
    if not signed:
        probes = probes.abs()
    values = torch.randn(2, 1000)
    values = values if signed else values.abs()
    values[0, :128] = values[0, :128].clamp(-1, 1)
    values[0, : probes.numel()] = probes
    values[0, 127] = 1.0  # block 0's absmax is 1: probes are their own normalized values
    values[1, 0:128] = 0.0  # all-zero block
    values[1, 128:256] *= 1e-13  # torchao would clip this block's scale to 1e-12
    denormals = torch.randint(1, 1 << 20, (128,), dtype=torch.int32).view(torch.float32)
    values[1, 256:384] = denormals * (torch.randn(128).sign() if signed else 1)
    if signed:
        values[1, 384] = -values[1, 385:512].abs().max() * 3  # a negative absmax
    values[1, 512:640] *= 1e30
    return values


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("n", [1, 2, 127, 128, 129, 255, 1000])
def test_codes_equal_reference_on_random_values(signed, n):
    values = torch.randn(2, n) * torch.logspace(-6, 2, n)
    values = values if signed else values.square()
    codes, scale = b4.quantize(values, thresholds(signed))
    ref_codes, ref_scale = reference_quantize(values, signed)
    assert torch.equal(codes, ref_codes) and torch.equal(scale, ref_scale)


@pytest.mark.parametrize("signed", [True, False])
def test_codes_equal_reference_on_adversarial_values(signed):
    values = adversarial_values(signed)
    codes, scale = b4.quantize(values, thresholds(signed))
    ref_codes, ref_scale = reference_quantize(values, signed)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(codes, ref_codes)
    # the compiled-path encoder (15 compares) and the eager one (bucketize) agree, NaN included
    probes = torch.cat([values.flatten() / values.abs().max(), torch.tensor([float("nan"), -0.0])])
    assert torch.equal(b4.encode(probes, thresholds(signed)), b4.encode_eager(probes, thresholds(signed)))


def test_ties_go_to_the_upper_code():
    """Unsigned midpoints (2k+1)/32 are exact fp32 ties: each takes the upper code, as torchao's ``>=``."""
    mids = (torch.arange(1, 16, dtype=torch.float32) * 2 + 1) / 32
    block = torch.cat([mids, torch.ones(1)]).view(1, -1)
    codes = b4.unpack(b4.quantize(block, thresholds(False))[0])[0]
    assert torch.equal(codes, torch.arange(1, 17, dtype=torch.int32).clamp(max=15))


def test_nibble_order_and_padding():
    """Element 2i in the high nibble; an odd length pads the last low nibble with the code of 0.0."""
    values = torch.tensor([[1.0, 0.0, -0.8875]])  # codes 15, 7, 0 in the signed map
    codes, scale = b4.quantize(values, thresholds(True))
    assert codes.tolist() == [[15 * 16 + 7, 0 * 16 + 7]] and scale.tolist() == [[1.0]]
    codes, _ = b4.quantize(values.abs(), thresholds(False))  # unsigned: 0.0 -> code 0 (1/16)
    assert codes.tolist() == [[15 * 16 + 0, 13 * 16 + 0]]


def test_nonfinite_policy():
    """A NaN or Inf makes its own block's scale non-finite (callers mask non-finite gradients first); other
    blocks are unaffected and NaN itself encodes as code 0."""
    values = torch.randn(1, 384)
    values[0, 130] = float("nan")
    values[0, 300] = float("inf")
    codes, scale = b4.quantize(values, thresholds(True))
    clean_codes, clean_scale = b4.quantize(values[:, :128], thresholds(True))
    assert torch.equal(codes[:, :64], clean_codes) and scale[0, 0] == clean_scale[0, 0]
    assert scale[0, 1].isnan() and scale[0, 2] == float("inf")
    assert b4.unpack(codes)[0, 130] == 0


# ------------------------------------------------------------------------------------------------------------
# Against torchao


def test_codes_and_values_equal_torchao():
    """torchao's OptimState4bit on block-aligned tensors: same bytes, same dequantized values, same scales except
    where torchao clips a scale below 1e-12 (documented difference)."""
    subclass_4bit = pytest.importorskip("torchao.optim.subclass_4bit")
    for signed in (True, False):
        values = adversarial_values(signed)[:, :896].reshape(1, -1)  # whole blocks
        state = subclass_4bit.OptimState4bit.zeros(values.numel(), signed=signed, block_size=128)
        state.copy_(values.flatten())
        codes, scale = b4.quantize(values, thresholds(signed))
        theirs_clipped = state.scale < 1e-12 * 1.0000001
        assert torch.equal(scale.flatten()[~theirs_clipped], state.scale[~theirs_clipped])
        assert theirs_clipped.sum() == 3  # the all-zero block, the 1e-13 block and the denormal block
        same_blocks = (~theirs_clipped).repeat_interleave(64)
        assert torch.equal(codes.flatten()[same_blocks], state.codes[same_blocks])
        ours = b4.dequantize(codes, scale, b4.qmap4(signed)).flatten()
        same_values = (~theirs_clipped).repeat_interleave(128)
        assert torch.equal(ours[same_values], state.dequantize()[same_values])
        # torchao's own codes and scales decode the same under our dequantize
        assert torch.equal(b4.dequantize(state.codes.view(1, -1), state.scale.view(1, -1), b4.qmap4(signed)),
                           state.dequantize().view(1, -1))


@pytest.mark.parametrize("signed", [True, False])
def test_encoder_equals_torchao_near_every_midpoint(signed):
    """Every fp32 within 64 ulps of each midpoint: torchao's fp32 ``residual >= gap / 2`` picks our code."""
    quant_utils = pytest.importorskip("torchao.optim.quant_utils")
    bits = thresholds(signed).view(torch.int32).unsqueeze(-1) + torch.arange(-64, 65, dtype=torch.int32)
    probes = bits.view(torch.float32).flatten()
    theirs = quant_utils.quantize_4bit_with_qmap(probes, b4.qmap4(signed))
    assert torch.equal(b4.encode_eager(probes, thresholds(signed)), theirs.int())


# ------------------------------------------------------------------------------------------------------------
# Round trip, shapes, compile


@pytest.mark.parametrize("rows,n", [(1, 0), (2, 0), (1, 1), (2, 7), (1, 128), (2, 129), (1, 4096)])
def test_shapes_and_dtypes(rows, n):
    values = torch.randn(rows, n)
    codes, scale = b4.quantize(values, thresholds(True))
    assert codes.dtype == torch.uint8 and codes.shape == (rows, (n + 1) // 2) and codes.is_contiguous()
    assert scale.dtype == torch.float32 and scale.shape == (rows, -(-n // 128))
    decoded = b4.dequantize(codes, scale, b4.qmap4(True), n)
    assert decoded.dtype == torch.float32 and decoded.shape == (rows, n)
    assert torch.equal(b4.dequantize(codes.view(torch.int8), scale, b4.qmap4(True), n), decoded)  # kernels' view
    into_codes, into_scale = torch.full_like(codes, 99), torch.full_like(scale, 9.0)
    b4.quantize_into(values, thresholds(True), into_codes.view(torch.int8), into_scale)
    assert torch.equal(into_codes, codes) and torch.equal(into_scale, scale)
    if n:
        assert b4.bytes_per_element(n) == pytest.approx((codes.numel() + 4 * scale.numel()) / (rows * n))


def test_block_aligned_3d_form_matches_2d():
    values = torch.randn(2, 3, 128)
    codes, scale = b4.quantize(values, thresholds(False))
    flat_codes, flat_scale = b4.quantize(values.view(2, -1), thresholds(False))
    assert codes.shape == (2, 3, 64) and torch.equal(codes.view(2, -1), flat_codes) and torch.equal(scale, flat_scale)
    decoded = b4.dequantize(codes, scale, b4.qmap4(False))
    assert decoded.shape == (2, 3, 128) and torch.equal(decoded.view(2, -1), b4.dequantize(flat_codes, flat_scale,
                                                                                          b4.qmap4(False)))


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="hold 9 or 10 values, not n=8"):
        b4.dequantize(torch.zeros(1, 5, dtype=torch.uint8), torch.zeros(1, 1), b4.qmap4(True), 8)
    with pytest.raises(ValueError, match=r"\(rows, n\) or \(rows, blocks, 128\), got shape \(10,\)"):
        b4.quantize(torch.zeros(10), thresholds(True))


@pytest.mark.parametrize("signed", [True, False])
def test_decode_from_constants_is_the_map(signed):
    """The optimizers' decode reads no map: its 16 values are the map's, bit for bit, and dequantizing by
    signedness equals dequantizing through the map tensor."""
    codes = torch.arange(16, dtype=torch.int32)
    assert torch.equal(b4.decode(codes, signed).view(torch.int32), b4.qmap4(signed).view(torch.int32))
    values = adversarial_values(signed)[:, :999]
    packed, scale = b4.quantize(values, thresholds(signed))
    assert torch.equal(b4.dequantize(packed, scale, signed, 999), b4.dequantize(packed, scale, b4.qmap4(signed), 999))


def test_compiled_round_trip_equals_eager():
    """Inductor (dynamic shapes, no graph break) gives the eager path's codes, scales and values (one compilation
    per map: the signedness picks the decode)."""

    def round_trip(values, thresholds, signed, codes, scale):
        b4.quantize_into(values, thresholds, codes, scale)
        return b4.dequantize(codes, scale, signed, values.shape[-1])  # the optimizers' decode: map constants

    compiled = torch.compile(round_trip, fullgraph=True, dynamic=True)
    for signed in (True, False):
        for n in (999,):  # one compilation (about 10 s): the odd length covers block and byte padding
            values = adversarial_values(signed)[:, :n]
            codes, scale = b4.quantize(values, thresholds(signed))
            out_codes, out_scale = torch.empty_like(codes), torch.empty_like(scale)
            decoded = compiled(values, thresholds(signed), signed, out_codes.view(torch.int8), out_scale)
            assert torch.equal(out_codes, codes) and torch.equal(out_scale, scale)
            assert torch.equal(decoded, b4.dequantize(codes, scale, b4.qmap4(signed), n))


# ------------------------------------------------------------------------------------------------------------
# Triton twin (interpreter on CPU, set up by conftest.py)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("signed", [True, False])
def test_triton_twin_equals_pytorch(device, signed):
    triton_blockwise4 = pytest.importorskip("hf_optim.kernels.triton_path.quant4")
    for n in (1, 129, 1000):
        values = adversarial_values(signed)[:, :n].contiguous()
        values[0, n // 2] = float("nan")
        values = values.to(device)
        codes, scale = triton_blockwise4.quantize(values, signed)
        ref_codes, ref_scale = b4.quantize(values, thresholds(signed, device))
        assert torch.equal(codes, ref_codes)
        assert torch.equal(scale.isnan(), ref_scale.isnan()) and scale[0, n // 256].isnan()  # the NaN's block
        assert torch.equal(scale.nan_to_num(), ref_scale.nan_to_num())
        qmap = b4.qmap4(signed, device)
        assert torch.equal(triton_blockwise4.dequantize(codes, scale, qmap, n).nan_to_num(),
                           b4.dequantize(codes, scale, qmap, n).nan_to_num())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("width", [8, 4])
def test_triton_state_helpers_in_a_fused_kernel_tile(device, width):
    """load_state4 / store_state4 inside a kernel tiled like the fused optimizer kernels (triton_tile.tile: whole
    tiles through one 32- or 16-bit word per row, the last partial tile byte by byte): an update of one 4-bit state
    equals the PyTorch path, and no byte past the row's end is written."""
    pytest.importorskip("triton")
    from blockwise4_kernels import scale_and_shift_state

    n = 1537  # three whole 512-element tiles and a partial one ending in an odd element (a padding nibble)
    for signed in (True, False):
        values = adversarial_values(signed).flatten()[None, :n].to(device)
        codes, scale = b4.quantize(values, thresholds(signed, device))
        expected = b4.quantize(b4.dequantize(codes, scale, b4.qmap4(signed, device), n) * 0.5 + 0.25,
                               thresholds(signed, device))
        guarded = torch.cat([codes[0], torch.full((8,), 0xAB, dtype=torch.uint8, device=device)])
        scale_and_shift_state(guarded, scale[0], b4.qmap4(signed, device), n, signed, width)
        assert torch.equal(guarded[: codes.shape[1]], expected[0][0]) and torch.equal(scale, expected[1])
        assert torch.equal(guarded[codes.shape[1]:], torch.full((8,), 0xAB, dtype=torch.uint8, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_triton_encoders_near_every_threshold(device):
    """The Triton encoders count thresholds arithmetically (``triton_blockwise4.encode4``): on every fp32 within 64
    ulps of each threshold of both maps, both signs, plus 0, -0, the map values and +-1, they give the PyTorch
    path's codes (each 128-value block holds 1.0, so values are their own normalized values).
    ``benchmarks/proofs/encoder4_proof.py`` checks every fp32 in [-1, 1]."""
    triton_blockwise4 = pytest.importorskip("hf_optim.kernels.triton_path.quant4")
    edges = torch.cat([b4.encoder_thresholds(True), b4.encoder_thresholds(False)]).abs()
    bits = edges.view(torch.int32).long()
    near = (bits[:, None] + torch.arange(-64, 65)[None, :]).flatten().to(torch.int32).view(torch.float32)
    probes = torch.cat([near, -near, b4.qmap4(True), b4.qmap4(False), torch.tensor([0.0, -0.0, 1.0, -1.0])])
    probes = probes[probes.abs() <= 1.0]
    blocks = -(-probes.numel() // 127)
    padded = torch.cat([probes, torch.zeros(blocks * 127 - probes.numel())]).view(blocks, 127)
    values = torch.cat([torch.ones(blocks, 1), padded], dim=1)  # 1.0 first: every block's absmax
    for signed in (True, False):
        row = (values if signed else values.abs()).reshape(1, -1).to(device)
        codes, scale = triton_blockwise4.quantize(row, signed)
        ref_codes, ref_scale = b4.quantize(row, thresholds(signed, device))
        assert torch.equal(scale, ref_scale) and bool((scale == 1.0).all())
        assert torch.equal(codes, ref_codes)
