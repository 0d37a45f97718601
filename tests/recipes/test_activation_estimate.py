"""The activation estimate (hf_optim.recipes.activations) calibrated on CPU against the tiny Llama in bf16: the bytes
the forward really saves for backward (saved-tensor hooks), and the peak of the CPU allocator's own allocation
events over a forward and backward (torch.profiler, profile_memory=True)."""

from __future__ import annotations

import pytest
import torch

from hf_optim.recipes.activations import DecoderShape, backward_peak_bytes
from hf_optim.tiny import tiny_llama_config

SAVED_TOLERANCE = 0.02  # the estimate leaves out RoPE's cos/sin (shared by every layer) and 0-d tensors
PEAK_TOLERANCE = 0.05  # the allocator's peak also holds small autograd buffers the estimate does not model
BATCH, SEQ = 2, 64


def tiny_bf16_model(checkpointing: bool, kv_heads: int = 2, tied: bool = True):
    from transformers import LlamaForCausalLM

    config = tiny_llama_config(vocab_size=2000, hidden_size=256, layers=2, heads=4, kv_heads=kv_heads,
                               intermediate_size=768)
    config.tie_word_embeddings = tied
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    if checkpointing:  # reentrant: the checkpoint keeps each layer's input with save_for_backward, which hooks see
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    return model, config


def measured_saved_bytes(model, ids) -> int:
    """Bytes of distinct storages saved for backward by one forward, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(input_ids=ids, labels=ids)
    return sum(saved.values())


def measured_peak_bytes(model, ids) -> int:
    """The highest total of live CPU allocations during a forward and backward (weights not included)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model(input_ids=ids, labels=ids).loss.backward()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("checkpointing", [False, True])
def test_saved_bytes_match_the_tensors_a_forward_saves(checkpointing):
    model, config = tiny_bf16_model(checkpointing)
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ))
    measured = measured_saved_bytes(model, ids)
    estimated = BATCH * SEQ * DecoderShape.from_config(config).saved_bytes(checkpointing)
    assert abs(estimated - measured) <= SAVED_TOLERANCE * measured, (estimated, measured)


@pytest.mark.parametrize("checkpointing,kv_heads,tied", [(False, 2, True), (True, 2, True), (False, 1, False),
                                                        (True, 1, False)])
def test_backward_peak_matches_the_allocator(checkpointing, kv_heads, tied):
    model, config = tiny_bf16_model(checkpointing, kv_heads, tied)
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ))
    model(input_ids=ids, labels=ids).loss.backward()  # warm up: first-call allocations are not the step's
    model.zero_grad(set_to_none=True)
    measured = measured_peak_bytes(model, ids)
    estimated = backward_peak_bytes(DecoderShape.from_config(config), BATCH * SEQ, checkpointing, release=False)
    assert abs(estimated - measured) <= PEAK_TOLERANCE * measured, (estimated, measured)
