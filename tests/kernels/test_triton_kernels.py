"""The Triton kernels against their PyTorch twins.

On a machine without CUDA the kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``, set by
conftest.py before anything imports triton) on small tensors; on a GPU machine the same comparisons run on CUDA
tensors (the ``gpu``-marked cases) and the CPU cases are skipped.
"""

import warnings

import pytest
import torch

import hf_optim

triton = pytest.importorskip("triton")

ON_GPU = torch.cuda.is_available()
from helpers import assert_bit_identical, assert_params_close, ulp_distance  # noqa: E402

from hf_optim.formats import quant8 as blockwise  # noqa: E402
from hf_optim.formats.dynamic_map import dynamic_map, encoder_table  # noqa: E402
from hf_optim.kernels import backend  # noqa: E402
from hf_optim.kernels.triton_path import quant8 as triton_blockwise  # noqa: E402

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(ON_GPU, reason="GPU machine: the cuda cases run the kernels")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]


# --------------------------------------------------------------------------------------------------------------
# Blockwise quantization
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("signed", [True, False])
def test_quantize_and_dequantize_match_pytorch(device, signed):
    gen = torch.Generator().manual_seed(1)
    n = 1000  # not a multiple of 256: the last block is partial
    values = torch.randn(2, n, generator=gen) * torch.logspace(-9, 0, n)  # magnitudes down below the map's range
    if not signed:
        values = values.abs()
    values[0, 5] = -0.0
    values[1, 256:512] = 0.0  # an all-zero block
    values[0, 700] = values[0, 768:1000].abs().max()  # an exact tie for the block maximum
    values = values.to(device)
    codes, absmax = triton_blockwise.quantize(values, signed)
    ref_codes, ref_absmax = blockwise.quantize(values, encoder_table(signed, device), signed)
    assert torch.equal(codes, ref_codes)
    assert torch.equal(absmax, ref_absmax)
    qmap = dynamic_map(signed, device)
    assert torch.equal(triton_blockwise.dequantize(codes, absmax, qmap), blockwise.dequantize(codes, absmax, qmap))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("signed", [True, False])
def test_encoder_midpoints_ties_and_sign_fix(device, signed):
    """Every exact midpoint between two codes (a tie: toward zero), its fp32 neighbours, every map value and
    tiny negatives (never +0): the Triton encoder picks the PyTorch encoder's code for each."""
    qmap = dynamic_map(signed)
    mids = (qmap[1:] + qmap[:-1]) * 0.5
    up, down = torch.nextafter(mids, torch.tensor(2.0)), torch.nextafter(mids, torch.tensor(-2.0))
    probes = torch.cat([mids, up, down, qmap, torch.tensor([-1e-30, -0.0, 0.0, 1e-30, -1e-7, 1.0, -1.0])])
    normalized = probes.clamp(-1.0 if signed else 0.0, 1.0).view(1, -1).to(device)
    codes = triton_blockwise.quantize(normalized, signed)[0]
    assert torch.equal(codes, blockwise.quantize(normalized, encoder_table(signed, device), signed)[0])
    if signed:  # -1e-30 and -0.0 take the smallest negative code, not +0
        assert torch.equal(codes[0, -7:-5], torch.tensor([126, 126], dtype=torch.uint8, device=device))


# --------------------------------------------------------------------------------------------------------------
# Fused optimizer updates
CASES = [
    (hf_optim.AdamW, {}),
    (hf_optim.AdEMAMix, {"t_alpha": 4, "t_beta3": 4}),
    (hf_optim.Lion, {"weight_decay": 0.1}),
    (hf_optim.RMSprop, {"weight_decay": 0.01}),
    (hf_optim.LAMB, {"max_trust_ratio": 10.0}),
    (hf_optim.LAMB, {"weight_decay": 0.0, "adam_w_mode": False}),
    (hf_optim.LAMB, {"weight_decay": 0.0, "max_unorm": 0.5}),  # bitsandbytes' update-norm clip, binding
]
# Several tensors in one launch: sizes not divisible by 256, one below min_8bit_size (fp32 state in an 8-bit
# optimizer), a 0-d tensor, and fp32 / bf16 / fp16 parameters.
SHAPES = [(64, 80), (300,), (5000,), (70, 73), ()]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float32, torch.float32]


def make_problem(device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dt).to(device)) for s, dt in zip(SHAPES, DTYPES)]


def set_grads(params, step, non_finite):
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        grad = torch.randn(p.shape, generator=gen)
        if non_finite and grad.numel() > 1:
            flat = grad.view(-1)
            flat[::97] = float("nan")
            flat[5::131] = float("inf")
            flat[9::151] = -float("inf")
        p.grad = grad.to(p.dtype).to(p.device)


def run(cls, kwargs, params, backend_name, monkeypatch, steps=2):
    monkeypatch.setenv("HF_OPTIM_BACKEND", backend_name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = cls(params, **kwargs)
    for step in range(steps):
        set_grads(params, step, non_finite=step == 1)
        opt.step()
    return opt


def assert_same_state(ref_opt, ref_params, opt, params, exact_codes, steps=2, state_ulps=0):
    """Parameters within an ulp per step; fp32 state within ``state_ulps`` (0 on the CPU interpreter, unless
    the state reads the parameter, like RMSprop's L2 term, and inherits its last-bit difference); 8-bit codes and
    absmax identical on the CPU interpreter, and on a GPU identical but for rare one-code steps where an ulp
    moves a value across a midpoint (or a block's absmax by an ulp)."""
    for ref_p, p in zip(ref_params, params):
        where = f"{tuple(p.shape)} {p.dtype}"
        assert_params_close(p, ref_p, where, steps)
        ref_state, state = ref_opt.state[ref_p], opt.state[p]
        assert ref_state.keys() == state.keys()
        for key, ref in ref_state.items():
            value = state[key]
            if not isinstance(ref, torch.Tensor):
                assert value == ref
                continue
            assert value.dtype == ref.dtype and value.shape == ref.shape
            if ref.element_size() == 1 and ref.dtype != torch.uint8:  # float8 codes (fp8): compared as their bytes
                value, ref = value.view(torch.uint8), ref.view(torch.uint8)
            if key.startswith("qmap") or (exact_codes and (ref.dtype == torch.uint8 or key.startswith("absmax"))):
                assert torch.equal(value, ref), f"{where}: {key} differs"
            elif ref.dtype == torch.uint8:
                steps_apart = (value.int() - ref.int()).abs()
                assert steps_apart.max() <= 1 and (steps_apart > 0).float().mean() < 1e-3, f"{where}: {key}"
            else:
                assert ulp_distance(value, ref) <= state_ulps, f"{where}: {key} more than {state_ulps} ulp apart"


# Every configuration of the fused kernel, in the interpreter, bit for bit. Each case runs one optimizer over
# three parameter dtypes, with min_8bit_size lowered so that small tensors cover every kind of program: a quantized
# tensor with whole tiles and a partial one (2500 elements, an all-zero block, parameters at exactly 0 there), an
# fp32-state tensor with a whole tile and a short partial one (1030 elements) and a 0-d one; a second param group
# rounds its bf16 parameters stochastically. Two steps, the second with NaN/+-Inf gradients.
MIN_8BIT = 1500
CONFIG_SHAPES = [(50, 50), (1030,), ()]
CONFIG_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ZERO_BLOCK = slice(256, 512)  # of the first shape: zero parameters and gradients keep a block of zero state


def config_problem(device):
    gen = torch.Generator().manual_seed(0)
    plain = [torch.nn.Parameter(torch.randn(shape, generator=gen).to(dtype).to(device))
             for dtype in CONFIG_DTYPES for shape in CONFIG_SHAPES]
    rounded = [torch.nn.Parameter(torch.randn(shape, generator=gen).to(torch.bfloat16).to(device))
               for shape in CONFIG_SHAPES]
    for p in (plain[0], plain[3], plain[6], rounded[0]):
        p.data.view(-1)[ZERO_BLOCK] = 0.0
    return plain, rounded


def config_grads(params, step):
    set_grads(params, step, non_finite=step == 1)
    for p in params:
        if p.dim() == 2:
            p.grad.view(-1)[ZERO_BLOCK] = 0.0


def run_config_case(cls, kwargs, device, backend_name, monkeypatch, steps=2):
    monkeypatch.setenv("HF_OPTIM_BACKEND", backend_name)
    plain, rounded = config_problem(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = cls([{"params": plain}, {"params": rounded, "bf16_stochastic_round": True}], min_8bit_size=MIN_8BIT,
                  **kwargs)
    for step in range(steps):
        config_grads(plain + rounded, step)
        opt.step()
    return opt, plain + rounded


CONFIG_CASES = [
    (hf_optim.AdamW, {}),
    (hf_optim.AdEMAMix, {"t_alpha": 4, "t_beta3": 4}),
    (hf_optim.Lion, {"weight_decay": 0.1}),
    (hf_optim.RMSprop, {"weight_decay": 0.01}),
    (hf_optim.LAMB, {"max_trust_ratio": 10.0}),
]
FORMAT_CASES = [
    pytest.param(cls, kwargs, fmt.name, id=f"{cls.__name__}-{fmt.class_suffix}")
    for cls, kwargs in CONFIG_CASES for fmt in cls._supported_formats()
] + [pytest.param(hf_optim.LAMB, {"weight_decay": 0.0, "adam_w_mode": False}, "blockwise8", id="LAMB-L2-8bit")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cls,kwargs,state_format", FORMAT_CASES)
def test_fused_update_matches_pytorch(cls, kwargs, state_format, device, monkeypatch, use_triton, launched,
                                      cuda_scalars):
    """Every fused-kernel configuration of the algorithm with this state format (fp32 / bf16 / fp16 parameters,
    quantized and fp32 state, whole and partial tiles, bf16 stochastic rounding) against the PyTorch path (its
    rules dividing by scalars as torch does on CUDA, see :class:`CudaScalar`): codes, absmax, fp32 state and
    parameters bit for bit in the interpreter (LAMB's parameters: its norms sum in another order, within an ulp);
    on a GPU, within an ulp and a rare one-code step."""
    kwargs = {**kwargs, "state_format": state_format}
    ref_opt, ref_params = run_config_case(cls, kwargs, device, "torch", monkeypatch)
    opt, params = run_config_case(cls, kwargs, device, "triton", monkeypatch)
    assert "backend=triton" in repr(opt)
    quantized = [opt.state[p]["state1"].element_size() == 1 for p in params]  # uint8 codes, float8 for fp8
    assert quantized == [state_format != "fp32" and p.numel() >= MIN_8BIT for p in params]
    lamb = cls is hf_optim.LAMB
    if device == "cpu":
        assert_bit_identical(ref_opt, ref_params, opt, params, exact_params=not lamb)
    else:
        assert_same_state(ref_opt, ref_params, opt, params, exact_codes=False, state_ulps=1)

    # every configuration this optimizer launches was exercised
    from hf_optim.kernels.triton_path.configs import fused_configs

    algorithm = cls.definition
    expected = {(c.param_dtype, c.formats, c.full, c.stochastic) for c in fused_configs(algorithm, (state_format,))}
    seen = {(c.param_dtype, c.formats, c.full, c.stochastic) for c in launched}
    assert seen == expected
    # whole tiles use vector accesses: only AdEMAMix's stacked second row can start off a 16-byte boundary (n values
    # in: 2500 codes, 1250 bytes of 4-bit codes, 1030 fp32 values), and those tensors get launches of their own
    if cls is not hf_optim.AdEMAMix:
        assert [c.label for c in launched if not c.aligned] == []
    assert all(c.grad_dtype == c.param_dtype for c in launched)


@pytest.mark.parametrize("device", DEVICES)
def test_launches_per_kernel_group_and_step_counter(device, monkeypatch, use_triton, launched):
    """A group's tensors go in one launch per kind of tile and configuration, never one per tensor: an 8-bit
    AdamW over fp32 / bf16 / fp16 tensors launches, per dtype, its quantized tensors' whole and partial tiles and its
    fp32-state tensors' whole and partial tiles. A tensor whose step counter lags (it had no gradient) gets launches
    of its own with its own bias corrections, and still matches the PyTorch path."""
    ref_params, params = make_problem(device), make_problem(device)
    opts = []
    first = 0
    for backend_name, ps in (("torch", ref_params), ("triton", params)):
        monkeypatch.setenv("HF_OPTIM_BACKEND", backend_name)
        opt = hf_optim.AdamW8bit(ps)
        set_grads(ps, 0, non_finite=False)
        ps[1].grad = None  # the bf16 tensor skips the first step
        opt.step()
        first = len(launched)
        set_grads(ps, 1, non_finite=False)
        opt.step()
        opts.append(opt)
    # SHAPES/DTYPES: fp32 5120 (8-bit, whole tiles only), fp32 5110 (8-bit, both), fp32 () (fp32 state, partial),
    # fp16 5000 (8-bit, both); bf16 300 (fp32 state, partial) joins at step 2 with its own step counter
    eight, fp32 = (1, 1), (0, 0)
    step1 = sorted([(0, eight, True), (0, eight, False), (0, fp32, False), (2, eight, True), (2, eight, False)])
    assert sorted((c.param_dtype, c.formats, c.full) for c in launched[:first]) == step1
    assert sorted((c.param_dtype, c.formats, c.full) for c in launched[first:]) == sorted(step1 + [(1, fp32, False)])
    assert opts[1].state[params[1]]["step"] == 1
    assert_same_state(opts[0], ref_params, opts[1], params, exact_codes=device == "cpu", steps=2,
                      state_ulps=0 if device == "cpu" else 1)


def _fields_read(function, argument: str) -> set[str]:
    """The attributes ``function``'s source reads from its parameter ``argument``."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(getattr(function, "fn", function))))
    return {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == argument}


def test_rules_read_their_hyper_fields():
    """Each Triton rule and its PyTorch twin read only fields of the algorithm's ``hyper`` class, and every field is
    read by one of them (a field neither reads would be a scalar the description computes for nothing). The host
    function returns that class, and the kernel receives it as floats (an int would recompile per value)."""
    from hf_optim.core.algorithm import kernel_scalars
    from hf_optim.optim import registry

    with_triton = [f for f in registry.families() if f.algorithm.triton_rule is not None]
    # hf_optim's own, and any a test registered (tests/algorithms/test_custom_algorithm.py) in this process
    assert {f.algorithm.name for f in with_triton} >= {"adamw", "ademamix", "lion", "rmsprop", "lamb"}
    for family in with_triton:
        algorithm = family.algorithm
        fields = set(algorithm.hyper._fields)
        torch_reads = _fields_read(algorithm.rule, "h")
        triton_reads = _fields_read(algorithm.resolve(algorithm.triton_rule), "h")
        assert torch_reads <= fields and triton_reads <= fields, algorithm.name
        assert torch_reads | triton_reads == fields, (algorithm.name, fields - torch_reads - triton_reads)
        group = family.base([torch.zeros(1)]).param_groups[0]
        hyper = algorithm.hyper_values(group, 3)
        assert type(hyper) is algorithm.hyper
        scalars = kernel_scalars(hyper)
        assert type(scalars) is algorithm.hyper and all(type(v) is float for v in scalars)


def test_reciprocal_hyper_is_the_fp32_division():
    from hf_optim.core.algorithm import fp32_reciprocal

    for value in (0.1, 1 - 0.999**3, 0.7, 3.0):
        expected = (torch.tensor(1.0) / torch.tensor(value, dtype=torch.float32)).item()
        assert fp32_reciprocal(value) == expected


# --------------------------------------------------------------------------------------------------------------
# Dispatch
def test_backend_env_var(monkeypatch):
    opt = hf_optim.AdamW8bit([torch.nn.Parameter(torch.zeros(4))])
    monkeypatch.delenv("HF_OPTIM_BACKEND", raising=False)
    assert opt.backend in ("torch", "torch-compile")  # CPU tensors default to the PyTorch path
    monkeypatch.setenv("HF_OPTIM_BACKEND", "torch")
    assert opt.backend in ("torch", "torch-compile")
    assert "backend=torch" in repr(opt)
    monkeypatch.setenv("HF_OPTIM_BACKEND", "trition")
    with pytest.raises(ValueError, match="'trition' is not a valid backend; valid values are 'torch', 'triton'"):
        _ = opt.backend
    monkeypatch.setenv("HF_OPTIM_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        _ = opt.backend
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert opt.backend == "triton"


def test_describe_mixed_devices(monkeypatch):
    monkeypatch.delenv("HF_OPTIM_BACKEND", raising=False)
    monkeypatch.setattr(backend, "triton_available", lambda: True)
    described = backend.describe([torch.device("cpu"), torch.device("cuda", 0)])
    assert described == "torch (cpu), triton (cuda)"  # conftest: HF_OPTIM_COMPILE=0
    assert backend.describe([torch.device("cuda", 0)]) == "triton"


ADAFACTOR_SHAPES = [(64, 80), (3, 20, 70), (5000,), ()]  # factored 2-D and 3-D, unfactored, a scalar
ADAFACTOR_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kwargs", [
    {},
    {"beta1": 0.9, "optim_bits": 8, "weight_decay": 0.1, "lr": 1e-2, "relative_step": False},
    {"beta1": 0.9, "scale_parameter": False, "lr": 1e-3, "relative_step": False},
], ids=["relative-step", "8bit-beta1-decay", "32bit-beta1"])
def test_adafactor_passes_match_pytorch(kwargs, device, monkeypatch, use_triton):
    """Adafactor's Triton passes against the PyTorch path, step by step from the same state (the second step
    with NaN/Inf gradients). The row/column/RMS reductions sum in another order than torch's ``mean``/``norm``,
    so statistics agree to a few ulps, parameters within an ulp, 8-bit codes but for rare one-code steps. (From
    the second step on, such a one-code step moves the parameter by a code's width, so each step starts from the
    PyTorch path's state.)"""
    compare_adafactor(ADAFACTOR_SHAPES, ADAFACTOR_DTYPES, kwargs, device, monkeypatch)


def compare_adafactor(shapes, dtypes, kwargs, device, monkeypatch, steps=2):
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=gen).to(dt).to(device) for s, dt in zip(shapes, dtypes)]
    ref_params = [torch.nn.Parameter(t.clone()) for t in start]
    params = [torch.nn.Parameter(t.clone()) for t in start]
    monkeypatch.setenv("HF_OPTIM_BACKEND", "torch")
    ref_opt = hf_optim.Adafactor(ref_params, **kwargs)
    opt = hf_optim.Adafactor(params, **kwargs)
    for step in range(steps):
        if step:
            opt.load_state_dict(ref_opt.state_dict())
            for p, ref_p in zip(params, ref_params):
                p.data.copy_(ref_p)
        set_grads(ref_params, step, non_finite=step == 1)
        set_grads(params, step, non_finite=step == 1)
        monkeypatch.setenv("HF_OPTIM_BACKEND", "torch")
        ref_opt.step()
        monkeypatch.setenv("HF_OPTIM_BACKEND", "triton")
        opt.step()
        assert "backend=triton" in repr(opt)
        for ref_p, p in zip(ref_params, params):
            where = f"step {step}, {tuple(p.shape)} {p.dtype}"
            assert_params_close(p, ref_p, where, steps=1)
            for key, ref in ref_opt.state[ref_p].items():
                value = opt.state[p][key]
                if not isinstance(ref, torch.Tensor):
                    assert value == ref
                elif ref.dtype == torch.uint8:
                    steps_apart = (value.int() - ref.int()).abs()
                    assert steps_apart.max() <= 1 and (steps_apart > 0).float().mean() < 1e-2, f"{where}: {key}"
                else:
                    torch.testing.assert_close(value, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()),
                                               msg=f"{where}: {key}")
    return opt


ADAFACTOR_PASSES = ("_row_stats_kernel", "_col_stats_kernel", "_finalize_kernel", "_update_sq_kernel",
                    "_clip_kernel", "_apply_kernel")


@pytest.mark.parametrize("device", DEVICES)
def test_adafactor_one_launch_per_pass(device, monkeypatch, use_triton):
    """One group of Adafactor tensors of many shapes and dtypes (factored 2-D and 3-D, wider than a column block,
    1-D, a scalar, tensors below min_8bit_size with an fp32 first moment) runs each pass once per kernel group
    (parameter dtype, first-moment format) and, for the passes compiled per kind, once per kind of tensor present
    (factored, unfactored), never once per tensor, and matches the PyTorch path."""
    from collections import Counter

    from hf_optim.optim.adafactor import triton_passes as triton_adafactor

    launches = []
    for name in ADAFACTOR_PASSES:
        kernel = getattr(triton_adafactor, name)

        class Counting:
            def __getitem__(self, grid, name=name, kernel=kernel):
                launches.append(name)
                return kernel[grid]

            def warmup(self, *args, kernel=kernel, **kwargs):  # triton_guard compiles all passes first
                return kernel.warmup(*args, **kwargs)

        monkeypatch.setattr(triton_adafactor, name, Counting())
    shapes = [(64, 80), (3, 20, 70), (17, 300), (10, 30), (5000,), (7,), ()]
    dtypes = [torch.float32, torch.bfloat16, torch.bfloat16, torch.float32, torch.bfloat16, torch.float32,
              torch.float32]
    kwargs = {"beta1": 0.9, "optim_bits": 8, "weight_decay": 0.1, "lr": 1e-2, "relative_step": False}
    opt = compare_adafactor(shapes, dtypes, kwargs, device, monkeypatch)
    # kernel groups: fp32 + 8-bit m {(64, 80)}; bf16 + 8-bit m {(3, 20, 70), (17, 300), (5000,)};
    # fp32 + fp32 m {(10, 30), (7,), ()}: factored tensors in all three, unfactored ones in the last two
    per_step = {"_row_stats_kernel": 3, "_col_stats_kernel": 3, "_finalize_kernel": 5, "_update_sq_kernel": 5,
                "_clip_kernel": 3, "_apply_kernel": 5}
    assert Counter(launches) == Counter({name: 2 * count for name, count in per_step.items()})  # two steps
    eight = [opt.state[p]["exp_avg"].dtype == torch.uint8 for p in opt.param_groups[0]["params"]]
    assert eight == [True, True, True, False, True, False, False]


@pytest.mark.parametrize("device", DEVICES)
def test_adafactor_lagging_step_counter(device, monkeypatch, use_triton):
    """A tensor whose step counter lags (it had no gradient) runs the passes in its own launches, with its own
    decay ``1 - t**decay_rate`` and relative step, and still matches the PyTorch path."""
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=gen) for s in ((40, 30), (300,), (20, 50))]
    opts, all_params = [], []
    for backend_name in ("torch", "triton"):
        monkeypatch.setenv("HF_OPTIM_BACKEND", backend_name)
        params = [torch.nn.Parameter(t.clone().to(device)) for t in start]
        opt = hf_optim.Adafactor(params)
        set_grads(params, 0, non_finite=False)
        params[2].grad = None
        opt.step()
        set_grads(params, 1, non_finite=False)
        opt.step()
        opts.append(opt)
        all_params.append(params)
    assert [opts[1].state[p]["step"] for p in all_params[1]] == [2, 2, 1]
    for ref_p, p in zip(*all_params):
        assert_params_close(p, ref_p, f"{tuple(p.shape)}", steps=2)
        for key in ("exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq", "RMS"):
            if key in opts[0].state[ref_p]:
                ref = opts[0].state[ref_p][key]
                torch.testing.assert_close(opts[1].state[p][key], ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


class FakeDTensor(torch.nn.Parameter):
    """Stands in for a DTensor: the optimizer computes on ``to_local()``, here a smaller shard."""

    def to_local(self):
        return self._shard


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cls", [hf_optim.AdamW8bit, hf_optim.LAMB8bit], ids=lambda c: c.__name__)
def test_sharded_parameters_update_their_local_shard(cls, device, monkeypatch, use_triton):
    """Elementwise algorithms update a DTensor's local shard in the fused launch; LAMB (whose norms need the
    whole tensor) hands sharded parameters to the PyTorch path, which its distributed subclass reduces."""
    gen = torch.Generator().manual_seed(3)
    shard, grad = torch.randn(4, 1100, generator=gen).to(device), torch.randn(4, 1100, generator=gen).to(device)
    results = []
    for backend_name in ("torch", "triton"):
        monkeypatch.setenv("HF_OPTIM_BACKEND", backend_name)
        full = FakeDTensor(torch.zeros(8, 1100, device=device))
        full._shard = shard.clone()
        full.grad = FakeDTensor(torch.zeros(8, 1100, device=device))
        full.grad._shard = grad.clone()
        opt = cls([full])
        opt.step()
        assert opt.state[full]["state1"].shape == (4, 1100) and opt.state[full]["state1"].dtype == torch.uint8
        results.append((opt, full))
    (ref_opt, ref), (opt, fused) = results
    assert opt._rules.main.triton_eligible(fused._shard, sharded=True) is (cls is hf_optim.AdamW8bit)
    assert_params_close(fused._shard, ref._shard, "local shard", steps=1)
    assert torch.equal(opt.state[fused]["state1"], ref_opt.state[ref]["state1"])


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_parameters_take_the_pytorch_path(device, monkeypatch, use_triton):
    """A non-contiguous parameter runs the PyTorch path under a forced Triton backend, with its results."""
    base = torch.randn(30, 40, device=device)
    results = []
    for backend_name in ("torch", "triton"):
        monkeypatch.setenv("HF_OPTIM_BACKEND", backend_name)
        param = torch.nn.Parameter(base.clone().t())
        assert not param.is_contiguous()
        param.grad = torch.ones_like(param)
        opt = hf_optim.AdamW8bit([param], min_8bit_size=16)
        assert opt._rules.main.triton_eligible(param, sharded=False) is False
        opt.step()
        results.append(param)
    assert torch.equal(results[0], results[1])


@pytest.mark.parametrize("device", DEVICES)
def test_subclass_with_its_own_rule_takes_the_pytorch_path(device, use_triton):
    """A subclass that replaces the rule keeps its own math: the fused kernels would not run it."""

    class SignSGD(hf_optim.Lion):
        @staticmethod
        def rule(param, grad, states, h):
            return param - h.lr * torch.sign(grad), states

    param = torch.nn.Parameter(torch.zeros(10, device=device))
    param.grad = torch.arange(10.0, device=device) - 4.5
    opt = SignSGD([param], lr=0.5)
    assert opt._rules.main.triton_eligible(param, sharded=False) is False
    assert hf_optim.Lion8bit([param])._rules.main.triton_eligible(param, sharded=False) is True
    opt.step()
    assert torch.equal(param.detach(), -0.5 * torch.sign(param.grad))


@pytest.mark.parametrize("device", DEVICES)
def test_every_launch_is_an_enumerated_configuration(device, monkeypatch, use_triton):
    """What the optimizers launch is what ``triton_configs.kernel_specs`` lists (the compile test and
    ``python -m hf_optim.gpu_static`` compile that list): every launch of a few steps of the fused, LAMB and Adafactor
    kernels, with mixed dtypes and formats, is one of its configurations (same kernel, compile-time arguments, warps
    and launch options such as a register limit)."""
    from hf_optim.kernels.triton_path import configs as triton_configs
    from hf_optim.kernels.triton_path import guard as triton_guard
    from hf_optim.optim import registry

    specs = triton_configs.kernel_specs([(f.algorithm, f.base._supported_formats()) for f in registry.families()])
    def described(items):
        return tuple(sorted((key, repr(value)) for key, value in items))

    known = {(spec.kernel.__name__, spec.num_warps, described(spec.constexprs.items()), described(spec.options.items()))
             for spec in specs}
    option_names = {"num_warps"} | {key for spec in specs for key in spec.options}  # the rest are constexprs
    launched = []
    original = triton_guard.launch

    def recording(kernel, grid, *args, **kwargs):
        constexprs = described((k, v) for k, v in kwargs.items() if k not in option_names)
        options = described((k, v) for k, v in kwargs.items() if k in option_names and k != "num_warps")
        launched.append((kernel.__name__, kwargs["num_warps"], constexprs, options))
        return original(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(triton_guard, "launch", recording)
    for cls, kwargs in ((hf_optim.AdamW, {"optim_bits": 8}), (hf_optim.LAMB, {"optim_bits": 8}),
                        (hf_optim.Adafactor, {"beta1": 0.9, "optim_bits": 8, "lr": 1e-2, "relative_step": False})):
        params = make_problem(device)  # the bf16 tensor rounds stochastically
        opt = cls([{"params": [p for p in params if p.dtype != torch.bfloat16]},
                   {"params": [p for p in params if p.dtype == torch.bfloat16], "bf16_stochastic_round": True}],
                  **kwargs)
        set_grads(params, 0, non_finite=False)
        opt.step()
    assert launched and set(launched) <= known, sorted(set(launched) - known)[:3]
