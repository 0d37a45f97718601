"""The Triton path's cached launch plans (``triton_step.TritonPlans``) against plans built from scratch.

Every step of a run with the events that change what a plan depends on (gradients at new addresses, a parameter's
first gradient at step 3, a parameter without a gradient, a loaded state dict, ``param.data`` replaced, a dtype
change, per-parameter overrides added and removed, an added param group) is checked three ways: the cached plan's
tables equal those :func:`triton_step.build_plan` makes from the same tensors; the parameters and state equal,
bit for bit, those of a run that builds every plan from scratch (what every step did before plans were cached);
and they are close to the PyTorch path's. On CPU the kernels run in Triton's interpreter.
"""

import pytest
import torch

import hf_optim

pytest.importorskip("triton")
from hf_optim.kernels.triton_path import step as triton_step  # noqa: E402
from hf_optim.optim.overrides import PARAM_OVERRIDES_ATTR  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
SHAPES = [(20, 40), (300,), (1100,), (33,), (24, 48)]
DTYPES = [torch.float32, torch.bfloat16, torch.float32, torch.float32, torch.bfloat16]
STEPS = 9

CASES = [
    pytest.param(hf_optim.AdamW8bit, {"lr": 1e-2, "weight_decay": 0.1, "min_8bit_size": 256}, id="AdamW8bit"),
    pytest.param(hf_optim.AdamW32bit, {"lr": 1e-2}, id="AdamW32bit"),
    pytest.param(hf_optim.Lion8bit, {"lr": 1e-3, "min_8bit_size": 256, "bf16_stochastic_round": True},
                 id="Lion8bit-stochastic-rounding"),
    pytest.param(hf_optim.LAMB8bit, {"lr": 1e-2, "weight_decay": 0.01, "min_8bit_size": 256}, id="LAMB8bit"),
]


@pytest.fixture
def use_triton(monkeypatch):
    monkeypatch.setenv("HF_OPTIM_BACKEND", "triton")
    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def make_params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dt).to(DEVICE)) for s, dt in zip(SHAPES, DTYPES)]


def grads_for(params, step):
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=gen).to(p.dtype).to(p.device) for p in params]


def run(cls, kwargs, record=None):
    """A run with every event; ``record(opt)`` after each step. Returns the optimizer and all parameters."""
    params = make_params()
    extra = torch.nn.Parameter(torch.randn(300, generator=torch.Generator().manual_seed(7)).to(DEVICE))
    setattr(params[3], PARAM_OVERRIDES_ATTR, {"lr": kwargs["lr"] * 3})
    opt = cls(params, **kwargs)
    saved = None
    for step in range(1, STEPS + 1):
        grads = grads_for(params + [extra], step)
        for index, (p, g) in enumerate(zip(params, grads)):
            if index == 4 and step < 3:
                continue  # its first gradient comes at step 3 (its state is created then)
            if index == 1 and step == 5:
                p.grad = None  # no gradient at this step (its step counter falls behind)
            elif p.grad is not None and step % 3 == 0:
                p.grad.copy_(g)  # the same gradient tensor, new values
            else:
                p.grad = g  # a new gradient tensor (zero_grad(set_to_none=True) and backward)
        if step == 2:
            saved = opt.state_dict()
        if step == 4:
            opt.load_state_dict(saved)  # the state goes back to step 2's, in new tensors
        if step == 5:
            params[2].data = params[2].data.clone()  # param.data replaced: a new address
            delattr(params[3], PARAM_OVERRIDES_ATTR)  # back in its group's launch
        if step == 6:
            params[0].data = params[0].data.to(torch.bfloat16)  # a dtype change (new gradients follow it)
            params[0].grad = params[0].grad.to(torch.bfloat16)
        if step == 7:
            opt.add_param_group({"params": [extra]})
        if step >= 7:
            extra.grad = grads[-1]
        opt.step()
        if record is not None:
            record(opt)
    return opt, params + [extra]


@pytest.mark.parametrize("cls,kwargs", CASES)
def test_cached_plans_equal_fresh_plans_and_uncached_results(cls, kwargs, monkeypatch, use_triton):
    calls = []
    prepare = triton_step.TritonPlans.prepare

    def recording(self, group_index, items, stochastic):
        calls.append((self, group_index, list(items), stochastic))
        return prepare(self, group_index, items, stochastic)

    def check(opt):
        assert calls, "no step ran on the Triton path"
        for plans, group_index, items, stochastic in calls:
            grads = [item[1].contiguous() for item in items]
            fresh = triton_step.describe(triton_step.build_plan(plans.algorithm, items, grads, stochastic))
            assert plans.plan_tables(group_index, items, stochastic) == fresh
        calls.clear()

    monkeypatch.setattr(triton_step.TritonPlans, "prepare", recording)
    opt, params = run(cls, kwargs, check)

    def uncached(self, group_index, items, stochastic):
        self.clear()
        return prepare(self, group_index, items, stochastic)

    monkeypatch.setattr(triton_step.TritonPlans, "prepare", uncached)
    ref_opt, ref_params = run(cls, kwargs)
    for p, ref in zip(params, ref_params):
        assert p.dtype == ref.dtype and torch.equal(p, ref), f"{tuple(p.shape)}: parameters differ"
        for key, value in ref_opt.state[ref].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(opt.state[p][key], value), f"{tuple(p.shape)}: {key} differs"
            else:
                assert opt.state[p][key] == value

    monkeypatch.setenv("HF_OPTIM_BACKEND", "torch")
    torch_opt, torch_params = run(cls, kwargs)
    for p, ref in zip(params, torch_params):
        torch.testing.assert_close(p, ref, rtol=2e-2, atol=2e-3, msg=f"{tuple(p.shape)}: far from the PyTorch path")


def test_steps_with_new_gradients_reuse_the_plan(use_triton):
    """Gradients at new addresses only refresh the tables: no rebuild, and the new addresses are in them."""
    params = make_params()
    opt = hf_optim.AdamW8bit(params, min_8bit_size=256)
    for step in range(1, 5):
        for p, g in zip(params, grads_for(params, step)):
            p.grad = g
        opt.step()
        if step == 1:
            built = opt._rules.main.triton_plans.builds
    assert opt._rules.main.triton_plans.builds == built == 1
    (plan,) = opt._rules.main.triton_plans._plans.values()
    tables = [row for batch in plan.batches for row in batch.launch.meta.cpu().tolist()]
    assert sorted(row[triton_step.mt.GRAD] for row in tables) == sorted(p.grad.data_ptr() for p in params)


def test_state_moved_by_a_loaded_state_dict_is_what_the_kernels_update(use_triton):
    """A loaded state dict drops the plans of the replaced state (they hold its state dicts, and with them its
    tensors' memory), and the new plan's tables name the new state tensors."""
    params = make_params()
    opt = hf_optim.AdamW8bit(params, min_8bit_size=256)
    for step in (1, 2):
        for p, g in zip(params, grads_for(params, step)):
            p.grad = g
        opt.step()
    opt.load_state_dict(opt.state_dict())
    opt.step()
    (plan,) = opt._rules.main.triton_plans._plans.values()
    addresses = {row[triton_step.mt.VALUES] for batch in plan.batches for row in batch.launch.meta.cpu().tolist()}
    assert addresses == {opt.state[p]["state1"].data_ptr() for p in params}
