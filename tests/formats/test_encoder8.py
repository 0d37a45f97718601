"""The arithmetic 8-bit encoder (``triton_encode8``) and its PyTorch twin (``encode8``) against the reference encoder.

The reference is ``dynamic_map``'s: the nearest map value of ``rn(s / absmax)`` with ties toward zero and the sign
fix (``blockwise.quantize`` / ``blockwise.encode``, themselves checked against ``_nearest_codes`` and bitsandbytes
elsewhere). The exhaustive proof over every fp32 in [-1, 1] is ``benchmarks/proofs/encoder8_proof.py``; these are the
fast checks: the Triton helpers in the interpreter (on CUDA on a GPU machine) on targeted values, the twin on a
sample, and a check that the probes catch a one-ulp error in the encoder's table.
"""

import functools
from fractions import Fraction

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from hf_optim.formats import encode8  # noqa: E402
from hf_optim.formats import quant8 as blockwise  # noqa: E402
from hf_optim.formats.dynamic_map import (  # noqa: E402
    create_dynamic_map,
    dynamic_map,
    encoder_table,
)
from hf_optim.kernels.triton_path import encode8 as te  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(ON_GPU, reason="GPU machine: the cuda cases run the kernels")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]
SIGNS = [pytest.param(True, id="signed"), pytest.param(False, id="unsigned")]


def reference_codes(x: torch.Tensor, signed: bool) -> torch.Tensor:
    return blockwise.encode(x.float().cpu(), encoder_table(signed, "cpu"), signed)


def probes(signed: bool) -> torch.Tensor:
    """Every map midpoint and its 1..4-ulp neighbours, both signs; every map value; zeros, tiny values, +-1."""
    qmap = create_dynamic_map(signed)
    mids = (qmap[1:] + qmap[:-1]) * 0.5
    near = [mids] + [encode8.nudge(mids, steps) for steps in (-4, -3, -2, -1, 1, 2, 3, 4)]
    values = torch.cat(near + [qmap])
    tiny = torch.tensor([0.0, 1e-45, 1e-40, 1.1754943508222875e-38, 1e-30, 1e-7, 2.7e-7, 1.0])
    values = torch.cat([values, tiny]).clamp(-1.0, 1.0)
    return torch.cat([values, -values])


def random_patterns(count: int, seed: int) -> torch.Tensor:
    """fp32 values drawn uniformly over the bit patterns of [-1, 1]: every binade equally, subnormals included."""
    gen = torch.Generator().manual_seed(seed)
    magnitude = torch.randint(0, 0x3F800001, (count,), generator=gen, dtype=torch.int64)
    negative = torch.randint(0, 2, (count,), generator=gen, dtype=torch.int64)
    bits = magnitude - negative * (1 << 31)
    return bits.to(torch.int32).view(torch.float32)


def random_blocks(blocks: int, seed: int, signed: bool) -> torch.Tensor:
    """(blocks, 256) values with absmax from subnormal to near the fp32 maximum, exact +-absmax, zero blocks and
    -0.0, and values within ulps of every midpoint times the absmax."""
    gen = torch.Generator().manual_seed(seed)
    exponents = torch.randint(-160, 124, (blocks, 1), generator=gen).float()
    values = torch.randn(blocks, 256, generator=gen) * torch.exp2(exponents)
    values[:, :16] *= torch.logspace(-12, 0, 16)  # tiny against the block's absmax
    values[0] = 0.0
    values[1, :7] = -0.0
    values[2, 3] = -values[2].abs().max() * 2  # the absmax is a negative value
    values[3] = torch.exp2(torch.tensor(127.0)) * torch.rand(256, generator=gen)  # huge absmax
    values[4] = torch.exp2(torch.tensor(-140.0)) * torch.randn(256, generator=gen)  # subnormal absmax
    # the remaining rows: values next to every map midpoint times the block's absmax
    qmap = create_dynamic_map(signed)
    mids = (qmap[1:] + qmap[:-1]) * 0.5
    for row in range(5, blocks):
        absmax = values[row].abs().max()
        near = encode8.nudge((mids[torch.randint(0, 255, (255,), generator=gen)].double() * absmax.double()).float(),
                      int(torch.randint(-2, 3, (1,), generator=gen)))
        values[row, 1:] = near.clamp(-absmax, absmax)
        values[row, 0] = absmax
    return values


# ------------------------------------------------------------------------------------------------------------
# Test kernels
@triton.jit
def _encode_kernel(x_ptr, out_ptr, tables, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, te.encode8(tl.load(x_ptr + offs, mask=mask, other=0.0), tables), mask=mask)


@triton.jit
def _quantize_rows_kernel(values_ptr, codes_ptr, absmax_ptr, tables, n, BLOCKS: tl.constexpr):
    blocks = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
    offs = blocks[:, None] * 256 + tl.arange(0, 256)[None, :]
    mask = offs < n
    codes, absmax = te.quantize8_tile(tl.load(values_ptr + offs, mask=mask, other=0.0), mask, tables)
    tl.store(codes_ptr + offs, codes, mask=mask)
    tl.store(absmax_ptr + blocks, absmax, mask=blocks * 256 < n)


@triton.jit
def _quantize_threads_kernel(values_ptr, codes_ptr, absmax_ptr, tables, BLOCKS: tl.constexpr):
    """The fused kernels' tile: (BLOCKS, 2, 16, 8), per-block parameters computed once and broadcast."""
    blocks = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
    halves = blocks[:, None] * 2 + tl.arange(0, 2)[None, :]
    rows = halves[:, :, None] * 16 + tl.arange(0, 16)[None, None, :]
    offs = rows[:, :, :, None] * 8 + tl.arange(0, 8)[None, None, None, :]
    values = tl.load(values_ptr + offs)
    absmax = tl.max(tl.max(tl.max(tl.abs(values), axis=3), axis=2), axis=1)
    scale, norm, reciprocal = te.quantize8_params(absmax)
    codes = te.quantize8(values, scale[:, None, None, None], norm[:, None, None, None],
                         reciprocal[:, None, None, None], tables)
    tl.store(codes_ptr + offs, codes)
    tl.store(absmax_ptr + blocks, absmax)


@triton.jit
def _dequantize_kernel(codes_ptr, absmax_ptr, qmap, out_ptr, n, BLOCKS: tl.constexpr):
    blocks = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
    offs = blocks[:, None] * 256 + tl.arange(0, 256)[None, :]
    mask = offs < n
    values = te.dequantize8_tile(codes_ptr, absmax_ptr, qmap, blocks, offs, mask, blocks * 256 < n)
    tl.store(out_ptr + offs, values, mask=mask)


@triton.jit
def _fma_kernel(a_ptr, b_ptr, c_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.fma(tl.load(a_ptr + offs), tl.load(b_ptr + offs), tl.load(c_ptr + offs)))


@functools.cache
def interpreter_fma_rounds_once() -> bool:
    """Whether Triton's CPU interpreter computes ``tl.fma`` with one rounding, as the hardware does. Triton 3.9's
    does (C ``std::fma``); 3.8's computes ``x * y + z`` in numpy, rounding the product first. The probe is
    ``test_fma32_rounds_once``'s tie: (2**-24 + 2**-47) * (1 - 2**-23) + (1 + 2**-23) is just below the halfway
    point 1 + 2**-23 + 2**-24, so it rounds down to 1 + 2**-23 once, but up (ties to even) after the product was
    rounded to 2**-24."""
    a = torch.tensor([2.0**-24 + 2.0**-47, -(2.0**-24 + 2.0**-47)])
    b = torch.tensor([1.0 - 2.0**-23, 1.0 - 2.0**-23])
    c = torch.tensor([1.0 + 2.0**-23, -(1.0 + 2.0**-23)])
    out = torch.empty(2)
    _fma_kernel[(1,)](a, b, c, out, BLOCK=2)
    return out.tolist() == [1.0 + 2.0**-23, -(1.0 + 2.0**-23)]


def require_faithful_fma(device: str) -> None:
    """Skip a kernel whose result depends on ``tl.fma`` rounding once when the interpreter's does not (the cuda
    cases, ``-m gpu``, run it with the hardware fma)."""
    if device == "cpu" and not interpreter_fma_rounds_once():
        pytest.skip(f"Triton {triton.__version__}'s interpreter rounds tl.fma twice (x * y, then + z): the "
                    "quantize8 settling fma needs one rounding; the GPU run (-m gpu, the cuda cases) covers it")


def encode_triton(x: torch.Tensor, signed: bool, device: str) -> torch.Tensor:
    x = x.to(device).contiguous()
    out = torch.empty(x.shape, dtype=torch.uint8, device=device)
    _encode_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, encode8.encoder8_tables(signed, device), x.numel(),
                                                     BLOCK=1024)
    return out.cpu()


def quantize_triton(values: torch.Tensor, signed: bool, device: str, kernel: str = "rows"):
    values = values.to(device).contiguous()
    n = values.numel()
    codes = torch.empty(n, dtype=torch.uint8, device=device)
    absmax = torch.empty(-(-n // 256), dtype=torch.float32, device=device)
    tables = encode8.encoder8_tables(signed, device)
    if kernel == "rows":
        _quantize_rows_kernel[(triton.cdiv(absmax.numel(), 4),)](values, codes, absmax, tables, n, BLOCKS=4)
    else:
        _quantize_threads_kernel[(absmax.numel() // 4,)](values, codes, absmax, tables, BLOCKS=4)
    return codes.cpu(), absmax.cpu()


# ------------------------------------------------------------------------------------------------------------
# Tables
@pytest.mark.parametrize("signed", SIGNS)
def test_entries_are_the_reference_midpoints(signed):
    qmap = create_dynamic_map(signed)
    mids = (qmap[1:] + qmap[:-1]) * 0.5
    entries = encode8.entry_table(signed)
    pairs = torch.arange(255)
    if signed:  # the sign-fix pair (codes 126 | 127) never moves up: no midpoint there
        pairs = pairs[pairs != 126]
        assert entries[126].tolist() == list(encode8.NEVER_UP)
    assert torch.equal(entries[pairs, 0], mids[pairs])
    assert torch.equal(entries[pairs, 1].abs(), (torch.nextafter(mids[pairs].abs(), torch.tensor(2.0))
                                                  - mids[pairs].abs()) / 2)
    assert torch.equal(entries[pairs, 1].sign(), mids[pairs].sign())
    assert encode8.encoder8_tables(signed).numel() * 4 == encode8.ENTRIES_AT + 256 * encode8.ENTRY_BYTES


# ------------------------------------------------------------------------------------------------------------
# The twin (the proof's model) on a sample
@pytest.mark.parametrize("signed", SIGNS)
def test_twin_encodes_probes_and_random_patterns_as_the_reference(signed):
    values = torch.cat([probes(signed), random_patterns(200_000, seed=1)])
    assert torch.equal(encode8.encode_twin(values, signed), reference_codes(values, signed))


@pytest.mark.parametrize("signed", SIGNS)
@pytest.mark.parametrize("reciprocal_ulps", [-64, 0, 64])
def test_twin_quantizes_as_the_reference(signed, reciprocal_ulps):
    """Any block reciprocal within the proof's tolerance (64 ulps here) gives the reference codes."""
    values = random_blocks(48, seed=2, signed=signed)
    codes, absmax = encode8.quantize_twin(values.unsqueeze(0), signed, reciprocal_ulps=reciprocal_ulps)
    ref_codes, ref_absmax = blockwise.quantize(values.reshape(1, -1), encoder_table(signed, "cpu"), signed)
    assert torch.equal(absmax.flatten(), ref_absmax.flatten())
    assert torch.equal(codes.flatten(), ref_codes.flatten())


FLOAT32_ULP_BITS = 23
FLOAT32_MIN_EXPONENT = -126
FLOAT32_MAX = Fraction((2**24 - 1) * 2**104)  # (2 - 2**-23) * 2**127


def round_to_float32(exact: Fraction) -> float:
    """``exact`` rounded once to the nearest fp32, ties to even (+-inf past the rounding range of the largest fp32).
    An exact zero gives +0.0."""
    if exact == 0:
        return 0.0
    magnitude = abs(exact)
    exponent = magnitude.numerator.bit_length() - magnitude.denominator.bit_length()
    if Fraction(2) ** exponent > magnitude:  # now 2**exponent <= magnitude < 2**(exponent + 1)
        exponent -= 1
    ulp = Fraction(2) ** (max(exponent, FLOAT32_MIN_EXPONENT) - FLOAT32_ULP_BITS)  # subnormals: 2**-149
    rounded = round(magnitude / ulp) * ulp  # Fraction's round() takes an exact half to the even integer
    value = float("inf") if rounded > FLOAT32_MAX else float(rounded)  # an fp32 value is exact as a Python float
    return value if exact > 0 else -value


def exact_fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """The single-rounding fp32 fma in exact rational arithmetic (slow: a few thousand values)."""
    return torch.tensor([round_to_float32(Fraction(x) * Fraction(y) + Fraction(z))
                         for x, y, z in zip(a.tolist(), b.tolist(), c.tolist(), strict=True)], dtype=torch.float32)


def double_rounding_candidates(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triples where rounding twice goes wrong for about one in ten: a * b = 2**-24 + e with |e| <= 2**-49 and c =
    +-1, so whenever |e| < 2**-53 the float64 sum is 1 + 2**-24, exactly halfway between two fp32 values, while the
    exact sum is not."""
    gen = torch.Generator().manual_seed(seed)
    b = 1.0 + torch.randint(0, 2**23, (count,), generator=gen, dtype=torch.float64) / 2**23
    a = (2.0**-24 / b).float()
    sign = torch.where(torch.rand(count, generator=gen) < 0.5, -1.0, 1.0)
    return a * sign, b.float(), sign


def test_fma32_rounds_once():
    """The twin's fma rounds a * b + c once: (2**-24 + 2**-47) * (1 - 2**-23) = 2**-24 - 2**-70, so 1 + 2**-23
    plus it lies just below a halfway point, where float64 arithmetic (rounding to 1 + 2**-23 + 2**-24 exactly,
    then ties to even) would go up. Random triples and near-ties agree with exact rational arithmetic rounded once
    to fp32 (``round_to_float32``), and the near-ties are sharp: rounding twice gets some of them wrong."""
    a = torch.tensor([2.0**-24 + 2.0**-47, -(2.0**-24 + 2.0**-47)])
    b = torch.tensor([1.0 - 2.0**-23, 1.0 - 2.0**-23])
    c = torch.tensor([1.0 + 2.0**-23, -(1.0 + 2.0**-23)])
    assert encode8.fma32(a, b, c).tolist() == [1.0 + 2.0**-23, -(1.0 + 2.0**-23)]
    assert ((a.double() * b.double() + c.double()).float() != encode8.fma32(a, b, c)).all()  # a real tie
    assert exact_fma32(a, b, c).tolist() == [1.0 + 2.0**-23, -(1.0 + 2.0**-23)]

    gen = torch.Generator().manual_seed(7)
    a, b, c = (torch.randn(4000, generator=gen) * torch.exp2(torch.randint(-30, 30, (4000,), generator=gen))
               for _ in range(3))
    assert torch.equal(encode8.fma32(a, b, c), exact_fma32(a, b, c))

    a, b, c = double_rounding_candidates(2000, seed=8)
    expected = exact_fma32(a, b, c)
    assert ((a.double() * b.double() + c.double()).float() != expected).sum() > 10
    assert torch.equal(encode8.fma32(a, b, c), expected)


def test_round_to_float32_matches_torch_on_float64():
    """The reference rounding itself: for float64 inputs (exact Fractions) it equals torch's float64 -> fp32
    conversion, which rounds once, across normal, subnormal and overflowing magnitudes and exact halfway points."""
    gen = torch.Generator().manual_seed(9)
    values = torch.randn(3000, generator=gen, dtype=torch.float64) * torch.exp2(
        torch.randint(-160, 130, (3000,), generator=gen).double())
    halfway = torch.tensor([1.0 + 2.0**-24, 1.0 + 3 * 2.0**-24, 2.0**-149 * 1.5, 2.0**-149 * 0.5, 2.0**-149 * 2.5,
                            float(FLOAT32_MAX) + 2.0**103, float(FLOAT32_MAX) + 2.0**103 * 0.99], dtype=torch.float64)
    values = torch.cat([values, halfway, -halfway])
    expected = values.float()
    got = torch.tensor([round_to_float32(Fraction(v)) for v in values.tolist()], dtype=torch.float32)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("signed", SIGNS)
def test_probes_catch_a_one_ulp_error_in_the_table(signed, monkeypatch):
    """The probe set is sharp: moving any single midpoint of the encoder's table by one ulp changes some code."""
    tables = encode8._tables_cpu(signed).clone()
    entries = tables[encode8.LINE_KEYS * 4:].view(torch.float32).view(256, 2)
    pair = 200
    entries[pair, 0] = torch.nextafter(entries[pair, 0], torch.tensor(2.0))
    monkeypatch.setattr(encode8, "_tables_cpu", lambda s: tables if s == signed else encode8._tables_cpu(s))
    values = probes(signed)
    assert not torch.equal(encode8.encode_twin(values, signed), reference_codes(values, signed))


# ------------------------------------------------------------------------------------------------------------
# The Triton helpers
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("signed", SIGNS)
def test_encode8_matches_the_reference(device, signed):
    values = torch.cat([probes(signed), random_patterns(20_000, seed=3)])
    assert torch.equal(encode_triton(values, signed, device), reference_codes(values, signed))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("signed", SIGNS)
@pytest.mark.parametrize("kernel", ["rows", "threads"])
def test_quantize8_matches_the_reference(device, signed, kernel):
    """The blocks' norm is not 1, so the settling fma's product is inexact: unlike ``encode8`` (norm 1), this
    needs a faithful ``tl.fma``."""
    require_faithful_fma(device)
    values = random_blocks(32, seed=4, signed=signed)
    if kernel == "rows":  # a partial last block: 31 whole blocks and 100 values
        values = values.flatten()[: 31 * 256 + 100]
    codes, absmax = quantize_triton(values, signed, device, kernel)
    ref_codes, ref_absmax = blockwise.quantize(values.reshape(1, -1), encoder_table(signed, "cpu"), signed)
    assert torch.equal(absmax, ref_absmax.flatten())
    assert torch.equal(codes, ref_codes.flatten())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("signed", SIGNS)
def test_quantize8_non_finite_absmax(device, signed):
    """A NaN absmax divides by 1 (values pass through, beyond +-1 too), an infinite one by inf (finite values
    become +-0), as the reference; codes of the NaN and infinite values themselves are unspecified."""
    values = random_blocks(8, seed=5, signed=signed)
    values[:, 1:] = torch.randn(8, 255) * torch.logspace(-20, 20, 255)
    values[:4, 0] = float("nan")
    values[4:, 0] = float("inf")
    values[4, 9] = float("-inf")
    codes, absmax = quantize_triton(values, signed, device)
    ref_codes, ref_absmax = blockwise.quantize(values.reshape(1, -1), encoder_table(signed, "cpu"), signed)
    finite = values.flatten().isfinite()
    assert torch.equal(codes[finite], ref_codes.flatten()[finite])
    assert absmax[:4].isnan().all() and (absmax[4:] == float("inf")).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("signed", SIGNS)
def test_dequantize8_matches_the_reference(device, signed):
    gen = torch.Generator().manual_seed(6)
    n = 5 * 256 + 77
    codes = torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)
    absmax = torch.rand(6, generator=gen) * torch.logspace(-30, 30, 6)
    qmap = dynamic_map(signed, device)
    out = torch.empty(n, device=device)
    _dequantize_kernel[(2,)](codes.to(device), absmax.to(device), qmap, out, n, BLOCKS=4)
    expected = blockwise.dequantize(codes.view(1, -1), absmax.view(1, -1), dynamic_map(signed))
    assert torch.equal(out.cpu(), expected.flatten())
