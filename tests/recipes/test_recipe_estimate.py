"""``hf-optim validate``'s memory estimate against independent counts: a real model's tensors, the optimizer's
real state after a step, and the byte formulas worked by hand."""

from __future__ import annotations

import math

import pytest
import torch

import hf_optim
from hf_optim.recipes import load_recipe
from hf_optim.recipes.estimate import TensorCount, estimate, known_architecture, state_bytes
from hf_optim.tiny import TINY_CHAT_SHAPE, bundled_tokenizer, tiny_llama_config


def real_tiny_model():
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(tiny_llama_config(vocab_size=len(bundled_tokenizer()), **TINY_CHAT_SHAPE))


def test_full_fine_tune_matches_a_real_model_and_its_real_optimizer_state():
    recipe = load_recipe("quickstart", ["quantization=null", "peft=null", "training.optim=adamw_8bit"])
    est = estimate(recipe)
    model = real_tiny_model()
    params = list(model.parameters())
    assert est.total_params == est.trainable_params == sum(p.numel() for p in params)
    assert est.weights_bytes == est.gradient_bytes == sum(4 * p.numel() for p in params)  # fp32

    hf_optim.integrations.transformers.keep_embeddings_32bit(model)  # what the Trainer does for 8-bit names
    optimizer = hf_optim.AdamW8bit(model.parameters(), lr=1e-3)
    model(input_ids=torch.randint(0, 100, (1, 8)), labels=torch.randint(0, 100, (1, 8))).loss.backward()
    optimizer.step()
    measured = hf_optim.state_memory(optimizer)
    assert measured.total_bytes == est.state_bytes
    assert measured.by_dtype["uint8"] == sum(2 * p.numel() for p in params if p.numel() >= 4096 and p.dim() == 2
                                             and p is not model.model.embed_tokens.weight)


def test_lora_trainable_count_and_adamw_state_match_peft_on_a_real_model():
    from peft import LoraConfig, get_peft_model

    recipe = load_recipe("quickstart", ["quantization=null", "training.optim=adamw_torch"])
    est = estimate(recipe)
    model = get_peft_model(real_tiny_model(), LoraConfig(task_type="CAUSAL_LM", **recipe.peft))
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert est.trainable_params == sum(p.numel() for p in trainable)
    assert est.gradient_bytes == 4 * est.trainable_params  # fp32 adapters
    assert est.state_bytes == 2 * 4 * est.trainable_params  # torch AdamW: exp_avg, exp_avg_sq in fp32


def test_llama_3_1_8b_figures_by_hand():
    hidden, inter, layers, kv, vocab = 4096, 14336, 32, 1024, 128256
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter + 2 * hidden
    total = 2 * vocab * hidden + layers * per_layer + hidden  # untied embeddings and head, final norm
    full = estimate(load_recipe("llama-3.1-8b-full", ["training.optim=adamw_torch"]))
    assert full.total_params == full.trainable_params == total == 8_030_261_248
    assert "bundled Llama 3.x architecture values" in full.config_source
    assert full.weights_bytes == full.gradient_bytes == 2 * total  # bf16
    assert full.state_bytes == 2 * 2 * total  # torch AdamW keeps its two states in bf16

    paged = estimate(load_recipe("llama-3.1-8b-full", ["training.optim=paged_adamw_8bit"]))
    embed = vocab * hidden
    norms = [hidden] * (2 * layers + 1)  # 4096 elements: just reaches min_8bit_size, so 8-bit
    eight_bit = ([hidden * hidden] * 2 * layers + [hidden * kv] * 2 * layers + [hidden * inter] * 3 * layers
                 + [embed] + norms)  # the untied lm_head is a Linear: 8-bit; the input embedding keeps fp32 state
    expected = 8 * embed + sum(2 * (n + 4 * math.ceil(n / 256) + 1024) for n in eight_bit)
    assert paged.state_bytes == expected

    # LoRA r16 on all linear layers: 41.9M trainable (the published figure)
    lora = estimate(load_recipe("llama-3.1-8b-qlora"))
    assert lora.trainable_params == layers * 16 * (2 * (hidden + hidden) + 2 * (hidden + kv) + 3 * (hidden + inter))
    assert lora.trainable_params == 41_943_040
    assert lora.gradient_bytes == 2 * lora.trainable_params  # bf16 QLoRA adapters


def test_qlora_weights_are_4bit_with_double_quant_constants():
    est = estimate(load_recipe("llama-3.2-1b-qlora"))
    hidden, inter, layers, kv, vocab = 2048, 8192, 16, 512, 128256
    linear = [hidden * hidden] * 2 + [hidden * kv] * 2 + [hidden * inter] * 3
    quantized = 0
    for n in linear * layers:
        blocks = n // 64
        quantized += n // 2 + blocks + 4 * math.ceil(blocks / 256)
    bf16 = 2 * (vocab * hidden + layers * 2 * hidden + hidden)  # tied embedding/head and norms stay bf16
    assert est.weights_bytes - 2 * est.trainable_params == quantized + bf16  # adapters in bf16


@pytest.mark.parametrize("optim,slot_rows,bits", [("adamw_32bit", [1, 1], 32), ("lion_32bit", [1], 32),
                                                  ("ademamix", [2, 1], 32), ("adamw_8bit", [1, 1], 8),
                                                  ("paged_ademamix_8bit", [2, 1], 8), ("lion_8bit", [1], 8),
                                                  ("lamb_8bit", [1, 1], 8), ("rmsprop_bnb", [1], 32)])
def test_state_bytes_per_name(optim, slot_rows, bits):
    big = TensorCount(256 * 64, 2, (256, 64), False)
    # 8-bit, per slot: 1 byte and an absmax per 256 elements for each of its rows, and one 256-entry fp32 map
    per_slot = [rows * (big.numel + 4 * 64) + 1024 if bits == 8 else rows * 4 * big.numel for rows in slot_rows]
    assert state_bytes(optim, [big]) == sum(per_slot)
    # under 4096 elements, and embeddings, state stays fp32 whatever the name
    small = TensorCount(100, 2, (100,), False)
    embedding = TensorCount(256 * 64, 2, (256, 64), True)
    assert state_bytes(optim, [small]) == sum(slot_rows) * 4 * 100
    assert state_bytes(optim, [embedding]) == sum(slot_rows) * 4 * embedding.numel


def test_adafactor_state_is_factored():
    matrix = TensorCount(300 * 500, 2, (300, 500), False)
    vector = TensorCount(500, 2, (500,), False)
    assert state_bytes("adafactor", [matrix, vector]) == 4 * (300 + 500) + 4 + 4 * 500 + 4
    assert state_bytes("adafactor_8bit", [matrix]) == 4 * (300 + 500) + 4 + matrix.numel + 4 * math.ceil(
        matrix.numel / 256) + 1024
    assert state_bytes("galore_adamw", [matrix]) is None  # no state model: reported as unknown


def test_known_architectures_by_id():
    assert known_architecture("meta-llama/Llama-3.2-1B-Instruct")["hidden_size"] == 2048
    assert known_architecture("unsloth/Meta-Llama-3.1-8B")["intermediate_size"] == 14336
    assert known_architecture("someone/other-model") is None
