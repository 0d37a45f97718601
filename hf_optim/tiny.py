"""A tiny Llama-3-shaped model and synthetic data, built locally: for examples, tests and smoke runs offline."""

from __future__ import annotations

import torch


def tiny_llama(seed: int = 0, vocab_size: int = 512, hidden_size: int = 64, layers: int = 2):
    """A randomly initialised ``LlamaForCausalLM`` with Llama 3 traits (GQA, rope_theta 500000, tied embeddings).

    Every linear weight has at least 4096 elements, so 8-bit optimizers really keep 8-bit state for them.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 3,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def markov_tokens(batches: int, batch_size: int, seq_len: int, vocab_size: int = 512, seed: int = 0):
    """Token batches from a fixed random sparse Markov chain: learnable structure, no download needed."""
    gen = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, vocab_size, (vocab_size, 4), generator=gen)  # 4 likely next tokens each
    total = batches * batch_size
    tokens = torch.empty(total, seq_len, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab_size, (total,), generator=gen)
    for t in range(1, seq_len):
        choice = torch.randint(0, 4, (total,), generator=gen)
        tokens[:, t] = successors[tokens[:, t - 1], choice]
    return tokens.view(batches, batch_size, seq_len)


def train_tiny(optimizer_factory, steps: int = 100, batch_size: int = 8, seq_len: int = 64, seed: int = 0,
               log_every: int = 0) -> list[float]:
    """Train :func:`tiny_llama` on :func:`markov_tokens` with ``optimizer_factory(model.parameters())``.

    Returns the training loss of every step.
    """
    model = tiny_llama(seed)
    model.train()
    optimizer = optimizer_factory(model.parameters())
    data = markov_tokens(steps, batch_size, seq_len, seed=seed + 1)
    losses = []
    for step, batch in enumerate(data):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)
    return losses


BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>"


def tiny_tokenizer():
    """A byte-level tokenizer (256 byte tokens + Llama 3's special tokens) built locally, for offline runs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=BOS, eos_token=EOS, pad_token=PAD)
    tokenizer.model_max_length = 256
    return tokenizer


def tiny_texts(count: int, seed: int = 0) -> list[str]:
    """Short sentences from a small fixed grammar: structure a tiny model learns within a few steps."""
    import random

    rng = random.Random(seed)
    subjects = ["the cat", "a dog", "my friend", "the model", "our team", "the teacher"]
    verbs = ["reads", "likes", "finds", "builds", "moves", "checks"]
    objects = ["the book", "a red ball", "the small box", "a long list", "the old map", "a new plan"]
    places = ["at home", "in the park", "at work", "on the train", "by the lake"]
    return [f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)} {rng.choice(places)}."
            for _ in range(count)]
