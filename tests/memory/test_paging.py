"""Paged optimizers on CPU: the fallback (twin math, one warning), state dicts, and the paging wiring.

The real managed-memory path needs a GPU (tests/memory/test_paging_gpu.py). Here the wiring around it (which buffers the
allocator pages, prefetch before each update, load_state_dict allocating through the allocator, accounting) is
checked with the managed allocation replaced by registered CPU tensors.
"""

import copy
import io
import math
import pickle
import warnings

import pytest
import torch
from helpers import ALL_CLASSES, make_params, run_steps

import hf_optim
import hf_optim.paging as paging
from hf_optim.optim.base import QUANT_STATE_KEY
from hf_optim.optim.runner import Runner
from hf_optim.paging import managed

PAGED = [cls for cls in ALL_CLASSES if cls.__name__.startswith("Paged")]
SHAPES = [(120, 90), (300,), (7,), ()]  # 8-bit sized, partial block, below min_8bit_size, scalar


def twin_of(cls):
    return getattr(hf_optim, cls.__name__.removeprefix("Paged"))


def save_and_load(state_dict):
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_bitsandbytes_paged_class_names_exist_and_unpaged_algorithms_have_none():
    """bitsandbytes' paged names (the registry-derived classes are checked by
    tests/algorithms/test_algorithm_conformance.py)."""
    names = {cls.__name__ for cls in PAGED}
    assert {f"Paged{name}{bits}" for name in ("AdamW", "AdEMAMix", "LAMB", "Lion") for bits in ("", "8bit", "32bit")
            } <= names
    assert not [name for name in names if name.startswith(("PagedRMSprop", "PagedAdafactor"))]


@pytest.mark.parametrize("cls", PAGED, ids=lambda c: c.__name__)
def test_paged_on_cpu_warns_once(cls):
    """The warning (paged equals its unpaged twin bit for bit: tests/algorithms/test_algorithm_conformance.py)."""
    paging._warned.clear()
    paged_params = make_params(SHAPES)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        paged = cls(paged_params)
        run_steps(paged, paged_params, 3)
        cls(make_params([(64, 64)])).step()  # a second optimizer of the class does not warn again
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    twin = twin_of(cls)
    assert len(messages) == 1, messages
    assert f"{cls.__name__} has state on cpu" in messages[0]
    assert f"runs exactly as {twin.__name__}." in messages[0]
    assert caught[0].filename.endswith("helpers.py")  # the opt.step() call, not hf_optim/torch internals


# ----------------------------------------------------------------------------------------------------------------
# The paging wiring, with managed allocation replaced by CPU tensors registered as live managed buffers.
PLENTY = 1 << 40
FREE = {"bytes": PLENTY}
"""Free device memory that the fake_managed fixture reports (tests set it to 0 for a memory shortage)."""


@pytest.fixture
def fake_managed(monkeypatch):
    made, prefetched = [], []

    def fake_zeros(runtime, shape, dtype, device):
        tensor = torch.zeros(shape, dtype=dtype, device=device)
        managed._live[tensor.untyped_storage().data_ptr()] = tensor.numel() * tensor.element_size()
        made.append(tensor)
        return tensor

    def fake_prefetch(runtime, tensor):
        if managed.is_managed(tensor):
            prefetched.append(tensor.untyped_storage().data_ptr())

    monkeypatch.setattr(managed, "unavailable_reason", lambda device_type, index: None)
    monkeypatch.setattr(managed, "runtime", lambda: None)
    # Paging is real only on CUDA, where state is per tensor (Triton or the per-tensor PyTorch path); these CPU
    # stand-ins must not take the CPU's multi-tensor path, which keeps a group's state in one flat buffer.
    monkeypatch.setattr(Runner, "on_multi_tensor_path", lambda self, full, param: False)
    monkeypatch.setattr(managed, "managed_zeros", fake_zeros)
    monkeypatch.setattr(managed, "prefetch", fake_prefetch)
    FREE["bytes"] = PLENTY
    monkeypatch.setattr(paging, "free_device_bytes", lambda device: FREE["bytes"])
    before = dict(managed._live)
    yield made, prefetched
    managed._live.clear()
    managed._live.update(before)


def test_only_state_buffers_at_the_threshold_are_paged_and_counted(fake_managed):
    made, _ = fake_managed
    shapes = [(400, 250), (333, 300), (80, 70)]  # 100,000 and 99,900 elements: threshold is inclusive
    params = make_params(shapes)
    opt = hf_optim.PagedAdamW8bit(params)
    run_steps(opt, params, 1)
    assert [tuple(t.shape) for t in made] == [(400, 250), (400, 250)]  # state1 and state2 of the big tensor
    state = opt.state[params[0]]
    assert paging.is_paged_tensor(state["state1"]) and paging.is_paged_tensor(state["state2"])
    assert not paging.is_paged_tensor(state["absmax1"]) and not paging.is_paged_tensor(opt.state[params[1]]["state1"])

    memory = hf_optim.state_memory(opt)
    assert memory.paged_bytes == 2 * 400 * 250  # two uint8 codes per element
    blocks = sum(math.ceil(math.prod(s) / 256) for s in shapes)
    qmaps = len(shapes) * 2 * 256 * 4
    assert memory.total_bytes == 2 * sum(math.prod(s) for s in shapes) + 2 * 4 * blocks + qmaps
    assert memory.by_dtype["uint8"] == 2 * sum(math.prod(s) for s in shapes)


def test_32bit_paged_state_counts_four_bytes_per_element(fake_managed):
    params = make_params([(400, 250)])
    opt = hf_optim.PagedAdEMAMix32bit(params)
    run_steps(opt, params, 1)
    memory = hf_optim.state_memory(opt)
    assert memory.paged_bytes == memory.total_bytes == (2 + 1) * 400 * 250 * 4  # stacked m1/m2, nu


def run_with_free(opt, params, free_bytes, steps, start):
    FREE["bytes"] = free_bytes
    run_steps(opt, params, steps, start=start)
    return start + steps


def test_paged_buffers_are_prefetched_once_when_a_memory_shortage_ends(fake_managed):
    """No prefetch while the device has room (the pages are resident) nor while it is short (page faults bring them
    back faster than prefetching every buffer before the group's launch); the first step with room again
    prefetches every managed buffer, once."""
    _, prefetched = fake_managed
    params = make_params([(400, 250), (80, 70)])
    opt = hf_optim.PagedLion8bit(params)
    step = run_with_free(opt, params, PLENTY, 2, 0)
    step = run_with_free(opt, params, 0, 2, step)
    assert prefetched == []
    step = run_with_free(opt, params, PLENTY, 2, step)
    assert prefetched == [opt.state[params[0]]["state1"].untyped_storage().data_ptr()]
    step = run_with_free(opt, params, 100_000 - 1, 1, step)  # less free than the 100,000-byte paged state: short
    run_with_free(opt, params, 100_000, 1, step)  # room for all of it again
    assert len(prefetched) == 2


@pytest.mark.parametrize(
    ("free", "paged", "short"),
    [
        (0, 0, False),  # no paged state: nothing to evict
        (0, 1, True),
        (2**20 - 1, 2**20, True),  # less free than a small paged state
        (2**20, 2**20, False),  # room for all of it
        (2**30 - 1, 50 * 2**30, True),  # below the 1 GiB floor with a large paged state
        (2**30, 50 * 2**30, False),
        (80 * 2**30, 2 * 2**30, False),  # an idle H100 with a Llama-3.2-1B's 8-bit state
    ],
)
def test_short_of_memory_from_free_memory(free, paged, short):
    assert paging.SHORT_BELOW_FREE_BYTES == 2**30
    assert paging.short_of_memory(free, paged) is short


def test_free_device_bytes_is_none_off_cuda():
    assert paging.free_device_bytes(torch.device("cpu")) is None


def test_load_state_dict_pages_the_loaded_state_again(fake_managed):
    made, _ = fake_managed
    params = make_params([(400, 250), (80, 70)])
    opt = hf_optim.PagedAdamW8bit(params)
    run_steps(opt, params, 2)
    saved = save_and_load(opt.state_dict())
    made.clear()

    resumed = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed_opt = hf_optim.PagedAdamW8bit(resumed)
    resumed_opt.load_state_dict(saved)
    state = resumed_opt.state[resumed[0]]
    assert [t.untyped_storage().data_ptr() for t in made] == [
        state["state1"].untyped_storage().data_ptr(), state["state2"].untyped_storage().data_ptr()
    ]
    assert torch.equal(state["state1"], saved["state"][0][QUANT_STATE_KEY]["state1"])
    assert hf_optim.state_memory(resumed_opt).paged_bytes == hf_optim.state_memory(opt).paged_bytes == 2 * 100_000


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_of_a_paged_optimizer_pages_its_state_again(fake_managed, how):
    """deepcopy / pickle carry the state as host copies (as state_dict() does) and the copy allocates its state
    buffers through its own allocator again: the copy is paged like the original, and holds the same values."""
    made, prefetched = fake_managed
    params = make_params([(400, 250), (80, 70)])
    opt = hf_optim.PagedAdamW8bit(params)
    run_steps(opt, params, 2)
    made.clear()
    both = (params, opt)
    copied_params, copied = copy.deepcopy(both) if how == "deepcopy" else pickle.loads(pickle.dumps(both))
    state, original = copied.state[copied_params[0]], opt.state[params[0]]
    buffers = [state["state1"].untyped_storage().data_ptr(), state["state2"].untyped_storage().data_ptr()]
    assert [t.untyped_storage().data_ptr() for t in made] == buffers
    assert not paging.is_paged_tensor(copied.state[copied_params[1]]["state1"])  # below the paging threshold
    for key, value in original.items():
        assert torch.equal(state[key], value) if isinstance(value, torch.Tensor) else state[key] == value, key
    prefetched.clear()
    step = run_with_free(copied, copied_params, 0, 1, 2)
    run_with_free(copied, copied_params, PLENTY, 1, step)  # the first step after a shortage prefetches
    assert prefetched == buffers


def test_unpaged_optimizer_never_pages(fake_managed):
    made, prefetched = fake_managed
    params = make_params([(400, 250)])
    opt = hf_optim.AdamW8bit(params)
    run_with_free(opt, params, PLENTY, 1, run_with_free(opt, params, 0, 1, 0))
    assert made == [] and prefetched == []


def test_bitsandbytes_paged_marker_is_counted_on_its_gpu():
    state = torch.zeros(1000, dtype=torch.uint8)
    state.is_paged, state.page_deviceid = True, 1  # how bitsandbytes marks the CPU view of its managed buffers
    opt = torch.optim.SGD(make_params([(10,)]))
    opt.state[opt.param_groups[0]["params"][0]] = {"state1": state}
    memory = hf_optim.state_memory(opt)
    assert memory.paged_bytes == 1000 and memory.by_device == {"cuda:1": 1000}


def test_unavailable_reasons_name_the_device():
    assert "cpu has none" in paging.paging_unavailable_reason("cpu")
    assert "meta has none" in paging.paging_unavailable_reason("meta")
