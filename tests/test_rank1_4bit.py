"""The rank1_4bit state format: rank-1 normalized 4-bit second moment (Li et al. 2023), block-wise first moment.

References are computed here independently: the scale ``min(row max, column max)`` with plain reductions, the nearest
map value by brute-force argmin, AdamW's update from its formula.
"""

from __future__ import annotations

import pytest
import torch

import hf_optim
from hf_optim.kernels import rank1_quant4
from hf_optim.kernels.blockwise4 import encoder_thresholds, qmap4
from hf_optim.kernels.formats.base import StateDictError
from hf_optim.kernels.formats.rank1_4bit import RANK1_4BIT, installed

LINEAR = qmap4(False)


@pytest.fixture
def rank1_installed(monkeypatch):
    """The format in the registry for the test (the registry does not select formats by name yet)."""
    monkeypatch.setenv("HF_OPTIM_COMPILE", "0")
    with installed():
        yield


def second_moment_like(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Non-negative values whose magnitude varies by row and by column over several decades, like a v."""
    gen = torch.Generator().manual_seed(seed)
    row = torch.exp(3 * torch.randn(rows, 1, generator=gen))
    col = torch.exp(3 * torch.randn(1, cols, generator=gen))
    return row * col * torch.rand(rows, cols, generator=gen) ** 2


def reference_qdq(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dequantized values, element scales) of a non-negative matrix: nearest map value by argmin."""
    scale = torch.minimum(matrix.amax(1, keepdim=True), matrix.amax(0, keepdim=True))
    normalized = matrix / torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = (normalized.unsqueeze(-1) - LINEAR).abs().argmin(-1)
    return LINEAR[codes] * scale, scale


def roundtrip(values: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    codes, row, col = rank1_quant4.quantize(values.reshape(1, -1), rows, cols, encoder_thresholds(False))
    return rank1_quant4.dequantize(codes, row, col, LINEAR, values.numel()).view_as(values)


def test_roundtrip_is_the_nearest_map_value_under_the_rank1_scale():
    v = second_moment_like(96, 80)
    expected, scale = reference_qdq(v)
    got = roundtrip(v, 96, 80)
    assert torch.equal(got, expected)
    # error bounds: half a step (1/32) of the element's scale above the map's smallest value (1/16), up to 1/16 below
    normalized = v / scale
    bound = torch.where(normalized >= 1 / 16, scale / 32, scale / 16)
    assert ((got - v).abs() <= bound * (1 + 1e-6)).all()


def test_rank1_scale_beats_blockwise_on_rows_and_columns_of_different_magnitude():
    """The reason for the format: relative error of the values far smaller than their 128-block's maximum."""
    from hf_optim.kernels import blockwise4

    v = second_moment_like(128, 128, seed=1)
    rank1 = roundtrip(v, 128, 128)
    codes, absmax = blockwise4.quantize(v.reshape(1, -1), encoder_thresholds(False))
    block = blockwise4.dequantize(codes, absmax, LINEAR).view_as(v)
    relative = lambda got: ((got - v).abs() / v.clamp_min(1e-30)).median()  # noqa: E731
    assert relative(rank1) < 0.5 * relative(block)


def test_zero_rows_columns_and_matrix_decode_to_exact_zeros():
    v = second_moment_like(16, 24)
    v[3] = 0
    v[:, 5] = 0
    got = roundtrip(v, 16, 24)
    assert (got[3] == 0).all() and (got[:, 5] == 0).all()
    assert torch.equal(roundtrip(torch.zeros(16, 24), 16, 24), torch.zeros(16, 24))


def test_the_largest_element_of_its_row_and_column_is_exact():
    v = second_moment_like(32, 32, seed=2)
    got = roundtrip(v, 32, 32)
    at_both = (v == v.amax(1, keepdim=True)) & (v == v.amax(0, keepdim=True))
    assert at_both.any() and torch.equal(got[at_both], v[at_both])


@pytest.mark.parametrize("shape,matrix", [((5001,), (40, 128)), ((100,), (1, 100)), ((8, 3, 4), (8, 12))])
def test_matrix_shape_and_odd_or_padded_lengths(shape, matrix):
    assert rank1_quant4.matrix_shape(shape) == matrix
    v = torch.rand(shape)
    got = roundtrip(v.reshape(-1), *matrix).view(shape)
    padded = torch.nn.functional.pad(v.reshape(-1), (0, matrix[0] * matrix[1] - v.numel())).view(matrix)
    expected = reference_qdq(padded)[0].reshape(-1)[: v.numel()].view(shape)
    assert torch.equal(got, expected)


def test_bad_shapes_are_refused_with_the_numbers():
    with pytest.raises(ValueError, match="100 values do not fill a 4 x 128 matrix"):
        rank1_quant4.quantize(torch.rand(1, 100), 4, 128, encoder_thresholds(False))
    codes, row, col = rank1_quant4.quantize(torch.rand(1, 100), 1, 100, encoder_thresholds(False))
    with pytest.raises(ValueError, match="n=7"):
        rank1_quant4.dequantize(codes, row, col, LINEAR, 7)


class AdamWRank1(hf_optim.AdamW):
    """AdamW with the rank1_4bit format, wired by hand until the registry selects formats by name."""

    def __init__(self, params, **kwargs):
        super().__init__(params, optim_bits=4, **kwargs)

    def _state_format(self, param, group):
        fmt = super()._state_format(param, group)
        return RANK1_4BIT if fmt.bits == 4 else fmt

    def _multi_tensor_eligible(self, full, param):
        return False


def test_adamw_steps_follow_the_formula_with_the_stored_moments(rank1_installed):
    """Two AdamW steps on a (64, 96) weight: the stored v is the rank-1 quantization of the exact v, the stored m
    blockwise4's, and the second step uses exactly the dequantized moments."""
    torch.manual_seed(0)
    p0 = torch.randn(64, 96)
    grads = [torch.randn(64, 96) * torch.exp(torch.randn(64, 1)) for _ in range(2)]
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.999, 1e-8, 0.0
    param = torch.nn.Parameter(p0.clone())
    opt = AdamWRank1([param], lr=lr, weight_decay=wd)
    fmt, specs = RANK1_4BIT, opt.state_specs
    expected, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
    for t, g in enumerate(grads, start=1):
        param.grad = g.clone()
        opt.step()
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        expected -= lr * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps)
        state = opt.state[param]
        stored_m, stored_v = (fmt.dequantize(fmt.raw(state, spec), spec.signed).view_as(p0) for spec in specs)
        assert torch.equal(stored_v, reference_qdq(v)[0])
        assert (stored_m - m).abs().max() <= m.abs().max() * 0.12  # the tree map's widest gap is 0.225 of the block
        torch.testing.assert_close(param.detach(), expected, rtol=0, atol=1e-6)
        m, v = stored_m, stored_v


def test_state_bytes_are_what_the_state_holds_and_the_state_dict_round_trips(rank1_installed):
    torch.manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(256, 64), (5001,), (10,)]]
    opt = AdamWRank1(params, lr=1e-3)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    for p in params[:2]:
        state = opt.state[p]
        held = sum(state[k].nbytes for spec in opt.state_specs for k in RANK1_4BIT.keys(spec))
        expected = sum(RANK1_4BIT.state_bytes(p.numel(), signed=spec.signed, shape=tuple(p.shape))
                       for spec in opt.state_specs)
        assert held == expected
    assert RANK1_4BIT.state_bytes(4096 * 4096, shape=(4096, 4096)) == 4096 * 4096 // 2 + 4 * 8192 + 64

    clones = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = AdamWRank1(clones, lr=1e-3)
    resumed.load_state_dict(opt.state_dict())
    grads = [torch.randn_like(p) for p in params]
    for a, b, g in zip(params, clones, grads):
        a.grad, b.grad = g.clone(), g.clone()
    opt.step()
    resumed.step()
    for a, b in zip(params, clones):
        assert torch.equal(a, b)


def test_a_loaded_state_with_wrong_column_scales_is_refused(rank1_installed):
    param = torch.nn.Parameter(torch.randn(64, 80))
    opt = AdamWRank1([param], lr=1e-3)
    param.grad = torch.randn_like(param)
    opt.step()
    state, spec = dict(opt.state[param]), opt.state_specs[1]
    state["absmax2_col"] = torch.zeros(79)
    with pytest.raises(StateDictError, match=r"absmax2_col has shape \(79,\), expected \(80,\)"):
        RANK1_4BIT.check_loaded(param, state, spec, "param 0")


def test_the_registry_is_restored_after_use():
    from hf_optim.kernels.formats import BLOCKWISE4, FORMATS, format_for_bits, format_named

    before = list(FORMATS)
    with installed():
        # found by name; optim_bits=4 stays bitsandbytes'/torchao's blockwise4 (this format has no optim_bits alias)
        assert next(iter(FORMATS)) == "rank1_4bit" and format_named("rank1_4bit") is RANK1_4BIT
        assert format_for_bits(4) is BLOCKWISE4
        with installed():
            pass
        assert next(iter(FORMATS)) == "rank1_4bit"  # a nested use keeps the outer one's
    assert list(FORMATS) == before and "rank1_4bit" not in FORMATS


def test_no_flat_buffer_form():
    with pytest.raises(NotImplementedError, match="no flat-buffer"):
        RANK1_4BIT.flat_buffers(1, 256, False, torch.device("cpu"), torch.zeros)
