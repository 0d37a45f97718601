"""One conformance suite over every registered algorithm x every state format it runs with x paged/unpaged,
driven by the registries (:func:`hf_optim.optim.registry.families`, the format registry): no hand-written list of
algorithms or formats, so a newly registered algorithm or format is checked here without editing this file.

Each case checks that the class exists and is exported, that its Trainer names build it, that a few steps on small
odd-sized tensors (one above ``min_8bit_size``, one under) keep the state within the format's quantization bound
of the same algorithm's fp32 class (which the per-algorithm reference tests compare with torch / transformers /
bitsandbytes), that a state_dict round trip resumes bit for bit, and that ``state_memory`` and the estimator agree
with the bytes actually held. What is specific to one algorithm stays in its own test file.
"""

from __future__ import annotations

import io
import warnings
from types import SimpleNamespace

import pytest
import torch
from format_helpers import build, element_scale, round_trip_bound
from helpers import assert_bit_identical, make_params, set_grads

import hf_optim
from hf_optim.core.state_store import slot_format
from hf_optim.formats import FP32
from hf_optim.integrations.names import OPTIMIZER_NAMES
from hf_optim.integrations.transformers import optimizer_cls_and_kwargs
from hf_optim.optim import registry
from hf_optim.optim.trainer_mapping import mapping, parse_name
from hf_optim.recipes.estimate import MIN_8BIT_SIZE, TensorCount, state_bytes

SHAPES = [(67, 63), (37,)]
"""4221 elements (above the default ``min_8bit_size`` of 4096, odd block count, partial last block) and 37 (fp32
state in every format)."""
STEPS = 3
pytestmark = pytest.mark.filterwarnings("ignore:hf_optim. paged optimizers:UserWarning")  # Paged* on CPU


def paged_choices(family) -> list[bool]:
    return [False, True] if family.pages else [False]


def class_of(family, fmt, paged: bool) -> type:
    """The class a user picks for ``fmt`` and paging: the named variant (``PagedAdamW8bit``), else the generic
    (``PagedLAMB``, ``LAMB``) class given ``state_format``."""
    try:
        return family.class_for(fmt, paged)
    except ValueError:  # a format without named classes (LAMB's blockwise4): the generic paged class takes it
        return family[f"Paged{family.algorithm.class_name}"]


CASES = [
    pytest.param(family, fmt, paged, id=f"{family.algorithm.name}-{fmt.name}-{'paged' if paged else 'unpaged'}")
    for family in registry.families()
    for fmt in family.base._supported_formats()
    for paged in paged_choices(family)
]


def make(family, fmt, paged: bool, params):
    return build(class_of(family, fmt, paged), params, state_format=fmt.name)


def run(opt, params, steps: int, start: int = 0):
    for step in range(start, start + steps):
        set_grads(params, step)
        opt.step()


_FP32_RUNS: dict[str, tuple] = {}


def fp32_run(family):
    """The family's fp32 class after ``STEPS`` steps (the reference its own test file checks), run once."""
    if family.algorithm.name not in _FP32_RUNS:
        params = make_params(SHAPES)
        opt = make(family, FP32, False, params)
        run(opt, params, STEPS)
        _FP32_RUNS[family.algorithm.name] = (opt, params)
    return _FP32_RUNS[family.algorithm.name]


def slot_values(state: dict, spec, numel: int) -> torch.Tensor:
    """A slot's fp32 values ``(rows, numel)`` (a packed format needs the count: its bytes hold an even one)."""
    fmt = slot_format(state, spec)
    return fmt.dequantize(fmt.raw(state, spec), spec.signed, numel)


def same_state(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for key, value in a.items():
        other = b[key]
        if isinstance(value, torch.Tensor):
            if value.dtype != other.dtype or not torch.equal(value.contiguous().view(-1).view(torch.uint8),
                                                             other.contiguous().view(-1).view(torch.uint8)):
                return False
        elif value != other:
            return False
    return True


# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", registry.families(), ids=lambda f: f.algorithm.name)
def test_classes_are_exported_and_trainer_names_build_them(family):
    for name, cls in family.classes.items():
        assert getattr(hf_optim, name) is cls, f"hf_optim.{name} is not {cls}"
    table = {entry.name: entry for entry in hf_optim.available_optimizers()}
    assert family.trainer_names, f"{family.algorithm.name} has no optim= name"
    for name in family.trainer_names:
        fmt, paged = parse_name(name, mapping(family.algorithm).formats)
        assert table[name] is OPTIMIZER_NAMES[name]
        entry = OPTIMIZER_NAMES[name]
        assert entry.cls is family.class_for(fmt, paged) and entry.algorithm is family.algorithm
        assert (entry.state_format, entry.paged) == (fmt, paged) and entry.precision == fmt.label
    # every named class is reachable from some optim= name
    named = {OPTIMIZER_NAMES[name].cls for name in family.trainer_names}
    for fmt in family.formats:
        for paged in paged_choices(family):
            assert family.class_for(fmt, paged) in named, f"no optim= name builds {fmt.name} paged={paged}"


@pytest.mark.parametrize("family,fmt,paged", CASES)
def test_steps_stay_within_the_format_bound_of_the_fp32_class(family, fmt, paged):
    """Each slot's values differ from the fp32 class's by at most ``STEPS`` quantization errors (each within the
    format's bound relative to its block's scale: the state's update is linear in the old state with coefficients
    at most 1, and the gradients do not depend on the parameters); fp32 state and the parameters' direction of
    travel agree (cosine > 0.95; measured >= 0.987). fp32 itself, paged or not, named class or not, equals the fp32
    reference bit for bit, and a paged class equals its unpaged twin bit for bit."""
    ref_opt, ref_params = fp32_run(family)
    params = make_params(SHAPES)
    opt = make(family, fmt, paged, params)
    run(opt, params, STEPS)
    specs = opt.state_specs
    assert specs, f"{type(opt).__name__} declares no state slots"
    for p, ref_p in zip(params, ref_params):
        state, ref_state = opt.state[p], ref_opt.state[ref_p]
        quantized = fmt.quantized and p.numel() >= MIN_8BIT_SIZE
        for spec in specs:
            if spec.key not in ref_state:
                continue
            assert slot_format(state, spec) is (fmt.stored_as(spec) if quantized else FP32), (spec.key, p.shape)
            values, ref = slot_values(state, spec, p.numel()), slot_values(ref_state, spec, p.numel())
            if not quantized:
                assert torch.equal(values, ref), f"{spec.key} {tuple(p.shape)}: fp32 state differs"
                continue
            bound = round_trip_bound(state, spec, fmt) * STEPS * (1 + 1e-3)
            scale = element_scale(fmt.stored_as(spec), ref, spec.signed, tuple(p.shape))
            worst = ((values - ref).abs() / scale.clamp(min=1e-30)).max().item()
            assert worst <= bound, f"{spec.key} {tuple(p.shape)}: {worst:.4g} of the block scale > {bound:.4g}"
        if not quantized and fmt is FP32:
            assert torch.equal(p, ref_p), f"{tuple(p.shape)}: fp32 parameters differ from the fp32 class's"
    if paged:  # on CPU a paged class runs exactly as its unpaged twin
        twin_params = make_params(SHAPES)
        twin = make(family, fmt, False, twin_params)
        run(twin, twin_params, STEPS)
        for p, q in zip(params, twin_params):
            assert torch.equal(p, q) and same_state(opt.state[p], twin.state[q]), f"{tuple(p.shape)}: paged differs"
    start = make_params(SHAPES)
    for p, ref_p, p0 in zip(params, ref_params, start):
        moved, ref_moved = (p - p0).flatten(), (ref_p - p0).flatten()
        if fmt.quantized and p.numel() >= MIN_8BIT_SIZE:
            cosine = torch.nn.functional.cosine_similarity(moved, ref_moved, dim=0).item()
            assert cosine > 0.95, f"{tuple(p.shape)}: update direction {cosine:.3f} from the fp32 class's"
        else:
            assert torch.equal(p, ref_p) if fmt is FP32 else ref_moved.abs().max() > 0


@pytest.mark.parametrize("family,fmt,paged", CASES)
def test_state_dict_round_trip_resumes_bit_for_bit(family, fmt, paged):
    params = make_params(SHAPES)
    opt = make(family, fmt, paged, params)
    run(opt, params, 2)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = make(family, fmt, paged, resumed_params)
    resumed.load_state_dict(saved)
    run(opt, params, 1, start=2)
    run(resumed, resumed_params, 1, start=2)
    for p, q in zip(params, resumed_params):
        assert torch.equal(p, q), f"{tuple(p.shape)}: resumed parameters differ"
        assert same_state(opt.state[p], resumed.state[q]), f"{tuple(p.shape)}: resumed state differs"
    assert [g["state_format"] for g in resumed.param_groups] == [fmt.name]


@pytest.mark.parametrize("family,fmt,paged", CASES)
def test_state_memory_counts_the_bytes_held(family, fmt, paged):
    params = make_params(SHAPES)
    opt = make(family, fmt, paged, params)
    run(opt, params, 1)
    held = sum(v.numel() * v.element_size() for state in opt.state.values() for v in state.values()
               if isinstance(v, torch.Tensor))
    memory = hf_optim.state_memory(opt)
    assert memory.total_bytes == held and memory.paged_bytes == 0  # CPU: paged classes run unpaged
    assert memory.num_params == sum(p.numel() for p in params)
    if fmt.quantized:  # uint8 codes, or a float8 format's own type
        assert memory.by_dtype.get(str(fmt.main_dtype()).removeprefix("torch."), 0) > 0
    else:
        assert not {"uint8", "float8_e4m3fn", "float8_e5m2"} & set(memory.by_dtype)


TRAINER_ARGS = SimpleNamespace(learning_rate=1e-2, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
                               optim_args=None)
"""The ``TrainingArguments`` fields an optim= name's mapping reads (transformers' defaults, a larger lr)."""

NAMES = [pytest.param(family, name, id=name) for family in registry.families() for name in family.trainer_names]


@pytest.mark.parametrize("family,name", NAMES)
def test_trainer_name_builds_a_class_whose_bytes_the_estimator_predicts(family, name):
    """The optimizer a Trainer name builds (class and kwargs as the Trainer gets them) holds exactly the bytes the
    memory estimator prices the name at, and ``state_memory`` counts them."""
    cls, kwargs = optimizer_cls_and_kwargs(TRAINER_ARGS, name=name)
    fmt, paged = parse_name(name, mapping(family.algorithm).formats)
    assert cls is family.class_for(fmt, paged)
    params = make_params(SHAPES)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # paged classes on CPU
        opt = cls(params, **kwargs)
    run(opt, params, 1)
    assert [g["state_format"] for g in opt.param_groups] == [fmt.name]
    tensors = [TensorCount(p.numel(), p.element_size(), tuple(p.shape), False) for p in params]
    predicted = state_bytes(name, tensors)
    assert hf_optim.state_memory(opt).total_bytes == predicted, f"the estimator prices {name} at {predicted} bytes"


TWIN_CASES = [
    pytest.param(family, fmt, id=f"{family.algorithm.name}-{fmt.name}")
    for family in registry.families()
    if family.algorithm.triton_rule is not None and family.algorithm.triton_plan.elementwise
    for fmt in family.base._supported_formats()
    if fmt.triton
]


@pytest.mark.usefixtures("cuda_scalars")
@pytest.mark.parametrize("family,fmt", TWIN_CASES)
def test_triton_twin_in_the_interpreter_equals_the_pytorch_rule(family, fmt, monkeypatch):
    """Every registered elementwise algorithm's Triton twin (``optim/<algo>/triton_rule.py``), in Triton's interpreter,
    against its PyTorch rule (dividing by scalars as on CUDA: ``cuda_scalars``, since torch's vectorized CPU division
    is not always correctly rounded): parameters and state bit for bit after ``STEPS`` steps on fp32 tensors. (The
    parameter dtypes, stochastic rounding and tile shapes of the built-ins:
    ``tests/kernels/test_triton_kernels.py``.)"""

    runs = []
    for backend in ("torch", "triton"):
        monkeypatch.setenv("HF_OPTIM_BACKEND", backend)
        params = make_params(SHAPES)
        opt = make(family, fmt, False, params)
        run(opt, params, STEPS)
        runs.append((opt, params, repr(opt)))  # the repr names the backend the environment selects now
    (ref_opt, ref_params, ref_repr), (opt, params, triton_repr) = runs
    assert "backend=triton" in triton_repr and "backend=triton" not in ref_repr
    assert_bit_identical(ref_opt, ref_params, opt, params)
