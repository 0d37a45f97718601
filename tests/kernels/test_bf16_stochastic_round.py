"""bf16 stochastic rounding (``bf16_stochastic_round``): the rounding itself, its effect on training, determinism
and exact resume, and that every path (per-tensor, multi-tensor, compiled, Triton) draws the same bits."""

import io
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import make_params, set_grads

import hf_optim
from hf_optim.integrations.transformers import optimizer_cls_and_kwargs
from hf_optim.kernels.torch_path import multi_tensor
from hf_optim.numerics import rounding
from hf_optim.optim.runner import Runner

BF16_ULP_AT_ONE = 2.0**-7


def reference_bits16(counters: np.ndarray, seed: int, step: int) -> np.ndarray:
    """The random bits, written independently: numpy uint32 arithmetic (wrapping multiplies) on the two halves."""

    def mix(x):
        with np.errstate(over="ignore"):
            x = x ^ (x >> np.uint32(16))
            x = x * np.uint32(0x21F0AAAD)
            x = x ^ (x >> np.uint32(15))
            x = x * np.uint32(0x735A2D97)
            return x ^ (x >> np.uint32(15))

    k0, k1 = (np.uint32(k) for k in rounding.step_key(seed, step))
    low = (counters & 0xFFFFFFFF).astype(np.uint32)
    high = (counters >> 32).astype(np.uint32)
    return (mix(mix(low ^ k0) ^ high ^ k1) >> np.uint32(16)).astype(np.int64)


def test_random_bits_match_an_independent_uint32_implementation():
    counters = np.concatenate([np.arange(1000), (5 << 32) + np.arange(2**32 - 500, 2**32)]).astype(np.int64)
    for seed, step in [(0, 1), (123, 10**6), (2**32 - 1, 2**33 + 7)]:
        bits = rounding.random_bits16(torch.from_numpy(counters), rounding.key_tensor(seed, step))
        np.testing.assert_array_equal(bits.numpy(), reference_bits16(counters, seed, step))


def neighbours(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values just toward zero and just away from zero of fp32 ``values`` (truncation and its successor)."""
    bits = values.view(torch.int32)
    low = (bits & -65536).view(torch.float32)
    high = ((bits & -65536) + 65536).view(torch.float32)
    return low, high


def test_rounds_to_a_neighbour_and_keeps_exact_and_special_values():
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(10_000, generator=gen) * torch.logspace(-20, 20, 10_000)
    out = rounding.round_to_bf16(values, torch.arange(values.numel()), rounding.key_tensor(0, 1)).float()
    low, high = neighbours(values)
    assert bool(((out == low) | (out == high)).all())
    assert 0.3 < float((out == high).float().mean()) < 0.7  # both directions occur

    exact = torch.tensor([0.0, -0.0, 1.0, -2.5, 3.0e38, float("inf"), -float("inf"), 1e-40]).bfloat16().float()
    again = rounding.round_to_bf16(exact, torch.arange(exact.numel()), rounding.key_tensor(5, 9)).float()
    assert torch.equal(again.view(torch.int32), exact.view(torch.int32))  # signs of zero included
    nan = rounding.round_to_bf16(torch.tensor([float("nan")]), torch.arange(1), rounding.key_tensor(0, 1))
    assert bool(nan.isnan().all())


@pytest.mark.parametrize("fraction", [0.01, 0.3, 0.5, 0.9])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_unbiased(fraction, sign):
    """The mean of 2^16 roundings of a value between two bf16 neighbours is the value. The bits are a fixed
    function of seed and counters, so this cannot flake; the bound is 8 standard deviations of the mean."""
    n = 1 << 16
    value = sign * (1.0 + fraction * BF16_ULP_AT_ONE)
    values = torch.full((n,), value, dtype=torch.float32)
    out = rounding.round_to_bf16(values, (3 << 32) + torch.arange(n), rounding.key_tensor(11, 42)).double()
    sigma = BF16_ULP_AT_ONE * (fraction * (1 - fraction) / n) ** 0.5
    assert abs(float(out.mean()) - value) < 8 * sigma
    assert set(out.unique().tolist()) == {sign * 1.0, sign * (1.0 + BF16_ULP_AT_ONE)}


STEPS = 400
LR = 2.5e-4  # 3% of a bf16 ulp at 1.0: round-to-nearest drops every update


@pytest.mark.parametrize(
    "cls,kwargs",
    [(hf_optim.Lion8bit, dict(weight_decay=0.0, min_8bit_size=0)),
     (hf_optim.AdamW8bit, dict(weight_decay=0.0, min_8bit_size=0)), (hf_optim.AdamW32bit, dict(weight_decay=0.0))],
    ids=["Lion8bit", "AdamW8bit", "AdamW32bit"],
)
def test_updates_below_bf16_resolution_accumulate(cls, kwargs, monkeypatch):
    """400 steps of about lr = 2.5e-4 each on weights at 1.0: fp32 weights move by about 0.1; bf16 weights rounded
    to nearest never move; rounded stochastically they follow the fp32 weights in expectation."""
    monkeypatch.setenv("HF_OPTIM_COMPILE", "0")  # many small steps: eager is faster than a first compilation
    n = 2048
    runs = {}
    for name, dtype, stochastic in [("fp32", torch.float32, False), ("nearest", torch.bfloat16, False),
                                    ("stochastic", torch.bfloat16, True)]:
        param = torch.nn.Parameter(torch.ones(n, dtype=dtype))
        opt = cls([param], lr=LR, bf16_stochastic_round=stochastic, **kwargs)
        for _ in range(STEPS):
            param.grad = torch.full((n,), -1.0, dtype=dtype)  # a constant push upwards
            opt.step()
        runs[name] = param.detach().double()
    moved = float(runs["fp32"].mean()) - 1.0
    assert 0.05 < moved < 0.15
    assert bool((runs["nearest"] == 1.0).all())
    # Each step's rounding error has mean 0 and std <= ulp/2, independent across steps and elements: the mean
    # over 2048 weights after 400 steps has std <= ulp/2 * sqrt(400/2048) = 0.0017; 0.01 is 5.8 of those.
    assert abs(float(runs["stochastic"].mean()) - float(runs["fp32"].mean())) < 0.01
    assert float(runs["stochastic"].std()) > 0  # weights moved by different amounts: rounding, not a shift


def test_fp32_parameters_are_unaffected_and_float16_refused():
    results = []
    for stochastic in (False, True):
        params = make_params([(300,), (64, 80)])
        opt = hf_optim.AdamW8bit(params, lr=1e-2, bf16_stochastic_round=stochastic)
        set_grads(params, 0)
        opt.step()
        results.append([p.detach().clone() for p in params])
    assert all(torch.equal(a, b) for a, b in zip(*results))

    half = torch.nn.Parameter(torch.ones(10, dtype=torch.float16))
    bf16 = torch.nn.Parameter(torch.ones(10, dtype=torch.bfloat16))
    opt = hf_optim.Lion32bit([bf16, half], bf16_stochastic_round=True)
    bf16.grad, half.grad = torch.ones_like(bf16), torch.ones_like(half)
    with pytest.raises(ValueError, match="parameter 1 of param group 0 is float16"):
        opt.step()
    assert bool((bf16 == 1.0).all())  # a refused step changes nothing
    # the same float16 parameter in a group without the option trains as before
    opt = hf_optim.Lion32bit([{"params": [bf16], "bf16_stochastic_round": True}, {"params": [half]}])
    opt.step()


def test_bad_values_are_refused():
    param = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="bf16_stochastic_round must be True or False, got 'yes'"):
        hf_optim.AdamW([param], bf16_stochastic_round="yes")
    with pytest.raises(ValueError, match=r"bf16_stochastic_round_seed must be an int in \[0, 2\*\*32\), got -1"):
        hf_optim.AdamW([{"params": [param], "bf16_stochastic_round_seed": -1}])


def bf16_params():
    params = make_params([(64, 80), (5000,), (300,), (0,), (16, 200), (4097,), (9000,), (7,)], seed=3)
    # mostly bf16, a few fp32 (a mixed group: the fp32 ones round to nearest as always)
    return [torch.nn.Parameter(p.detach().to(torch.bfloat16)) if i % 4 != 2 else p for i, p in enumerate(params)]


def train(cls, kwargs, steps, params=None, opt=None, start=0):
    params = bf16_params() if params is None else params
    opt = cls(params, bf16_stochastic_round=True, **kwargs) if opt is None else opt
    for step in range(start, start + steps):
        set_grads(params, step, scale=1e-2)
        opt.step()
    return params, opt


def assert_same_bits(a, b):
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and torch.equal(x.detach(), y.detach())


RESUME_CASES = [
    (hf_optim.AdamW8bit, dict(lr=1e-3)),
    (hf_optim.Lion32bit, dict(lr=1e-4)),
    (hf_optim.LAMB8bit, dict(lr=1e-3)),
    (hf_optim.Adafactor, dict(lr=1e-3, relative_step=False, beta1=0.9, optim_bits=8)),
]


@pytest.mark.parametrize("cls,kwargs", RESUME_CASES, ids=[c.__name__ for c, _ in RESUME_CASES])
def test_deterministic_and_exact_resume(cls, kwargs, monkeypatch):
    """Same seed, same bits; a run resumed from a saved state dict (weights_only) after 3 steps equals the
    uninterrupted 6-step run bit for bit, whatever else consumed torch's global generator in between."""
    monkeypatch.setenv("HF_OPTIM_COMPILE", "0")
    straight, _ = train(cls, kwargs, 6)
    again, _ = train(cls, kwargs, 6)
    assert_same_bits(straight, again)

    params, opt = train(cls, kwargs, 3)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    torch.rand(1000)  # dropout and the Trainer draw from the global generator: the rounding must not care
    fresh = cls(params, **kwargs)  # option and seed come back from the state dict's param group
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    assert fresh.param_groups[0]["bf16_stochastic_round"] is True
    resumed, _ = train(cls, kwargs, 3, params=params, opt=fresh, start=3)
    assert_same_bits(straight, resumed)

    other_seed = bf16_params()
    opt = cls([{"params": other_seed, "bf16_stochastic_round_seed": 1}], bf16_stochastic_round=True, **kwargs)
    train(cls, kwargs, 6, params=other_seed, opt=opt)
    assert not all(torch.equal(a, b) for a, b in zip(straight, other_seed) if a.dtype == torch.bfloat16)


PATH_CASES = [
    (hf_optim.AdamW8bit, dict(lr=1e-3)),
    (hf_optim.AdEMAMix32bit, dict(lr=1e-3)),
    (hf_optim.LAMB8bit, dict(lr=1e-2)),
]


@pytest.mark.parametrize("cls,kwargs", PATH_CASES, ids=[c.__name__ for c, _ in PATH_CASES])
def test_multi_tensor_path_draws_the_per_tensor_bits(cls, kwargs, monkeypatch):
    """Tensors gathered into multi-tensor chunks (and updated in place chunk by chunk) get the bits of their own
    element indices: the result equals the per-tensor path's bit for bit."""
    monkeypatch.setattr(multi_tensor, "CHUNK", 2048)
    monkeypatch.setattr(multi_tensor, "IN_PLACE_MIN", 4096)
    monkeypatch.setenv("HF_OPTIM_COMPILE", "0")
    with monkeypatch.context() as per_tensor:
        per_tensor.setattr(Runner, "on_multi_tensor_path", lambda self, full, param: False)
        reference, _ = train(cls, kwargs, 3)
    candidate, opt = train(cls, kwargs, 3)
    assert any(opt._store.locate(p, opt.state[p]) for p in candidate if p.numel())  # the flat path ran
    assert_same_bits(reference, candidate)


@pytest.mark.slow
def test_compiled_update_draws_the_eager_bits(monkeypatch):
    monkeypatch.setattr(multi_tensor, "CHUNK", 2048)
    monkeypatch.setattr(multi_tensor, "IN_PLACE_MIN", 4096)
    monkeypatch.setenv("HF_OPTIM_COMPILE", "0")
    reference, _ = train(hf_optim.AdamW8bit, dict(lr=1e-3), 2)
    monkeypatch.setenv("HF_OPTIM_COMPILE", "1")
    candidate, _ = train(hf_optim.AdamW8bit, dict(lr=1e-3), 2)
    assert_same_bits(reference, candidate)


def test_trainer_optim_args_turn_it_on():
    args = SimpleNamespace(learning_rate=1e-5, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
                           optim_args="bf16_stochastic_round=true")
    cls, kwargs = optimizer_cls_and_kwargs(args, name="paged_adamw_8bit")
    assert kwargs["bf16_stochastic_round"] is True
    opt = cls([torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))], **kwargs)
    assert opt.param_groups[0]["bf16_stochastic_round"] is True


# ------------------------------------------------------------------------------------------------------------
# The Triton twin (in Triton's interpreter on CPU)
triton = pytest.importorskip("triton")
ON_GPU = torch.cuda.is_available()


@pytest.mark.skipif(ON_GPU, reason="the interpreter comparison runs on CPU machines")
def test_triton_twin_rounds_bit_for_bit():
    from hf_optim.kernels.triton_path import rounding as triton_rounding

    gen = torch.Generator().manual_seed(1)
    values = torch.randn(3000, generator=gen) * torch.logspace(-30, 30, 3000)
    values[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
    for ordinal, start, seed, step in [(0, 0, 0, 1), (7, 123_456, 99, 2**35 + 3)]:
        key = rounding.key_tensor(seed, step)
        counters = (ordinal << 32) + start + torch.arange(values.numel())
        expected = rounding.round_to_bf16(values, counters, key)
        got = triton_rounding.round_to_bf16(values, ordinal, key, start=start)
        assert torch.equal(expected.view(torch.int16), got.view(torch.int16))


TRITON_CASES = [
    (hf_optim.AdamW8bit, dict(lr=1e-3)),
    (hf_optim.LAMB32bit, dict(lr=1e-2)),
    (hf_optim.Adafactor, dict(lr=1e-2, relative_step=False, beta1=0.9)),
]


@pytest.mark.skipif(ON_GPU, reason="the interpreter comparison runs on CPU machines")
@pytest.mark.parametrize("cls,kwargs", TRITON_CASES, ids=[c.__name__ for c, _ in TRITON_CASES])
def test_triton_kernels_draw_the_pytorch_bits(cls, kwargs, monkeypatch):
    """The fused elementwise kernel, LAMB's apply pass and Adafactor's apply pass store the same bf16 bits as the
    PyTorch path (the fp32 results agree exactly in the interpreter; on a GPU an fp32 result one ulp apart can
    flip a rounding decision)."""
    monkeypatch.setenv("HF_OPTIM_COMPILE", "0")
    reference, _ = train(cls, kwargs, 2)
    monkeypatch.setenv("HF_OPTIM_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    candidate, _ = train(cls, kwargs, 2)
    pairs = [(a.detach(), b.detach()) for a, b in zip(reference, candidate) if a.dtype == torch.bfloat16]
    if cls is not hf_optim.LAMB32bit:
        assert all(torch.equal(a, b) for a, b in pairs)
        return
    # LAMB's Triton norms sum in another order: its fp32 results differ in the last bits, which flips a rounding
    # decision now and then (by one bf16 ulp), as it flips a round-to-nearest one without the option.
    distance = torch.cat([(a.view(torch.int16).long() - b.view(torch.int16).long()).abs().flatten() for a, b in pairs])
    assert int(distance.max()) <= 1 and float((distance > 0).float().mean()) < 0.01


@pytest.mark.parametrize("name", ["llama-3.2-1b-full", "llama-3.2-1b-full-muon", "llama-3.2-3b-full",
                                  "llama-3.1-8b-full"])
def test_full_recipes_turn_it_on(name):
    """The full recipes train bf16 weights at lr 1e-5..2e-5, where rounding to nearest drops most updates
    (docs/bf16_stochastic_rounding.md): they pass the option through optim_args, and its key is validated."""
    from hf_optim.integrations.names import OPTIMIZER_NAMES
    from hf_optim.integrations.optim_args import parse_optim_args, typed_optim_args
    from hf_optim.recipes import RecipeError, load_recipe

    training = load_recipe(name).training
    assert typed_optim_args(OPTIMIZER_NAMES[training["optim"]], parse_optim_args(training["optim_args"])) == {
        "bf16_stochastic_round": True}
    with pytest.raises(RecipeError, match="'bf16_stochastic_rnd' is not valid.*did you mean 'bf16_stochastic_round'"):
        load_recipe(name, ["training.optim_args=bf16_stochastic_rnd=true"])


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_triton_on_cuda_matches_the_pytorch_path(monkeypatch):
    """On a GPU: the standalone rounding kernel bit for bit, and AdamW8bit's fused kernel against the PyTorch path
    on the same device (compiled fp32 arithmetic may differ in the last bit, flipping a rare rounding decision)."""
    from hf_optim.kernels.triton_path import rounding as triton_rounding

    values = torch.randn(100_000, device="cuda") * 1e-3
    key = rounding.key_tensor(3, 17)
    counters = (2 << 32) + torch.arange(values.numel(), device="cuda")
    assert torch.equal(rounding.round_to_bf16(values, counters, key.cuda()).view(torch.int16),
                       triton_rounding.round_to_bf16(values, 2, key).view(torch.int16))

    def run(backend):
        monkeypatch.setenv("HF_OPTIM_BACKEND", backend)
        params = [torch.nn.Parameter(p.detach().cuda()) for p in bf16_params()]
        opt = hf_optim.AdamW8bit(params, lr=1e-3, bf16_stochastic_round=True)
        for step in range(3):
            gen = torch.Generator().manual_seed(step)
            for p in params:
                p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(p.dtype).cuda()
            opt.step()
        return [p.detach() for p in params if p.dtype == torch.bfloat16]

    distance = torch.cat([(a.view(torch.int16).long() - b.view(torch.int16).long()).abs().flatten()
                          for a, b in zip(run("torch"), run("triton"))])
    assert int(distance.max()) <= 1 and float((distance > 0).float().mean()) < 0.01
