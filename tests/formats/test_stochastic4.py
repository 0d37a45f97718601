"""The ``stochastic4`` format's math (:mod:`hf_optim.formats.quant4_sr`) against its definition, and its Triton twin.

References are independent of the code under test: the maps from their formulas in float64, each code checked
against the two map values around its value (brute force), the rounding's mean against the value it rounds, the hash
recomputed in int64 (where nothing can overflow), and the byte layout from its definition.
"""

import math

import pytest
import torch

import hf_optim
from hf_optim.core.state_store import StateSpec, read_slot
from hf_optim.formats import quant4_sr as sr
from hf_optim.formats.stochastic4 import STOCHASTIC4


def reference_map(signed: bool) -> torch.Tensor:
    """The maps by their definitions: magnitudes 0, 1/16, 2/16, 3/16, 1/4, 1/2, 3/4, 1 both signs; ``(k + 1) / 16``."""
    if signed:
        magnitudes = torch.tensor([1 / 16, 2 / 16, 3 / 16, 1 / 4, 1 / 2, 3 / 4, 1.0])
        return torch.cat([-magnitudes.flip(0), torch.zeros(1), magnitudes])
    return ((torch.arange(16, dtype=torch.float64) + 1) / 16).float()


@pytest.mark.parametrize("signed", [True, False])
def test_maps_are_their_definitions(signed):
    assert torch.equal((sr.SIGNED_MAP if signed else sr.UNSIGNED_MAP), reference_map(signed))
    assert torch.equal(STOCHASTIC4.code_values(signed), reference_map(signed))
    codes = torch.arange(15 if signed else 16, dtype=torch.int32)
    assert torch.equal(sr.decode(codes, signed), reference_map(signed))  # code c is map entry c


def probe(signed: bool, rows: int = 1, n: int = 3000) -> torch.Tensor:
    """Values over eight decades, exact map values of their block's scale, zeros, -0.0 and an all-zero half."""
    gen = torch.Generator().manual_seed(5)
    values = torch.randn(rows, n, generator=gen) * torch.logspace(-6, 2, n)[torch.randperm(n, generator=gen)]
    values[:, 256:384] = 0.0  # an all-zero half
    block = values[:, 512:640]
    block[:, 0] = 3.0  # the half's scale, then its map values exactly
    block[:, 1:16] = 3.0 * reference_map(signed)[:15]
    block[:, 16:] = block[:, 16:].clamp(-2.9, 2.9)
    values[0, 7] = -0.0
    return values if signed else values.abs()


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("rows", [1, 2])
def test_each_code_is_one_of_the_two_map_values_around_its_value(signed, rows):
    values = probe(signed, rows)
    codes, scale = sr.quantize(values, signed)
    n = values.shape[1]
    assert codes.shape == (rows, sr.code_bytes(n)) and scale.shape == (rows, sr.scale_count(n))
    decoded = sr.dequantize(codes, scale, signed, n)
    padded = torch.nn.functional.pad(values, (0, scale.shape[1] * 64 - n)).view(rows, -1, 64)
    assert torch.equal(scale.view(rows, -1), padded.abs().amax(-1))  # the exact half absmax
    per_element = scale.view(rows, -1, 1).expand(-1, -1, 64).reshape(rows, -1)[:, :n]
    grid = reference_map(signed).double()
    y = (values.double() / per_element.double().clamp(min=1e-300)).clamp(-1, 1)
    index = torch.bucketize(y, grid, right=True).clamp(1, len(grid) - 1)  # the upper neighbour's index
    below = y < grid[0]  # unsigned: below the smallest value (the map has no zero) a value rounds up to it
    lo = torch.where(below, grid[0], grid[index - 1]) * per_element
    hi = torch.where(below, grid[0], grid[index]) * per_element
    ok = torch.isclose(decoded.double(), lo, rtol=1e-6, atol=0) | torch.isclose(decoded.double(), hi, rtol=1e-6,
                                                                                 atol=0)
    ok |= (per_element == 0) & (decoded == 0)
    assert ok.all(), f"{int((~ok).sum())} values decode to neither neighbour"
    exact = values[:, 512:527]  # map values of their scale: stored exactly
    assert torch.equal(decoded[:, 512:527], exact)
    assert torch.all(decoded[:, 256:384] == 0)
    if signed:
        assert torch.all(decoded * values >= 0), "a value changed sign"


def test_rounding_is_unbiased():
    """The mean rounding error over 2**21 values is zero to within 6 standard errors of a fair coin's (the error of
    one value is at most a gap, its standard deviation at most half a gap): uniform values, and values just off
    the map values (what a state whose block only decays holds)."""
    gen = torch.Generator().manual_seed(11)
    n = 1 << 21
    tolerance = 6 * 0.5 / math.sqrt(n)
    for signed in (True, False):
        grid = reference_map(signed)
        uniform = torch.rand(1, n, generator=gen) * (2 if signed else 1) - (1 if signed else 0)
        near = grid[torch.randint(1, len(grid) - 1, (1, n), generator=gen)] * (1 + 1e-3 * torch.rand(1, n,
                                                                                                     generator=gen))
        for values in (uniform, near):
            values = values.clone()
            values.view(-1, 64)[:, 0] = 1.0  # every group's scale is 1: values are their own normalized values
            codes, scale = sr.quantize(values, signed)
            decoded = sr.dequantize(codes, scale, signed, n)
            index = torch.bucketize(values, grid, right=True).clamp(1, len(grid) - 1)
            gap = grid[index] - grid[index - 1]
            inside = (values >= grid[0]) & (values <= 1)  # the unsigned map rounds values under its first up
            error = ((decoded - values) / gap)[inside].double()
            assert abs(error.mean().item()) < tolerance, (signed, error.mean().item())


def test_random_bits_never_overflow_int32():
    """The hash in int32 equals the same hash in int64 (where nothing can overflow) for every 16-bit pattern the
    multiplications see, every lane, and the extreme inputs."""
    gen = torch.Generator().manual_seed(3)
    bits = torch.cat([torch.randint(-2**31, 2**31 - 1, (1 << 20,), generator=gen, dtype=torch.int64),
                      torch.arange(1 << 16), torch.tensor([-1, 2**31 - 1, -2**31, 0])]).to(torch.int32)
    lane = torch.arange(bits.numel(), dtype=torch.int32) % 256
    wide = sr.sr_bits16(bits.long() & 0xFFFFFFFF, lane.long())
    narrow = sr.sr_bits16(bits, lane)
    assert torch.equal(narrow.long(), wide) and int(narrow.min()) >= 0 and int(narrow.max()) < 65536
    assert all(0 < m < 2**15 for m in sr.MULTIPLIERS)


def test_planar_nibbles_and_block_form():
    """Byte ``i`` of a block holds element ``i`` (low nibble) and ``128 + i`` (high nibble); the last block pads with
    the code of 0.0; the multi-tensor block form gives the same bytes as the flat form."""
    values = torch.zeros(1, 300)
    values[0, :256] = reference_map(True)[torch.arange(256) % 15]  # code i % 15 (scale 1: +-1 in every half)
    values[0, 0], values[0, 128], values[0, 256] = 1.0, 1.0, -1.0
    codes, scale = sr.quantize(values, True)
    expected = (torch.arange(256) % 15).int()
    expected[0] = expected[128] = 14
    assert torch.equal(codes[0, :128].int() & 15, expected[:128])
    assert torch.equal(codes[0, :128].int() >> 4, expected[128:])
    assert int(codes[0, 128]) == 0 | (7 << 4)  # element 256 (-1: code 0) and padding element 384 (code 7)
    assert torch.equal(codes[0, 129:], torch.full((127,), 0x77, dtype=torch.uint8))
    block_codes = torch.empty(1, 2, 128, dtype=torch.int8)
    block_scale = torch.empty(1, 8)
    padded = torch.nn.functional.pad(values, (0, 212)).view(1, 2, 256)
    sr.quantize_into(padded, block_codes, block_scale, True)
    assert torch.equal(block_codes.view(torch.uint8).view(1, -1), codes) and torch.equal(block_scale, scale)
    assert torch.equal(sr.dequantize(block_codes, block_scale, True).view(1, -1)[:, :300],
                       sr.dequantize(codes, scale, True, 300))


def test_states_without_gradients_decay_in_expectation():
    """Stochastic rounding keeps a decaying state's small moves: with no gradient on most elements (each half's
    first element, with a steady gradient, holds the half's maximum from step 3 on), AdamW4bit's second moment of
    those elements decays as ``beta2**t`` on average; rounded to nearest, most of them could not move off their
    code (a 1% decrease is a tenth of a gap or less)."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.zeros(16, 256))
    opt = hf_optim.AdamW4bit([p], lr=0.0, weight_decay=0.0, betas=(0.9, 0.99))
    p.grad = torch.rand(16, 256) + 1.0
    opt.step()
    spec = StateSpec("state2", signed=False)
    first = read_slot(opt.state[p], spec, p.numel()).view(16, 2, 128).clone()
    steps = 40
    for _ in range(steps):
        grad = torch.zeros(16, 2, 128)
        grad[:, :, 0] = 0.4  # others stay above 1/16 of the half's maximum: no rounding up to the smallest code
        p.grad = grad.view(16, 256)
        opt.step()
    last = read_slot(opt.state[p], spec, p.numel()).view(16, 2, 128)
    ratio = (last[..., 1:] / first[..., 1:]).mean().item() / 0.99**steps
    assert abs(ratio - 1) < 0.03, ratio


@pytest.mark.parametrize("width", [8, 4, 2])
def test_triton_twin_equals_pytorch(width):
    """``load_stochastic4`` / ``store_stochastic4`` in kernels tiled like the fused ones (whole tiles unmasked, the
    last one masked; ``width`` elements per thread row, as the fused kernels use): codes, scales and values equal
    the PyTorch twin's bit for bit, every byte of the tensor's blocks is written, and none beyond."""
    pytest.importorskip("triton")
    from stochastic4_kernels import dequantize, quantize

    n = 1537  # three whole 512-element tiles and a partial one
    for signed in (True, False):
        values = probe(signed, 1, n)
        values[0, 900] = values[0, 900:1000].abs().max()  # a tie for a half's maximum
        codes, scale = quantize(values[0], signed, width)
        ref_codes, ref_scale = sr.quantize(values, signed)
        assert torch.equal(codes, ref_codes[0]) and torch.equal(scale, ref_scale[0])
        assert torch.equal(dequantize(codes, scale, n, signed, width), sr.dequantize(ref_codes, ref_scale, signed,
                                                                                     n)[0])
