"""The rank1_4bit state format: rank-1 normalized 4-bit second moment (Li et al. 2023), block-wise first moment.

References are computed here independently: the scale ``min(row max, column max)`` with plain reductions, the nearest
map value by brute-force argmin, AdamW's update from its formula.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import hf_optim
from hf_optim.core.state_store import slot_format
from hf_optim.formats import FORMATS, STOCHASTIC4, format_for_bits, format_named, rank1_quant4
from hf_optim.formats.base import StateDictError, zeroed_buffer
from hf_optim.formats.quant4 import encoder_thresholds, qmap4
from hf_optim.formats.rank1_4bit import RANK1_4BIT
from hf_optim.optim.overrides import PARAM_OVERRIDES_ATTR
from hf_optim.optim.runner import Runner

LINEAR = qmap4(False)


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
    from hf_optim.formats import quant4 as blockwise4

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


def test_adamw_steps_follow_the_formula_with_the_stored_moments():
    """Two AdamW steps on a (64, 96) weight: the stored v is the rank-1 quantization of the exact v, the stored m
    blockwise4's, and the second step uses exactly the dequantized moments."""
    torch.manual_seed(0)
    p0 = torch.randn(64, 96)
    grads = [torch.randn(64, 96) * torch.exp(torch.randn(64, 1)) for _ in range(2)]
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.999, 1e-8, 0.0
    param = torch.nn.Parameter(p0.clone())
    opt = hf_optim.AdamW4bitRank1([param], lr=lr, weight_decay=wd)
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


def test_state_bytes_are_what_the_state_holds_and_the_state_dict_round_trips():
    torch.manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(256, 64), (5001,), (10,)]]
    opt = hf_optim.AdamW4bitRank1(params, lr=1e-3)
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
    resumed = hf_optim.AdamW4bitRank1(clones, lr=1e-3)
    resumed.load_state_dict(opt.state_dict())
    grads = [torch.randn_like(p) for p in params]
    for a, b, g in zip(params, clones, grads):
        a.grad, b.grad = g.clone(), g.clone()
    opt.step()
    resumed.step()
    for a, b in zip(params, clones):
        assert torch.equal(a, b)


def test_a_loaded_state_with_wrong_column_scales_is_refused():
    param = torch.nn.Parameter(torch.randn(64, 80))
    opt = hf_optim.AdamW4bitRank1([param], lr=1e-3)
    param.grad = torch.randn_like(param)
    opt.step()
    state, spec = dict(opt.state[param]), opt.state_specs[1]
    state["absmax2_col"] = torch.zeros(79)
    with pytest.raises(StateDictError, match=r"absmax2_col has shape \(79,\), expected \(80,\)"):
        RANK1_4BIT.check_loaded(param, state, spec, "param 0")


def test_registered_by_name_with_no_optim_bits_alias_and_ahead_of_blockwise4():
    assert format_named("rank1_4bit") is RANK1_4BIT
    assert format_for_bits(4) is STOCHASTIC4  # optim_bits=4 is hf_optim's default 4-bit state
    names = list(FORMATS)
    assert names.index("rank1_4bit") < names.index("blockwise4")  # blockwise4 also accepts its second moment
    assert hf_optim.AdamW(torch.nn.Linear(2, 2).parameters(), state_format="rank1_4bit").param_groups[0][
        "state_format"] == "rank1_4bit"


@pytest.mark.parametrize("cls", [hf_optim.Lion, hf_optim.RMSprop])
def test_algorithms_without_a_second_moment_do_not_take_it(cls):
    """Their only slot is signed, which this format stores exactly as blockwise4: it would be blockwise4 renamed."""
    with pytest.raises(ValueError, match=r"Invalid state_format: 'rank1_4bit'; .* runs with .*'blockwise4'"):
        cls(torch.nn.Linear(2, 2).parameters(), state_format="rank1_4bit")
    assert not any(name.startswith(cls.__name__) and name.endswith("Rank1") for name in hf_optim.__all__)


def steps(opt, params, count, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(count):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()


def test_its_tensors_step_one_by_one_beside_flat_buffers_and_equal_the_per_tensor_path(monkeypatch):
    """On CPU the other tensors of the same optimizer keep the multi-tensor path (flat buffers); the rank-1 tensor's
    state is its own, and its result equals a run where every tensor steps one by one."""
    shapes = [(80, 96), (5000,), (37,)]
    gen = torch.Generator().manual_seed(4)
    start = [torch.randn(s, generator=gen) for s in shapes]
    params = [torch.nn.Parameter(t.clone()) for t in start]
    params[1].__dict__[PARAM_OVERRIDES_ATTR] = {"state_format": "blockwise8"}
    opt = hf_optim.AdamW4bitRank1(params, lr=1e-2)
    steps(opt, params, 3)
    located = [opt._store.locate(p, opt.state[p]) is not None for p in params]
    assert located == [False, True, True]  # rank1 (per tensor), blockwise8 override and fp32 (flat buffers)
    assert slot_format(opt.state[params[0]], opt.state_specs[1]) is RANK1_4BIT
    assert slot_format(opt.state[params[1]], opt.state_specs[1]).name == "blockwise8"

    monkeypatch.setattr(Runner, "on_multi_tensor_path", lambda self, full, param: False)
    ref = [torch.nn.Parameter(t.clone()) for t in start]
    ref[1].__dict__[PARAM_OVERRIDES_ATTR] = {"state_format": "blockwise8"}
    ref_opt = hf_optim.AdamW4bitRank1(ref, lr=1e-2)
    steps(ref_opt, ref, 3)
    for p, q in zip(params, ref):
        assert torch.equal(p, q)


def test_a_group_override_to_rank1_on_an_8bit_optimizer_steps_it_per_tensor():
    """The routing follows the state each tensor holds, not only the group's format."""
    params = [torch.nn.Parameter(torch.randn(70, 64)), torch.nn.Parameter(torch.randn(70, 64))]
    params[0].__dict__[PARAM_OVERRIDES_ATTR] = {"state_format": "rank1_4bit"}
    opt = hf_optim.AdamW8bit(params, lr=1e-2)
    steps(opt, params, 2)
    assert slot_format(opt.state[params[0]], opt.state_specs[1]) is RANK1_4BIT
    assert [opt._store.locate(p, opt.state[p]) is not None for p in params] == [False, True]


def test_paged_class_and_trainer_names():
    from hf_optim.integrations.names import OPTIMIZER_NAMES

    assert OPTIMIZER_NAMES["adamw_4bit_rank1"].cls is hf_optim.AdamW4bitRank1
    assert OPTIMIZER_NAMES["paged_adamw_4bit_rank1"].cls is hf_optim.PagedAdamW4bitRank1
    assert OPTIMIZER_NAMES["ademamix_4bit_rank1"].cls is hf_optim.AdEMAMix4bitRank1
    assert OPTIMIZER_NAMES["paged_ademamix_4bit_rank1"].cls is hf_optim.PagedAdEMAMix4bitRank1
    params = [torch.nn.Parameter(torch.randn(64, 72))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # paged state on CPU is ordinary memory (said once per process)
        opt = hf_optim.PagedAdamW4bitRank1(params, lr=1e-3)
        steps(opt, params, 1)
    assert opt.is_paged and opt.param_groups[0]["state_format"] == "rank1_4bit"
    assert slot_format(opt.state[params[0]], opt.state_specs[1]) is RANK1_4BIT


def test_no_flat_buffer_form():
    with pytest.raises(NotImplementedError, match="no flat-buffer"):
        RANK1_4BIT.flat_buffers(1, 256, False, torch.device("cpu"), zeroed_buffer)


@pytest.mark.gpu
def test_on_cuda_triton_leaves_its_tensors_to_the_pytorch_path_says_so_once_and_matches_it(monkeypatch):
    """On a GPU the rank-1 tensors step on the PyTorch path (no Triton twin) with the same result as the torch
    backend, bit for bit; the small fp32-state tensor still runs on Triton."""
    from hf_optim.optim import fast_paths

    shapes = [(256, 384), (37,)]
    gen = torch.Generator().manual_seed(5)
    start = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(3)]

    def run(backend):
        monkeypatch.setenv("HF_OPTIM_BACKEND", backend)
        params = [torch.nn.Parameter(t.cuda()) for t in start]
        opt = hf_optim.AdamW4bitRank1(params, lr=1e-2)
        for step in grads:
            for p, g in zip(params, step):
                p.grad = g.cuda()
            opt.step()
        return opt, params

    monkeypatch.setattr(fast_paths, "_told_no_triton", set())
    told: list[str] = []
    monkeypatch.setattr(fast_paths.logger, "warning", lambda message, *args: told.append(message % args))
    ref_opt, ref = run("torch")
    assert told == []
    opt, got = run("triton")
    assert "backend=triton" in repr(opt)
    assert len(told) == 1 and "'rank1_4bit'" in told[0] and "cuda" in told[0]
    for p, q in zip(ref, got):
        assert torch.equal(p, q)
    for key, value in ref_opt.state[ref[0]].items():
        other = opt.state[got[0]][key]
        assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, key
