"""The table-free arithmetic of the 8-bit maps (:mod:`codebook8`, research beside its proof) against the reference:
``dynamic_map``'s nearest map value, ties toward zero, and bitsandbytes' sign fix. The exhaustive check is
``encoder8_proof.py`` part 0; these are the fast ones, run with the rest of the suite (``python -m pytest``)."""

import pytest
import torch
from codebook8 import TOP_PAIR, decode, encode, encode_with, midpoint

from hf_optim.formats import encode8
from hf_optim.formats.dynamic_map import _nearest_codes, dynamic_map

SIGNS = [pytest.param(True, id="signed"), pytest.param(False, id="unsigned")]


def random_patterns(count: int, seed: int) -> torch.Tensor:
    """fp32 values uniform over the bit patterns of [-1, 1] (every binade equally, subnormals included), signed."""
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 0x3F800001, (count,), generator=gen, dtype=torch.int64)
    sign = torch.randint(0, 2, (count,), generator=gen, dtype=torch.int64) << 31
    return (bits | sign).to(torch.int32).view(torch.float32)


def nearest_codes(x: torch.Tensor, signed: bool) -> torch.Tensor:
    """The reference itself: ``dynamic_map._nearest_codes`` (nearest midpoint, ties toward zero) and the sign fix."""
    codes = _nearest_codes(x, dynamic_map(signed))
    negative = x.view(torch.int32) < 0
    if signed:
        return torch.where(negative & (codes == 127), 126, codes)
    return torch.where(negative, 0, codes)


def adversarial(signed: bool) -> torch.Tensor:
    """Every map value, every reference midpoint and its fp32 neighbours up to 2 ulps (both signs), +-0, subnormals,
    the smallest normal, +-1, and the fp32 neighbours of +-1 inside [-1, 1]."""
    qmap = dynamic_map(signed)
    mids = (qmap[1:] + qmap[:-1]) * 0.5
    near = torch.cat([mids] + [encode8.nudge(mids, steps) for steps in (-2, -1, 1, 2)] + [qmap])
    special = torch.tensor([0.0, 1e-45, 2e-45, 1e-40, 1.1754942e-38, 1.1754943508222875e-38, 1e-30, 1.0,
                            1.0 - 2.0**-24, 1.0 - 2.0**-23])
    values = torch.cat([near, special]).clamp(-1.0, 1.0)
    return torch.cat([values, -values])


@pytest.mark.parametrize("signed", SIGNS)
def test_codebook8_decode_is_the_map(signed):
    """All 256 codes, bit for bit, from uint8 and from the int8 view the kernels pass."""
    codes = torch.arange(256)
    expected = dynamic_map(signed).view(torch.int32)
    assert torch.equal(decode(codes, signed).view(torch.int32), expected)
    assert torch.equal(decode(codes.to(torch.uint8).view(torch.int8), signed).view(torch.int32), expected)


@pytest.mark.parametrize("signed", SIGNS)
def test_codebook8_midpoints_are_the_references(signed):
    qmap = dynamic_map(signed)
    zero = 127 if signed else 0
    pairs = torch.arange(TOP_PAIR[signed] + 1, dtype=torch.int32)
    expected = ((qmap[1:] + qmap[:-1]) * 0.5)[zero:]
    assert torch.equal(midpoint(pairs, signed).view(torch.int32), expected.view(torch.int32))


@pytest.mark.parametrize("signed", SIGNS)
def test_codebook8_encodes_adversarial_and_random_values_as_the_reference(signed):
    values = torch.cat([adversarial(signed), random_patterns(200_000, seed=11)])
    codes = encode(values, signed)
    assert codes.dtype == torch.int32
    assert torch.equal(codes, nearest_codes(values, signed))


@pytest.mark.parametrize("signed", SIGNS)
def test_codebook8_outside_the_unit_interval(signed):
    """A NaN block's absmax divides by 1, so finite values beyond +-1 reach the encoder: the reference's end codes.
    NaN (unspecified by the reference) takes the end code of its sign bit, as the table encoder did."""
    big = torch.tensor([1.0 + 2.0**-23, 5.0, 3e38, float("inf")])
    values = torch.cat([big, -big])
    assert torch.equal(encode(values, signed), nearest_codes(values, signed))
    nan = torch.tensor([float("nan")])
    assert encode(torch.cat([nan, -nan]), signed).tolist() == [255, 0]


@pytest.mark.parametrize("signed", SIGNS)
def test_adversarial_set_catches_a_one_ulp_error_in_a_midpoint(signed):
    """The adversarial set is sharp: a midpoint one ulp off changes some code."""
    qmap = dynamic_map(signed)
    zero = 127 if signed else 0
    mids = ((qmap[1:] + qmap[:-1]) * 0.5)[zero:].clone()
    mids[60] = torch.nextafter(mids[60], torch.tensor(2.0))
    values = adversarial(signed)
    wrong = encode_with(values, signed, lambda pair, _signed: mids[pair.long()])
    assert not torch.equal(wrong, nearest_codes(values, signed))
