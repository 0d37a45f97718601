"""torch's optimizer contract, for every public hf_optim class (the checks of PyTorch's generic optimizer tests,
``TestOptimRenewed`` in torch's test/test_optim.py, that hf_optim failed, written here on tiny tensors).

Pickling (deepcopy, pickle, torch.save of the object), state-dict and load-state-dict hooks, foreign entries in
``optimizer.state``, ``param_names``, a refused step changing nothing, tensor learning rates, and compiled steps.
"""

import copy
import io
import pickle
import subprocess
import sys
import warnings

import pytest
import torch
from helpers import ALL_CLASSES

import hf_optim
from hf_optim.formats import dynamic_map as dynamic_maps
from hf_optim.optim.base import ALGORITHM_KEY, QUANT_STATE_KEY
from hf_optim.optim.runner import Runner

IDS = [cls.__name__ for cls in ALL_CLASSES]
BASE_CLASSES = {hf_optim.AdamW, hf_optim.AdEMAMix, hf_optim.LAMB, hf_optim.Lion, hf_optim.RMSprop, hf_optim.Adafactor}
TWINS = [cls for cls in ALL_CLASSES if cls not in BASE_CLASSES]


def options(cls, **extra):
    """Constructor arguments that give every class 8-bit state where it has any (tiny tensors included)."""
    kwargs = {"min_8bit_size": 0}
    if issubclass(cls, hf_optim.Adafactor):
        kwargs.update(beta1=0.9, optim_bits=8)  # the first moment is Adafactor's only 8-bit state
    kwargs.update(extra)
    return kwargs


def build(cls, params, **extra):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the paged-on-CPU notice, LAMB's weight-decay notice
        return cls(params, **options(cls, **extra))


def make_model(seed=0):
    gen = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return model


def train(model, opt, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(3, 6, generator=gen)
        opt.zero_grad()
        model(x).square().sum().backward()
        opt.step()


def assert_same(a, b, where="state"):
    """Equal nested containers; tensors bit for bit (dtype and shape included)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (where, list(a), list(b))
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for index, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{index}]")
    else:
        assert a == b, (where, a, b)


def public_attrs(opt):
    return {k for k in opt.__dict__ if not k.startswith("_")}


def through_pickle(obj):
    return pickle.loads(pickle.dumps(obj))


def through_torch_save(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


COPIES = {"deepcopy": copy.deepcopy, "pickle": through_pickle, "torch.save": through_torch_save}


# ----------------------------------------------------------------------------------------------------------------
# Pickling: torch's __getstate__ keeps only defaults, state and param_groups.
@pytest.mark.parametrize("how", list(COPIES))
@pytest.mark.parametrize("cls", ALL_CLASSES, ids=IDS)
def test_a_copy_of_model_and_optimizer_trains_exactly_like_the_original(cls, how):
    """A copy made before any state exists (it must create state) and one made after two steps (it must carry
    the state, unshared): each trains bit for bit like the original."""
    model = make_model()
    opt = build(cls, model.parameters())
    for round_index in range(2):
        model_copy, opt_copy = COPIES[how]((model, opt))
        assert public_attrs(opt_copy) == public_attrs(opt)
        assert opt_copy.is_paged == opt.is_paged and opt_copy.defaults == opt.defaults
        assert [p for g in opt_copy.param_groups for p in g["params"]] == list(model_copy.parameters())
        train(model_copy, opt_copy, 2, seed=round_index)  # the copy first: shared state would move the original
        train(model, opt, 2, seed=round_index)
        for p, q in zip(model.parameters(), model_copy.parameters()):
            assert torch.equal(p, q)
            assert_same(opt.state[p], opt_copy.state[q])
            assert opt.state[p]["step"] == 2 * (round_index + 1)
    repr(opt_copy)


# ----------------------------------------------------------------------------------------------------------------
# State-dict hooks, and entries of optimizer.state that are not a parameter's.
@pytest.mark.parametrize("cls", ALL_CLASSES, ids=IDS)
def test_state_dict_hooks_run_and_foreign_state_entries_pass_through(cls):
    model = make_model()
    opt = build(cls, model.parameters())
    train(model, opt, 1, seed=0)
    seen = []

    def pre_hook(optimizer):
        optimizer.state["test"] = 1  # torch's own test hook: not a per-parameter dict

    def post_hook(optimizer, state_dict):
        seen.append(state_dict)  # the final form: bitsandbytes' nesting and hf_optim's algorithm tag applied
        assert state_dict["param_groups"][0][ALGORITHM_KEY] == opt.algorithm
        replacement = dict(state_dict)
        replacement["ran_post_hook"] = True
        return replacement

    opt.register_state_dict_pre_hook(pre_hook)
    opt.register_state_dict_post_hook(post_hook)
    state_dict = opt.state_dict()
    assert state_dict["ran_post_hook"] and state_dict["state"]["test"] == 1
    assert seen[0]["state"] is state_dict["state"]
    per_param = state_dict["state"][0]
    assert (QUANT_STATE_KEY in per_param) == ("state1" in opt.state[model[0].weight])  # bitsandbytes' nesting

    # Loading keeps an entry that belongs to no parameter as it is (torch keeps it too).
    other_model = make_model()
    other = build(cls, other_model.parameters())
    other.load_state_dict(state_dict)
    assert other.state["test"] == 1
    assert_same(other.state_dict()["state"][0], per_param)


@pytest.mark.parametrize("cls", ALL_CLASSES, ids=IDS)
def test_load_state_dict_hooks_run_in_order_with_prepend(cls):
    """torch's TestOptimRenewed hooks: pre-hooks edit the shallow copy they get or return a replacement, in
    registration order (prepend=True goes first); post-hooks run after the state is loaded."""
    model = make_model()
    opt = build(cls, model.parameters(), **({} if cls is hf_optim.Adafactor else {"lr": 1e-3}))
    train(model, opt, 1, seed=0)
    state_dict = opt.state_dict()
    calls = []

    def set_lr_in_place(optimizer, sd):
        calls.append("in place")
        sd["param_groups"][0]["lr"] = 0.002

    def replace_with_lr(optimizer, sd):
        calls.append("replace")
        replacement = copy.deepcopy(sd)
        replacement["param_groups"][0]["lr"] = 0.003
        return replacement

    def post_hook(optimizer):
        calls.append(("post", optimizer.param_groups[0]["lr"]))

    opt.register_load_state_dict_pre_hook(set_lr_in_place)
    opt.register_load_state_dict_post_hook(post_hook)
    opt.load_state_dict(state_dict)
    assert opt.param_groups[0]["lr"] == 0.002 and calls == ["in place", ("post", 0.002)]

    calls.clear()
    opt.register_load_state_dict_pre_hook(replace_with_lr, prepend=True)
    opt.load_state_dict(state_dict)
    assert calls == ["replace", "in place", ("post", 0.002)]  # the in-place hook edits the replacement after it
    train(model, opt, 1, seed=1)  # and the optimizer still steps


# ----------------------------------------------------------------------------------------------------------------
# param_names (an optimizer built from named_parameters()).
@pytest.mark.parametrize("cls", ALL_CLASSES, ids=IDS)
def test_param_names_survive_a_state_dict_saved_without_them(cls):
    model = make_model()
    named = build(cls, model.named_parameters())
    names = [name for name, _ in model.named_parameters()]
    assert named.param_groups[0]["param_names"] == names
    train(model, named, 1, seed=0)

    unnamed = build(cls, model.parameters())
    train(model, unnamed, 1, seed=1)
    named.load_state_dict(unnamed.state_dict())
    assert named.param_groups[0]["param_names"] == names
    assert named.state_dict()["param_groups"][0]["param_names"] == names

    unnamed.load_state_dict(named.state_dict())  # names in the state dict are taken, as torch does
    assert unnamed.param_groups[0]["param_names"] == names
    train(model, unnamed, 1, seed=2)


# ----------------------------------------------------------------------------------------------------------------
# A refused step changes nothing.
BAD_INPUTS = {
    "complex": (RuntimeError, "does not support complex parameters"),
    "sparse": (RuntimeError, "does not support sparse gradients"),
    "backend": (ValueError, "HF_OPTIM_BACKEND='bogus' is not a valid backend"),
}


@pytest.mark.parametrize("bad", list(BAD_INPUTS))
@pytest.mark.parametrize("cls", ALL_CLASSES, ids=IDS)
def test_a_refused_step_changes_no_parameter_and_no_state(cls, bad, monkeypatch):
    """Group 0 holds good parameters, group 1 the bad one: the step is refused before group 0 is touched."""
    model = make_model()
    dtype = torch.complex64 if bad == "complex" else torch.float32
    late = torch.nn.Parameter(torch.randn(4, dtype=dtype))
    opt = build(cls, [{"params": list(model.parameters())}, {"params": [late]}])
    train(model, opt, 1, seed=0)  # some state exists already
    params_before = [p.detach().clone() for p in model.parameters()]
    state_before = copy.deepcopy(opt.state_dict())

    model(torch.randn(3, 6)).square().sum().backward()
    late.grad = torch.randn(4, dtype=dtype)
    if bad == "sparse":
        late.grad = late.grad.to_sparse()
    if bad == "backend":
        monkeypatch.setenv("HF_OPTIM_BACKEND", "bogus")
    error, message = BAD_INPUTS[bad]
    with pytest.raises(error, match=message):
        opt.step()
    for p, before in zip(model.parameters(), params_before):
        assert torch.equal(p, before)
    assert_same(opt.state_dict(), state_before)


# ----------------------------------------------------------------------------------------------------------------
# Tensor learning rates.
def lr_options(cls, lr):
    if issubclass(cls, hf_optim.Adafactor):
        return {"lr": lr, "relative_step": False}
    return {"lr": lr}


@pytest.mark.parametrize("cls", ALL_CLASSES, ids=IDS)
def test_a_one_element_tensor_lr_trains_like_the_float(cls):
    """torch's test_tensor_lr, with a scheduler that changes the tensor in place."""
    results = []
    for lr in (1e-2, torch.tensor(1e-2)):
        model = make_model()
        opt = build(cls, model.parameters(), **lr_options(cls, lr))
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))
        for step in range(3):
            train(model, opt, 1, seed=step)
            scheduler.step()
        if isinstance(lr, torch.Tensor):
            assert opt.param_groups[0]["lr"] is lr and lr.item() == pytest.approx(1e-2 / 4)
        results.append([p.detach().clone() for p in model.parameters()])
    for float_lr, tensor_lr in zip(*results):
        torch.testing.assert_close(tensor_lr, float_lr)


@pytest.mark.parametrize("lr", [torch.tensor([1e-3, 1e-3]), torch.tensor(1), torch.tensor(-1e-3)],
                         ids=["two-elements", "integer", "negative"])
def test_a_tensor_lr_that_is_not_one_valid_value_is_refused(lr):
    message = "Invalid learning rate: -0.001" if lr.is_floating_point() and lr.numel() == 1 else "Tensor lr must be"
    with pytest.raises(ValueError, match=message):
        hf_optim.AdamW8bit(make_model().parameters(), lr=lr)


# ----------------------------------------------------------------------------------------------------------------
# torch's test_errors: the error inputs of torch/testing/_internal/common_optimizers.py (torch 2.13), the generic ones
# for every class and the argument checks of torch's namesake (AdamW's for every Adam-like class, RMSprop's,
# Adafactor's eps), with torch's error type and message. params=None cases pass only if the arguments are checked
# before params is read, as torch's optimizers check them.
def relative(cls, **kwargs):
    """Adafactor's default relative step refuses an lr: torch's lr cases run with relative_step=False."""
    if issubclass(cls, hf_optim.Adafactor) and "lr" in kwargs:
        kwargs["relative_step"] = False
    return kwargs


def generic_error_inputs(cls):
    """get_error_inputs_for_all_optims: (params, kwargs, error type, message regex)."""
    p, q = torch.nn.Parameter(torch.randn(1, 1)), torch.nn.Parameter(torch.randn(1, 1))
    return [
        (p, {}, TypeError, "params argument given to the optimizer should be an iterable of Tensors or dicts"),
        ([p, p], {}, UserWarning, ".*a parameter group with duplicate parameters.*"),
        ([{"params": p}, {"params": p}], {}, ValueError, "some parameters appear in more than one parameter group"),
        (None, relative(cls, lr=torch.tensor([0.001, 0.001])), ValueError, "Tensor lr must be 1-element"),
        ([("weight", p), q], {}, ValueError,
         "all optimizer params should be with/without names. Some param names are missing"),
        ([{"params": [p], **relative(cls, lr=1e-2)}, {"params": [("weight", q)]}], {}, ValueError,
         "all optimizer param groups should be with/without names. cannot add param group with names to the "
         "optimizer"),
    ]


def own_error_inputs(cls):
    """The argument checks torch's namesake has, all with params=None."""
    if issubclass(cls, hf_optim.Adafactor):
        return [(None, {"eps": (-1e-30, 1e-3)}, ValueError, r"epsilon1 should be >= 0 but is: -1e-30 \(eps\[0\]\)"),
                (None, {"eps": (1e-30, 0.0)}, ValueError, r"Invalid epsilon2: 0.0 \(eps\[1\]\); expected a value in "
                 r"\(0.0")]
    cases = [(None, relative(cls, lr=1e-2, weight_decay=-1), ValueError, "Invalid weight_decay value: -1")]
    if issubclass(cls, hf_optim.RMSprop):
        return cases + [(None, {"lr": 1e-2, "momentum": -1.0}, ValueError, "Invalid momentum value: -1.0")]
    if issubclass(cls, hf_optim.Muon):  # torch.optim.Muon's checks (hf_optim's wording for lr and momentum)
        return cases + [(None, {"momentum": -1.0}, ValueError, "Invalid momentum value: -1.0"),
                        (None, {"adjust_lr_fn": "bogus"}, ValueError, "Adjust learning rate function bogus is not"),
                        (None, {"lr": -1e-2}, ValueError, "Invalid learning rate: -0.01")]
    betas = (1.0, 0.0, 0.0) if issubclass(cls, hf_optim.AdEMAMix) else (1.0, 0.0)
    zero_first = (0.0, 1.0, 0.5) if issubclass(cls, hf_optim.AdEMAMix) else (0.0, 1.0)
    return cases + [
        (None, {"lr": 1e-2, "betas": betas}, ValueError, "Invalid beta parameter at index 0: 1.0"),
        (None, {"lr": 1e-2, "betas": zero_first}, ValueError, "Invalid beta parameter at index 1: 1.0"),
        (None, {"lr": -1e-2}, ValueError, "Invalid learning rate: -0.01"),
    ]


@pytest.mark.parametrize("cls", ALL_CLASSES, ids=IDS)
def test_errors(cls):
    """torch's TestOptimRenewed.test_errors body (construction errors) on every class."""
    for params, kwargs, error, message in generic_error_inputs(cls) + own_error_inputs(cls):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*paged optimizers page CUDA state.*")  # paged twins on CPU
            warnings.filterwarnings("ignore", message=".*every parameter group has weight_decay=0.*")  # LAMB
            if issubclass(error, Warning):
                with pytest.warns(error, match=message):
                    cls(params, **kwargs)
            else:
                with pytest.raises(error, match=message):
                    cls(params, **kwargs)


@pytest.mark.parametrize("cls", ALL_CLASSES, ids=IDS)
def test_arguments_are_checked_before_params_is_read(cls):
    """A generator of parameters is not consumed by a constructor that refuses its arguments."""
    model = make_model()
    params = (p for p in model.parameters())
    with pytest.raises(ValueError, match="Invalid weight_decay value: -1"):
        cls(params, **relative(cls, lr=1e-3, weight_decay=-1))
    assert len(list(params)) == len(list(model.parameters()))


# ----------------------------------------------------------------------------------------------------------------
# A relative-step Adafactor and torch's lr schedulers.
def transformers_schedule(opt, kind):
    import transformers.optimization

    if kind == "adafactor":
        return transformers.optimization.AdafactorSchedule(opt)
    return transformers.optimization.get_linear_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=10)


SCHEDULERS = {
    "LambdaLR": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0),
    "StepLR": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2),
    "LinearLR": lambda opt: torch.optim.lr_scheduler.LinearLR(opt),
    "CosineAnnealingLR": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10),
    "OneCycleLR": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=10,
                                                                     cycle_momentum=False),
    "transformers.get_linear_schedule_with_warmup": lambda opt: transformers_schedule(opt, "linear"),
    "transformers.AdafactorSchedule": lambda opt: transformers_schedule(opt, "adafactor"),
}


@pytest.mark.parametrize("how", ["fresh", "deepcopy", "pickle", "loaded"])
@pytest.mark.parametrize("scheduler", list(SCHEDULERS))
def test_a_torch_scheduler_on_a_relative_step_adafactor_is_refused_with_one_line(scheduler, how):
    """transformers' Adafactor semantics are kept (lr=None, the step computed from t); a scheduler that would scale
    that None (``NoneType * float``), scale nothing, or write lr=0.0 (AdafactorSchedule: "take no step" here) is
    refused when built, before it computes a learning rate, in one line naming what to use."""
    model = make_model()
    opt = hf_optim.Adafactor(model.parameters())
    train(model, opt, 1, seed=0)
    if how in ("deepcopy", "pickle"):
        model, opt = COPIES[how]((model, opt))
    elif how == "loaded":
        state_dict = opt.state_dict()
        opt = hf_optim.Adafactor(model.parameters())
        opt.load_state_dict(state_dict)
    with pytest.raises(ValueError) as info:
        SCHEDULERS[scheduler](opt)
    message = str(info.value)
    assert "\n" not in message and message.startswith("Adafactor(relative_step=True) computes its own step size")
    assert "hf_optim.RelativeStepSchedule(optimizer)" in message and "relative_step=False, lr=" in message
    assert [group["lr"] for group in opt.param_groups] == [None] and "initial_lr" not in opt.param_groups[0]
    assert "step" not in vars(opt)  # the scheduler's step wrapper was not installed
    train(model, opt, 1, seed=1)  # still trains
    with pytest.raises(ValueError, match="computes its own step size"):
        SCHEDULERS[scheduler](opt)  # and a second try is refused too


def test_relative_step_schedule_and_an_lr_adafactor_still_take_schedulers():
    """The refusal is only for relative-step groups: RelativeStepSchedule reports the relative step, and
    Adafactor(relative_step=False, lr=...) is scheduled like any optimizer."""
    model = make_model()
    opt = hf_optim.Adafactor(model.parameters(), warmup_init=True)
    schedule = hf_optim.RelativeStepSchedule(opt)
    for step in range(1, 4):
        train(model, opt, 1, seed=step)
        schedule.step()
        assert schedule.get_last_lr() == [pytest.approx(1e-6 * (step + 1))]  # min(1e-6 * t, 1/sqrt(t)), next t
    fixed = hf_optim.Adafactor(model.parameters(), relative_step=False, lr=1e-2)
    linear = torch.optim.lr_scheduler.LambdaLR(fixed, lambda step: 0.5)
    assert linear.get_last_lr() == [0.005]


# ----------------------------------------------------------------------------------------------------------------
# Precision twins name themselves in argument errors.
@pytest.mark.parametrize("cls", TWINS, ids=lambda c: c.__name__)
def test_a_twin_names_itself_in_an_unknown_argument_error(cls):
    with pytest.raises(TypeError, match=rf"^{cls.__name__}\.__init__\(\) got an unexpected keyword argument "
                                        r"'weight_decy'; did you mean 'weight_decay'\?$"):
        cls(make_model().parameters(), weight_decy=0.1)


# ----------------------------------------------------------------------------------------------------------------
# Compiled steps.
COMPILED = [
    (hf_optim.AdamW8bit, {}),
    (hf_optim.AdEMAMix8bit, {}),
    (hf_optim.LAMB8bit, {}),
    (hf_optim.Lion8bit, {}),
    (hf_optim.RMSprop8bit, {}),
    (hf_optim.Adafactor, {}),  # relative step: the step count enters math that used to recompile at every step
]


@pytest.mark.parametrize("cls,extra", COMPILED, ids=[c.__name__ for c, _ in COMPILED])
def test_a_compiled_step_stays_compiled_past_the_recompile_limit(cls, extra):
    """torch.compile(opt.step) for 12 steps (the default recompile limit is 8) with the learning rate changing
    every step (a tensor lr, or Adafactor's own relative step): dynamo must never give up on a frame, and the
    parameters follow the eager run."""
    torch._dynamo.reset()
    results = []
    for compiled in (False, True):
        model = make_model()
        lr_kwargs = {} if cls is hf_optim.Adafactor else {"lr": torch.tensor(1e-2)}
        opt = build(cls, model.parameters(), **lr_kwargs, **extra)
        scheduler = None if cls is hf_optim.Adafactor else torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (s + 1))
        step = torch.compile(opt.step, backend="eager") if compiled else opt.step
        gen = torch.Generator().manual_seed(0)
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            for _ in range(12):
                opt.zero_grad()
                model(torch.randn(3, 6, generator=gen)).square().sum().backward()
                step()
                if scheduler is not None:
                    scheduler.step()
        results.append([p.detach().clone() for p in model.parameters()])
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-7)
    torch._dynamo.reset()


def test_8bit_state_created_in_a_compiled_step_breaks_no_graph_once_the_maps_exist(monkeypatch):
    """The map builder used to break the graph (``.tolist()``) whenever a compiled step created 8-bit state. Now
    only the very first build in a process breaks it (the build always runs eagerly), never ``.tolist()``."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(dynamic_maps, "_built", {})  # as in a fresh process
    # The per-tensor path (GPUs, sharded parameters) creates state inside the graph. The CPU's multi-tensor path
    # runs outside it on purpose (it compiles its own kernels), which is a deliberate break, not this one.
    monkeypatch.setattr(Runner, "on_multi_tensor_path", lambda self, full, param: False)
    for expected_breaks in (True, False):
        torch._dynamo.reset()
        counters.clear()
        model = make_model()
        opt = build(hf_optim.AdamW8bit, model.parameters())
        model(torch.randn(3, 6)).square().sum().backward()
        torch.compile(opt.step, backend="eager")()
        breaks = [reason for reason in counters["graph_break"]]
        assert not any("tolist" in reason for reason in breaks)
        assert bool(breaks) == expected_breaks, breaks
        assert opt.state[model[0].weight]["state1"].dtype == torch.uint8
    torch._dynamo.reset()


def test_maps_built_under_inductor_equal_the_constants_bit_for_bit(monkeypatch):
    """Under an Inductor graph the maps are still the package's constants (which equal bitsandbytes' under torch's
    FMA kernels: tests/formats/test_dynamic_map.py), not values recomputed in the graph."""
    monkeypatch.setattr(dynamic_maps, "_built", {})
    torch._dynamo.reset()
    maps = torch.compile(lambda: (dynamic_maps.dynamic_map(True), dynamic_maps.dynamic_map(False)))()
    for signed, qmap in zip((True, False), maps):
        expected = dynamic_maps.create_dynamic_map(signed)
        assert torch.equal(qmap.view(torch.int32), expected.view(torch.int32))
    torch._dynamo.reset()


def test_import_loads_neither_dynamo_nor_bitsandbytes():
    """The compile-safe map build and the GlobalOptimManager lookup cost nothing at import: hf_optim reads
    bitsandbytes' manager only from an already imported bitsandbytes, and dynamo loads when first needed."""
    code = "import sys, hf_optim; print(sorted(m for m in ('torch._dynamo', 'bitsandbytes') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr
