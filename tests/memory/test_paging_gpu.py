"""Paged optimizers on a CUDA GPU: managed state, no added synchronization, resume stays paged, eviction.

Run on a GPU machine with ``python -m pytest -m gpu tests/memory/test_paging_gpu.py -q``. Every test checks the card's
free memory before it asks for managed memory and asks for far less (a shared GPU can hang when managed memory is
oversubscribed); memory pressure is made with ordinary device allocations only.
"""

import io
import warnings

import pytest
import torch
from helpers import make_params

import hf_optim
from hf_optim.paging import PAGED_MIN_NUMEL, cudart, is_paged_tensor, managed

pytestmark = pytest.mark.gpu

# One managed-sized tensor, two that stay ordinary device memory: paged means at least PAGED_MIN_NUMEL = 1e5
# elements (bitsandbytes' get_state_buffer: ``p.numel() < 1e5`` stays unpaged; spec section 4), so the second is
# 256 x 300 = 76,800 elements (it was 512 x 300 = 153,600, which is paged by design and counted by state_memory).
SHAPES = [(1024, 1024), (256, 300), (300,)]


def require_free(nbytes: int) -> None:
    free, _ = torch.cuda.mem_get_info()
    if nbytes > free // 4:
        pytest.skip(f"needs {nbytes} bytes of managed memory; the card has {free} free (refusing above a quarter)")


def cuda_params(shapes, seed=0):
    return [torch.nn.Parameter(p.detach().cuda()) for p in make_params(shapes, seed=seed)]


def set_cuda_grads(params, step):
    gen = torch.Generator().manual_seed(10_000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).cuda()


def run(opt, params, steps, start=0):
    for step in range(start, start + steps):
        set_cuda_grads(params, step)
        opt.step()


def is_managed_pointer(tensor):
    return managed.runtime().pointer_type(tensor.data_ptr()) == cudart.MEMORY_TYPE_MANAGED


@pytest.mark.parametrize("name", ["AdamW8bit", "AdEMAMix8bit", "Lion32bit", "LAMB8bit", "AdamW32bit"])
def test_large_state_is_managed_counted_and_the_math_is_the_twins(name):
    require_free(3 * 4 * 2**20 * 4)
    paged_cls, plain_cls = getattr(hf_optim, "Paged" + name), getattr(hf_optim, name)
    paged_params, plain_params = cuda_params(SHAPES), cuda_params(SHAPES)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="hf_optim: paged")  # paging is available here: no fallback
        paged = paged_cls(paged_params)
        run(paged, paged_params, 3)
    plain = plain_cls(plain_params)
    run(plain, plain_params, 3)
    for a, b in zip(paged_params, plain_params):
        assert torch.equal(a, b)

    big, small = paged.state[paged_params[0]], paged.state[paged_params[1]]
    assert big["state1"].device == paged_params[0].device
    for key in [k for k in ("state1", "state2") if k in big]:
        assert is_managed_pointer(big[key]) and is_paged_tensor(big[key])
        assert not is_paged_tensor(small[key]) and not is_managed_pointer(small[key])
    expected = sum(big[k].numel() * big[k].element_size() for k in ("state1", "state2") if k in big)
    assert hf_optim.state_memory(paged).paged_bytes == expected
    assert hf_optim.state_memory(paged).by_device.keys() == {"cuda:0"}


def test_managed_state_is_invisible_to_torchs_allocator():
    require_free(2 * 4 * 2**20)
    params = cuda_params([(2048, 2048)])
    opt = hf_optim.PagedAdamW8bit(params)
    set_cuda_grads(params, 0)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    opt.step()
    torch.cuda.synchronize()
    paged = hf_optim.state_memory(opt).paged_bytes
    assert paged == 2 * 2048 * 2048
    assert torch.cuda.memory_allocated() - before < paged // 4  # only absmax and maps are torch allocations


def test_paging_adds_no_synchronization():
    """torch's sync debug mode counts synchronizing calls; the paged step makes no more than the unpaged one (none).

    Only the sync warning itself is counted ("called a synchronizing CUDA operation"): the first switch to a debug
    mode in a process also warns once that the mode "does not yet detect all synchronizing operations", which the
    count of "synchronizing" took for a sync of whichever optimizer ran first (counts [1, 0] on an H200)."""
    require_free(2 * 2**20 * 4)
    counts = []
    for cls in (hf_optim.AdamW8bit, hf_optim.PagedAdamW8bit):
        params = cuda_params([(1024, 1024)])
        opt = cls(params)
        run(opt, params, 1)
        set_cuda_grads(params, 1)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                opt.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts.append(sum("called a synchronizing CUDA operation" in str(w.message) for w in caught))
    assert counts == [0, 0]


def count_prefetches(monkeypatch) -> list:
    calls = []
    real = managed.prefetch
    monkeypatch.setattr(managed, "prefetch", lambda runtime, tensor: (calls.append(tensor), real(runtime, tensor)))
    return calls


def test_prefetch_only_when_a_memory_shortage_ends(monkeypatch):
    """With room to spare a step makes no cudaMemPrefetchAsync (about 40 us of host time each), nor while the device
    is reported short (page faults bring pages back); the first step with room again prefetches every managed
    buffer, once. Results are the unpaged twin's throughout."""
    require_free(2 * 3 * 2**20 * 4)
    assert not hf_optim.paging.short_of_memory(torch.cuda.mem_get_info()[0], 2 * 2**20)
    params, plain_params = cuda_params(SHAPES), cuda_params(SHAPES)
    opt, plain = hf_optim.PagedAdamW8bit(params), hf_optim.AdamW8bit(plain_params)
    run(opt, params, 1)
    run(plain, plain_params, 5)
    calls = count_prefetches(monkeypatch)
    run(opt, params, 1, start=1)
    with monkeypatch.context() as patch:
        patch.setattr(hf_optim.paging, "free_device_bytes", lambda device: 0)
        run(opt, params, 1, start=2)
    assert calls == []
    run(opt, params, 2, start=3)
    state = opt.state[params[0]]
    assert sorted(t.untyped_storage().data_ptr() for t in calls if managed.is_managed(t)) == sorted(
        state[k].untyped_storage().data_ptr() for k in ("state1", "state2")
    )
    for a, b in zip(params, plain_params):
        assert torch.equal(a, b)


def test_resume_keeps_state_managed_and_bit_exact():
    require_free(4 * 3 * 2**20 * 4)
    straight = cuda_params(SHAPES)
    straight_opt = hf_optim.PagedAdEMAMix8bit(straight)
    run(straight_opt, straight, 4)

    first = cuda_params(SHAPES)
    first_opt = hf_optim.PagedAdEMAMix8bit(first)
    run(first_opt, first, 2)
    saved = first_opt.state_dict()
    assert all(
        t.device.type == "cpu"
        for s in saved["state"].values()
        for t in [*s.values(), *s.get("__bnb_optimizer_quant_state__", {}).values()]
        if isinstance(t, torch.Tensor)
    )
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in first]
    resumed_opt = hf_optim.PagedAdEMAMix8bit(resumed)
    resumed_opt.load_state_dict(torch.load(buffer, weights_only=True))
    state = resumed_opt.state[resumed[0]]
    assert is_managed_pointer(state["state1"]) and is_managed_pointer(state["state2"])
    assert state["absmax1"].device == resumed[0].device and not is_paged_tensor(state["absmax1"])
    assert hf_optim.state_memory(resumed_opt).paged_bytes == hf_optim.state_memory(first_opt).paged_bytes
    run(resumed_opt, resumed, 2, start=2)
    for a, b in zip(straight, resumed):
        assert torch.equal(a, b)


def test_results_unchanged_when_ordinary_allocations_crowd_the_state_out():
    """Fill the card with ordinary allocations until only about half of the managed state can be resident: steps
    still give the unpaged twin's results (pages are evicted to host, brought back by page faults while the device is
    short, and prefetched back in bulk at the first step after the fillers are gone). The fillers take all the
    free memory and half of what the resident managed state occupies (free memory does not count resident managed
    pages: leaving half the state's size free, as this test first did, evicted nothing)."""
    shapes = [(8192, 8192)] * 4  # 4 x 67M elements, 32-bit AdamW: 2.1 GB of managed state
    state_bytes = 4 * 2 * 8192 * 8192 * 4
    require_free(state_bytes)
    plain_params = cuda_params(shapes)
    plain = hf_optim.AdamW32bit(plain_params)
    run(plain, plain_params, 3)
    expected = [p.detach().cpu() for p in plain_params]
    del plain, plain_params
    torch.cuda.empty_cache()

    params = cuda_params(shapes)
    opt = hf_optim.PagedAdamW32bit(params)
    run(opt, params, 1)  # the update's temporaries are now cached by torch's allocator
    torch.cuda.synchronize()
    fillers = fill_device(leave=-(state_bytes // 2))
    try:
        assert hf_optim.paging.short_of_memory(torch.cuda.mem_get_info()[0], state_bytes)
        run(opt, params, 1, start=1)  # pages come back through page faults
        torch.cuda.synchronize()
    finally:
        del fillers
        torch.cuda.empty_cache()
    run(opt, params, 1, start=2)  # the first step with room again prefetches the state back
    for a, b in zip(params, expected):
        assert torch.equal(a.detach().cpu(), b)


def fill_device(leave: int) -> list[torch.Tensor]:
    """Ordinary device allocations (never managed memory) of the free memory less ``leave`` bytes (a negative
    ``leave`` also takes that much from resident managed pages, which the driver evicts to host)."""
    free, _ = torch.cuda.mem_get_info()
    fillers, remaining, chunk = [], free - leave, 2**30
    while remaining > 2**20 and chunk >= 2**24:
        size = min(remaining, chunk)
        try:
            fillers.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
            remaining -= size
        except torch.OutOfMemoryError:  # the driver would not evict that much: take smaller pieces
            chunk //= 2
    return fillers


def test_fallback_on_cuda_when_managed_memory_is_unavailable(monkeypatch):
    monkeypatch.setattr(managed, "unavailable_reason", lambda device_type, index: "test: no managed memory")
    hf_optim.paging._warned.clear()
    params = cuda_params([(1024, 1024)])
    with pytest.warns(UserWarning, match=r"PagedLion8bit has state on cuda:0 \(test: no managed memory\)"):
        opt = hf_optim.PagedLion8bit(params)
        run(opt, params, 1)
    assert opt.state[params[0]]["state1"].numel() >= PAGED_MIN_NUMEL
    assert not is_paged_tensor(opt.state[params[0]]["state1"])


def test_finetune_peak_is_lower_by_about_the_paged_state():
    """max_memory_allocated of a full step (forward, backward, step) of a small Llama: the paged run's peak is lower
    by about the managed state, which torch's allocator does not see (benchmarks/performance/paged_memory.py does the
    1B)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=4, num_attention_heads=16,
                         num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=True)
    batch = torch.randint(0, config.vocab_size, (1, 256), generator=torch.Generator().manual_seed(0)).cuda()
    peaks, paged = [], 0
    for cls in (hf_optim.AdamW8bit, hf_optim.PagedAdamW8bit):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).cuda().to(torch.bfloat16)
        require_free(2 * sum(p.numel() for p in model.parameters()))
        opt = cls(model.parameters())
        for _ in range(2):  # the peak of the second step, when the state exists
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            model(input_ids=batch, labels=batch).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated())
        paged = max(paged, hf_optim.state_memory(opt).paged_bytes)
        del model, opt
        torch.cuda.empty_cache()
    assert paged > 0
    assert 0.8 * paged <= peaks[0] - peaks[1] <= 1.2 * paged, (peaks, paged)
