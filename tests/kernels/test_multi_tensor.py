"""The multi-tensor PyTorch path (flat state, one call per chunk) against the per-tensor eager rule, bit for bit."""

import io
import threading

import pytest
import torch
from helpers import make_params, set_grads
from torch._dynamo.utils import counters

import hf_optim
from hf_optim.kernels.torch_path import cpu_compile, cpu_threads, multi_tensor
from hf_optim.optim.runner import Runner

# Sizes below and above min_8bit_size (so 8-bit and 32-bit state share a group), not multiples of 256, empty,
# 0-d, and several larger than the (shrunk) chunk so that tensors straddle chunks and fill chunks by themselves.
SHAPES = [(64, 80), (5000,), (300,), (0,), (), (16, 200), (200, 16), (4096,), (4097,), (3, 0, 5), (9000,)]
CASES = [
    (hf_optim.AdamW8bit, dict(lr=1e-2, weight_decay=0.1)),
    (hf_optim.AdamW32bit, dict(lr=1e-2)),
    (hf_optim.AdEMAMix8bit, dict(lr=1e-2, t_alpha=3, t_beta3=3)),
    (hf_optim.AdEMAMix32bit, dict(lr=1e-2)),
    (hf_optim.Lion8bit, dict(lr=1e-3, weight_decay=0.1)),
    (hf_optim.RMSprop8bit, dict(lr=1e-3, weight_decay=0.1)),
    (hf_optim.LAMB8bit, dict(lr=1e-2)),
    (hf_optim.AdamW4bit, dict(lr=1e-2, weight_decay=0.1)),
    (hf_optim.AdEMAMix4bit, dict(lr=1e-2, t_alpha=3, t_beta3=3)),
    (hf_optim.Lion4bit, dict(lr=1e-3, weight_decay=0.1)),
    (hf_optim.LAMB32bit, dict(lr=1e-2, adam_w_mode=False, weight_decay=0.1, max_trust_ratio=5.0)),
]
ids = [cls.__name__ for cls, _ in CASES]


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Chunks and the in-place threshold scaled down to the test tensors: tensors >= 4096 elements are updated in
    place (9000 over several chunks, 4097 with its partial block gathered), smaller ones gathered with others."""
    monkeypatch.setattr(multi_tensor, "CHUNK", 2048)
    monkeypatch.setattr(multi_tensor, "IN_PLACE_MIN", 4096)


def per_tensor_path(monkeypatch):
    monkeypatch.setattr(Runner, "on_multi_tensor_path", lambda self, full, param: False)


def mixed_params():
    """Half fp32, half bf16 parameters, in one group."""
    params = make_params(SHAPES, seed=0)
    return [torch.nn.Parameter(p.detach().to(torch.bfloat16)) if i % 2 else p for i, p in enumerate(params)]


def train(cls, kwargs, steps=4, after_step=lambda step: None):
    """Steps with a gradient missing once (its step counter lags behind), a param group added after two steps,
    and the state dict saved, loaded into a new optimizer and training resumed after three; ``after_step(step)``
    runs after each step."""
    params = mixed_params()
    late = make_params([(70, 70), (100,)], seed=1)
    opt = cls(params, **kwargs)
    for step in range(steps):
        if step == 2:
            opt.add_param_group({"params": late, "lr": kwargs["lr"] / 2})
        active = params + (late if step >= 2 else [])
        set_grads(active, step)
        if step == 1:
            params[1].grad = None
        if step == 3:
            saved = opt.state_dict()
            opt = cls([{"params": params}, {"params": late}], **kwargs)
            opt.load_state_dict(saved)
        opt.step()
        after_step(step)
    return params + late, opt


def assert_same(reference, candidate):
    (ref_params, ref_opt), (params, opt) = reference, candidate
    for a, b in zip(ref_params, params):
        assert torch.equal(a, b)
    ref_state, state = ref_opt.state_dict()["state"], opt.state_dict()["state"]
    assert ref_state.keys() == state.keys()
    for index in ref_state:
        assert ref_state[index].keys() == state[index].keys()
        for key, value in ref_state[index].items():
            if isinstance(value, dict):  # bitsandbytes' nested quantization state
                assert value.keys() == state[index][key].keys()
                for name, tensor in value.items():
                    other = state[index][key][name]
                    assert tensor.dtype == other.dtype and tensor.shape == other.shape, (index, name)
                    assert torch.equal(tensor, other), (index, name)
            else:
                assert value == state[index][key]


@pytest.mark.parametrize("cls,kwargs", CASES, ids=ids)
@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
def test_multi_tensor_equals_per_tensor_eager(cls, kwargs, compiled, monkeypatch):
    with monkeypatch.context() as reference_setup:
        per_tensor_path(reference_setup)
        reference_setup.setenv("HF_OPTIM_COMPILE", "0")
        reference = train(cls, kwargs)
    monkeypatch.setenv("HF_OPTIM_COMPILE", "1" if compiled else "0")
    candidate = train(cls, kwargs)
    assert_same(reference, candidate)
    params, opt = candidate
    # every non-empty parameter, the loaded and the late ones included, took the flat path
    assert all(opt._store.locate(p, opt.state[p]) is not None for p in params if p.numel())
    ref_params, ref_opt = reference
    assert not any(ref_opt._store.locate(p, ref_opt.state[p]) for p in ref_params)


def test_group_state_is_one_flat_buffer_per_layout(monkeypatch):
    params = make_params(SHAPES)
    opt = hf_optim.AdamW8bit(params)
    set_grads(params, 0)
    opt.step()
    buffers = {id(opt._store.locate(p, opt.state[p])[0]) for p in params}
    assert len(buffers) == 2  # 8-bit state for the large tensors, fp32 for those below min_8bit_size
    state = opt.state[params[0]]
    assert state["state1"].dtype == torch.uint8 and state["state1"].shape == params[0].shape
    assert state["absmax1"].shape == (-(-params[0].numel() // 256),)


def test_state_dict_format_and_weights_only_round_trip():
    params = make_params(SHAPES)
    opt = hf_optim.AdEMAMix8bit(params)
    set_grads(params, 0)
    opt.step()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    state = loaded["state"][0]["__bnb_optimizer_quant_state__"]
    assert state["state1"].shape == (2, 64, 80) and state["state1"].dtype == torch.uint8
    assert state["absmax1"].shape == (2, 20)
    twin = hf_optim.AdEMAMix8bit(make_params(SHAPES))
    twin.load_state_dict(loaded)
    for p, q in zip(params, twin.param_groups[0]["params"]):
        for key, value in opt.state[p].items():
            assert torch.equal(value, twin.state[q][key]) if isinstance(value, torch.Tensor) else value == twin.state[
                q][key]


SWITCH_CASES = [case for case in CASES if case[0] in (hf_optim.AdamW8bit, hf_optim.AdEMAMix8bit, hf_optim.LAMB8bit,
                                                      hf_optim.AdamW4bit)]


@pytest.mark.slow
@pytest.mark.parametrize("cls,kwargs", SWITCH_CASES, ids=[cls.__name__ for cls, _ in SWITCH_CASES])
def test_switch_from_eager_to_compiled_mid_run_changes_no_bit(cls, kwargs, monkeypatch):
    """HF_OPTIM_COMPILE=auto: the first two steps run eagerly while the kernels' background processes run (held
    back until then; this process then compiles them), the last two compiled; the result equals the per-tensor
    eager reference bit for bit."""
    with monkeypatch.context() as reference_setup:
        per_tensor_path(reference_setup)
        reference_setup.setenv("HF_OPTIM_COMPILE", "0")
        reference = train(cls, kwargs)
    cpu_compile.forget()
    release = threading.Event()

    class HeldBack:  # stands for the background process, which exits when released; this process then compiles
        started = 0.0

        def poll(self):
            return 0 if release.is_set() else None

        def wait(self):
            release.wait()
            return 0

        def close(self, kill=False):
            pass

    ran = []
    run_update = multi_tensor.run_update
    monkeypatch.setattr(cpu_compile, "start_warmup", lambda *job: HeldBack())
    # a marker left by an earlier run's background process would compile these kernels at the first step
    monkeypatch.setattr(cpu_compile, "warm_marker", lambda kernel, threads: None)
    monkeypatch.setattr(multi_tensor, "run_update", lambda *a, **k: ran.append(run_update(*a, **k)) or ran[-1])
    monkeypatch.setenv("HF_OPTIM_COMPILE", "auto")

    def after_step(step):
        ran.append(f"after step {step}")
        if step == 1:
            release.set()
            assert cpu_compile.wait(timeout=900)

    graphs = counters["stats"]["unique_graphs"]
    candidate = train(cls, kwargs, after_step=after_step)
    assert_same(reference, candidate)
    switch = ran.index("after step 1")
    before, after = ([r for r in part if isinstance(r, bool)] for part in (ran[:switch], ran[switch:]))
    assert before and not any(before)  # eager while the kernels were compiling
    assert after.count(True) > after.count(False)  # compiled after (one-block chunks still run eagerly)
    # one graph per kernel (and thread count): every chunk length and offset, in place or gathered, shares it
    compiled = sum(len(entry.ready) for entry in cpu_compile._entries.values())
    assert compiled and counters["stats"]["unique_graphs"] - graphs == compiled


@pytest.mark.slow
def test_no_recompilation_across_steps_with_changing_lr(monkeypatch):
    from torch._dynamo.utils import counters

    monkeypatch.setenv("HF_OPTIM_COMPILE", "1")
    # one thread count: on a busy machine the thread choice would add the one-thread variant, a graph of its own
    monkeypatch.setattr(cpu_threads, "adjustable", lambda: False)
    params = make_params(SHAPES)
    opt = hf_optim.AdamW8bit(params, lr=1e-2)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    set_grads(params, 0)
    opt.step()
    schedule.step()
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0
    for step in range(1, 6):
        set_grads(params, step)
        opt.step()
        schedule.step()
    assert counters["stats"]["unique_graphs"] == graphs  # new lrs and bias corrections: no new graph
    assert opt.param_groups[0]["lr"] < 1e-2 / 5


def test_chunk_plan_updates_large_tensors_in_place_and_gathers_the_rest(monkeypatch):
    from hf_optim.core.state_store import StateSpec
    from hf_optim.formats import BLOCKWISE8, SlotLayout
    from hf_optim.kernels.torch_path.flat_state import FlatState

    shapes = [(300,), (5000,), (100,), (9000,), (10,)]
    flat = FlatState([StateSpec("state1", signed=True)], [SlotLayout(BLOCKWISE8, True)], shapes, torch.device("cpu"))
    chunks = multi_tensor.plan_chunks(flat, list(range(len(shapes))))
    members = flat.members
    covered = [(c.start, c.stop) for c in chunks]
    assert covered[0][0] == 0 and covered[-1][1] == flat.total
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))  # contiguous, no overlap
    assert all(c.stop - c.start <= 2048 and c.start % 256 == 0 for c in chunks)
    in_place = {c.whole_member for c in chunks if c.whole_member is not None}
    assert in_place == {1, 3}  # the two tensors of >= 4096 elements
    # 5000 = 19 whole blocks + 136: its partial block is gathered together with the 100-element tensor
    tail = next(c for c in chunks if c.start == members[1].offset + 19 * 256)
    assert [(p.member, p.length) for p in tail.pieces] == [(1, 136), (2, 100)]
    assert all(len(c.pieces) == 1 for c in chunks if c.whole_member is not None)
