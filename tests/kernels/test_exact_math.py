"""The rule helpers that make eager, compiled and Triton updates agree bit for bit."""

import numpy as np
import torch

from hf_optim.numerics import exact_math


def all_mantissas(exponent: int) -> torch.Tensor:
    """Every float32 with this biased exponent (exponent 0: the subnormals)."""
    return ((torch.tensor(exponent, dtype=torch.int32) << 23) | torch.arange(1 << 23, dtype=torch.int32)).view(
        torch.float32
    )


def test_eager_sqrt_is_correctly_rounded_for_every_mantissa():
    # A square root's rounding depends only on the mantissa and the exponent's parity: two adjacent binades cover
    # every case; the extreme binades and the subnormals are checked as well. numpy's float32 sqrt is IEEE-exact.
    for exponent in (0, 1, 126, 127, 254):
        x = all_mantissas(exponent)
        expected = torch.from_numpy(np.sqrt(x.numpy()))
        assert torch.equal(exact_math.sqrt(x), expected), exponent


def test_compiled_sqrt_and_lerp_equal_eager():
    x = torch.rand(1 << 16) * 10
    start, end = torch.randn(1 << 16), torch.randn(1 << 16)
    compiled_sqrt = torch.compile(exact_math.sqrt, fullgraph=True)
    compiled_lerp = torch.compile(exact_math.lerp, fullgraph=True)
    assert torch.equal(compiled_sqrt(x), exact_math.sqrt(x))
    for weight in (0.1, 0.5, 0.9, 1.0):
        w = torch.tensor(weight)
        assert torch.equal(compiled_lerp(start, end, w), exact_math.lerp(start, end, w)), weight
    compiled_div = torch.compile(exact_math.div, fullgraph=True)
    assert torch.equal(compiled_div(448.0, x + 1.0), exact_math.div(448.0, x + 1.0))


def test_lerp_is_torch_formula_and_exact_at_the_ends():
    start, end = torch.randn(4096), torch.randn(4096) * 1e4
    assert torch.equal(exact_math.lerp(start, end, torch.tensor(1.0)), end)
    assert torch.equal(exact_math.lerp(start, end, torch.tensor(0.0)), start)
    # within one rounding of torch.lerp (which fuses the multiply-add)
    torch.testing.assert_close(exact_math.lerp(start, end, torch.tensor(0.1)), torch.lerp(start, end, 0.1))


def test_div_with_a_number_is_one_rounding():
    # fp8's block scales (formats/fp8.py: 448 / absmax, absmax / 448) against numpy's IEEE float32 division, over
    # every mantissa of a binade; torch's own ``448.0 / x`` (reciprocal, then multiply) misses about a quarter
    x = all_mantissas(120)
    expected = torch.from_numpy(np.float32(448.0) / x.numpy())
    assert torch.equal(exact_math.div(448.0, x), expected)
    assert not torch.equal(448.0 / x, expected)
    assert torch.equal(exact_math.div(x, 448.0), torch.from_numpy(x.numpy() / np.float32(448.0)))
