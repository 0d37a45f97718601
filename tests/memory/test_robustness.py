"""Edge cases: non-finite gradients, tensor sizes, hyperparameter validation, lazy state, paged on CPU."""

import warnings

import pytest
import torch
from helpers import ALL_CLASSES, EIGHT_BIT, make_params, run_steps, set_grads

import hf_optim
from hf_optim.formats.quant8 import num_blocks

ELEMENTWISE_8BIT = [hf_optim.AdamW8bit, hf_optim.AdEMAMix8bit, hf_optim.Lion8bit, hf_optim.RMSprop8bit,
                    hf_optim.LAMB8bit]


def quiet(cls, params, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(params, **kwargs)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("cls", ELEMENTWISE_8BIT + [hf_optim.AdamW, hf_optim.Adafactor], ids=lambda c: getattr(
    c, "__name__", c))
def test_non_finite_gradient_is_skipped_and_never_poisons_state(cls, bad):
    kwargs = {"beta1": 0.9, "optim_bits": 8} if cls is hf_optim.Adafactor else {}
    clean, dirty = make_params([(40, 100)]), make_params([(40, 100)])
    clean_opt, dirty_opt = quiet(cls, clean, **kwargs), quiet(cls, dirty, **kwargs)
    run_steps(clean_opt, clean, 3), run_steps(dirty_opt, dirty, 3)

    set_grads(dirty, 3)
    before = dirty[0].detach().clone()
    dirty[0].grad[7, 3] = bad  # element 703, block 2
    dirty_opt.step()
    assert dirty[0][7, 3] == before[7, 3], "the element with a bad gradient must not move"
    for value in dirty_opt.state[dirty[0]].values():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            assert torch.isfinite(value).all()
    assert torch.isfinite(dirty[0]).all()

    run_steps(dirty_opt, dirty, 5, start=4)
    assert torch.isfinite(dirty[0]).all()
    if cls is not hf_optim.Adafactor and cls is not hf_optim.LAMB8bit:  # elementwise: other blocks untouched
        set_grads(clean, 3)
        clean_opt.step()
        run_steps(clean_opt, clean, 5, start=4)
        untouched = torch.ones(4000, dtype=torch.bool)
        untouched[512:768] = False
        assert torch.equal(clean[0].detach().view(-1)[untouched], dirty[0].detach().view(-1)[untouched])


@pytest.mark.parametrize("cls", ALL_CLASSES, ids=lambda c: c.__name__)
def test_all_tensor_sizes(cls):
    shapes = [(), (0,), (3, 0), (1,), (255,), (4095,), (4096,), (4097,), (64, 65)]
    params = make_params(shapes)
    opt = quiet(cls, params)
    start = [p.detach().clone() for p in params]
    run_steps(opt, params, 3)
    for p, p0 in zip(params, start):
        assert torch.isfinite(p).all()
        if p.numel():
            assert not torch.equal(p, p0), f"shape {tuple(p.shape)} did not train"
    if cls in EIGHT_BIT and cls is not hf_optim.Adafactor:
        for p in params:
            dtype = opt.state[p]["state1"].dtype
            assert dtype == (torch.uint8 if p.numel() >= 4096 else torch.float32), tuple(p.shape)
            if dtype == torch.uint8:
                assert opt.state[p]["absmax1"].shape[-1] == num_blocks(p.numel())


def test_min_8bit_size_is_honoured():
    params = make_params([(100,), (50,)])
    opt = hf_optim.AdamW8bit(params, min_8bit_size=100)
    run_steps(opt, params, 1)
    assert opt.state[params[0]]["state1"].dtype == torch.uint8
    assert opt.state[params[1]]["state1"].dtype == torch.float32


def test_param_group_can_keep_32bit_state():
    """The Trainer keeps embeddings in 32-bit state under 8-bit optimizers: a per-group optim_bits does it."""
    embedding, linear = make_params([(300, 64), (64, 64)])
    opt = hf_optim.AdamW8bit([{"params": [embedding], "optim_bits": 32}, {"params": [linear]}])
    run_steps(opt, [embedding, linear], 1)
    assert opt.state[embedding]["state1"].dtype == torch.float32
    assert opt.state[linear]["state1"].dtype == torch.uint8


def test_state_is_created_lazily_on_the_parameters_device():
    params = make_params([(80, 70)])
    opt = hf_optim.AdamW8bit(params)
    assert len(opt.state) == 0
    opt.step()  # no gradients yet: nothing happens
    assert len(opt.state) == 0
    run_steps(opt, params, 1)
    assert opt.state[params[0]]["state1"].device == params[0].device


class FakeDTensor(torch.nn.Parameter):
    """Stands in for a DTensor: the optimizer must compute on ``to_local()``, here a smaller shard."""

    def to_local(self):
        return self._shard


def test_optimizer_computes_on_the_local_shard():
    full = FakeDTensor(torch.zeros(8, 100))
    full._shard = torch.randn(4, 100)
    full.grad = FakeDTensor(torch.zeros(8, 100))
    full.grad._shard = torch.randn(4, 100)
    opt = hf_optim.AdamW([full])
    before = full._shard.clone()
    opt.step()
    assert opt.state[full]["state1"].shape == (4, 100)
    assert not torch.equal(full._shard, before)


def test_parameters_without_gradients_and_frozen_ones_are_left_alone():
    trained, frozen = make_params([(10, 10), (10, 10)])
    frozen.requires_grad_(False)
    opt = hf_optim.AdamW8bit([trained, frozen])
    before = frozen.detach().clone()
    trained.grad = torch.randn(10, 10)
    opt.step()
    assert torch.equal(frozen, before) and frozen not in opt.state


def test_sparse_gradients_and_complex_parameters_are_refused():
    p = torch.nn.Parameter(torch.randn(10, 3))
    p.grad = torch.randn(10, 3).to_sparse()
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        hf_optim.AdamW([p]).step()
    c = torch.nn.Parameter(torch.randn(4, dtype=torch.complex64))
    c.grad = torch.randn(4, dtype=torch.complex64)
    with pytest.raises(RuntimeError, match="does not support complex parameters"):
        hf_optim.AdamW([c]).step()


@pytest.mark.parametrize(
    "cls,kwargs,message",
    [
        (hf_optim.AdamW, {"lr": -1e-3}, "Invalid learning rate: -0.001"),
        (hf_optim.AdamW, {"lr": float("nan")}, "Invalid learning rate: nan"),
        (hf_optim.AdamW, {"lr": "1e-3"}, "lr must be a real number, got '1e-3'"),
        (hf_optim.AdamW, {"betas": (0.9, 1.0)},
         "Invalid beta parameter at index 1: 1.0 \\(beta2\\); expected a value in \\[0.0, 1.0\\)"),
        (hf_optim.AdamW, {"betas": (-0.1, 0.9)}, "Invalid beta parameter at index 0: -0.1"),
        (hf_optim.AdamW, {"betas": (0.9,)}, "betas must be a tuple of 2 floats"),
        (hf_optim.AdamW, {"eps": 0.0}, "Invalid epsilon value: 0.0"),
        (hf_optim.AdamW, {"weight_decay": -0.1}, "Invalid weight_decay value: -0.1"),
        (hf_optim.AdamW, {"optim_bits": 16}, "Invalid optim_bits: 16; expected 4, 8 or 32"),
        (hf_optim.AdamW, {"min_8bit_size": -1}, "Invalid min_8bit_size: -1"),
        (hf_optim.AdamW, {"amsgrad": True}, "amsgrad=True is not supported"),
        (hf_optim.AdamW8bit, {"optim_bits": 4}, "Invalid optim_bits: 4; AdamW8bit keeps 8-bit state"),
        (hf_optim.AdEMAMix, {"betas": (0.9, 0.999)}, "betas must be a tuple of 3 floats"),
        (hf_optim.AdEMAMix, {"t_alpha": 0}, "Invalid t_alpha: 0"),
        (hf_optim.AdEMAMix, {"alpha": -1.0}, "Invalid alpha: -1.0"),
        (hf_optim.LAMB, {"max_trust_ratio": 0.0}, "Invalid max_trust_ratio: 0.0"),
        (hf_optim.RMSprop, {"alpha": 1.5}, "Invalid alpha value: 1.5"),
        (hf_optim.RMSprop, {"momentum": 0.9}, "Invalid momentum value: 0.9; hf_optim's RMSprop supports only"),
        (hf_optim.RMSprop, {"percentile_clipping": 5}, "percentile_clipping=5 is not supported"),
        (hf_optim.Lion, {"betas": (0.9, 2.0)}, "Invalid beta parameter at index 1: 2.0"),
        (hf_optim.Adafactor, {"lr": 1e-3}, "Cannot combine a manual lr with relative_step=True"),
        (hf_optim.Adafactor, {"warmup_init": True, "relative_step": False, "lr": 1e-3}, "requires relative_step"),
        (hf_optim.Adafactor, {"beta1": 1.0}, "Invalid beta1: 1.0"),
        (hf_optim.Adafactor, {"eps": (1e-30,)}, "eps must be a tuple of two floats"),
    ],
)
def test_bad_hyperparameters_are_named_in_the_error(cls, kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        cls(make_params([(4,)]), **kwargs)


def test_bad_hyperparameters_in_an_added_group_are_refused():
    opt = hf_optim.AdamW(make_params([(4,)]))
    with pytest.raises(ValueError, match="Invalid learning rate: -1.0"):
        opt.add_param_group({"params": make_params([(3,)]), "lr": -1.0})


def test_repr_names_the_backend():
    assert "backend=torch" in repr(hf_optim.AdamW8bit(make_params([(4,)])))


@pytest.mark.parametrize("cls", [hf_optim.AdamW8bit, hf_optim.LAMB8bit, hf_optim.Lion32bit, hf_optim.Adafactor],
                         ids=lambda c: c.__name__)
def test_transposed_parameter_updates_like_its_contiguous_copy(cls):
    """A non-contiguous (transposed) parameter gets the update of a contiguous copy of it: exactly for elementwise
    algorithms; up to summation order for LAMB's norms and Adafactor's means, which reduce in memory order."""
    kwargs = {"beta1": 0.9, "optim_bits": 8, "lr": 1e-2, "relative_step": False} if cls is hf_optim.Adafactor else {}
    base = torch.randn(96, 80)
    transposed = torch.nn.Parameter(base.clone().t())
    contiguous = torch.nn.Parameter(base.clone().t().contiguous())
    assert not transposed.is_contiguous()
    opts = [quiet(cls, [transposed], **kwargs), quiet(cls, [contiguous], **kwargs)]
    for step in range(3):
        grad = torch.randn(80, 96, generator=torch.Generator().manual_seed(step))
        transposed.grad, contiguous.grad = grad.t().contiguous().t(), grad.clone()
        for opt in opts:
            opt.step()
    if cls in (hf_optim.LAMB8bit, hf_optim.Adafactor):
        torch.testing.assert_close(transposed.detach(), contiguous.detach(), rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(transposed.detach(), contiguous.detach())


def test_lamb_says_when_no_group_applies_the_trust_ratio():
    """apex semantics: weight_decay=0 groups skip the trust ratio, so all-zero decay would silently be Adam."""
    params = make_params([(64, 64)])
    with pytest.warns(UserWarning, match=r"weight_decay=0 and use_nvlamb=False.*runs as Adam"):
        hf_optim.LAMB8bit(params, weight_decay=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hf_optim.LAMB8bit(params, weight_decay=0.0, use_nvlamb=True)
        hf_optim.LAMB8bit([{"params": params[:1], "weight_decay": 0.01}, {"params": [], "weight_decay": 0.0}])
