"""A tiny Llama-3-shaped model and synthetic data, built locally: for examples, tests and smoke runs offline."""

from __future__ import annotations

from pathlib import Path

import torch


def tiny_llama_config(vocab_size: int = 512, hidden_size: int = 64, layers: int = 2, heads: int = 4,
                      kv_heads: int = 2, intermediate_size: int | None = None, max_positions: int = 256):
    """A ``LlamaConfig`` with Llama 3 traits: GQA, rope_theta 500000, tied embeddings, RMSNorm eps 1e-5.

    Args:
        vocab_size (int, default 512): embedding rows.
        hidden_size (int, default 64): model width.
        layers (int, default 2): decoder layers.
        heads (int, default 4): attention heads.
        kv_heads (int, default 2): key/value heads (GQA when fewer than ``heads``).
        intermediate_size (int | None, default None): MLP width; None means ``3 * hidden_size``.
        max_positions (int, default 256): ``max_position_embeddings``.
    """
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or hidden_size * 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
    )


def tiny_llama(seed: int = 0, vocab_size: int = 512, hidden_size: int = 64, layers: int = 2):
    """A randomly initialised ``LlamaForCausalLM`` with Llama 3 traits (GQA, rope_theta 500000, tied embeddings).

    Every linear weight has at least 4096 elements, so 8-bit optimizers really keep 8-bit state for them.
    """
    from transformers import LlamaForCausalLM

    config = tiny_llama_config(vocab_size=vocab_size, hidden_size=hidden_size, layers=layers)
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


# ------------------------------------------------------------------------------------------------------------
# The bundled chat data, tokenizer and model of ``recipes/quickstart.yaml`` and of smoke mode.
BUILTIN_MODEL = "builtin:tiny-llama-3"
"""Recipe ``model.id`` of the tiny model built locally (never downloaded)."""
BUILTIN_DATA = "builtin:tiny-chat"
"""Recipe ``data.path`` of the chat dataset shipped in the package."""
TINY_CHAT_SHAPE = dict(hidden_size=256, layers=2, heads=4, kv_heads=2, intermediate_size=768, max_positions=512)
"""The builtin model's shape: 2.1M parameters, small enough for 4-bit QLoRA steps on a CPU. With 2 KV heads of
64, the narrowest projection (k/v, 256 -> 128) gives rank-32 LoRA tensors of 4096 elements: every trainable LoRA
tensor of the quickstart reaches ``min_8bit_size``, so 8-bit optimizers keep real 8-bit state there."""

DATA_DIR = Path(__file__).parent / "data"
CHAT_FILE = DATA_DIR / "tiny_chat.jsonl"
TOKENIZER_DIR = DATA_DIR / "tiny_tokenizer"
LLAMA3_SPECIAL_TOKENS = [BOS, EOS, "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", PAD]
# Llama 3's chat layout (header tokens around the role, <|eot_id|> after each turn), written for this tokenizer.
LLAMA3_CHAT_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

_WORDS = ["apple", "river", "garden", "window", "planet", "yellow", "silver", "market", "bridge", "forest",
          "candle", "rocket", "pencil", "orange", "island", "winter", "summer", "castle", "button", "dragon",
          "mirror", "pocket", "ladder", "bottle", "kitten", "number", "letter", "travel", "engine", "meadow"]


def _chat_example(rng) -> list[dict]:
    """One user/assistant exchange with a checkable answer (arithmetic, reversal, capitals, counting, ordering)."""
    kind = rng.randrange(6)
    word = rng.choice(_WORDS)
    a, b, c = rng.randrange(2, 60), rng.randrange(2, 60), rng.randrange(2, 60)
    if kind == 0:
        question, answer = f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    elif kind == 1:
        question, answer = f"Reverse the word '{word}'.", f"'{word}' reversed is '{word[::-1]}'."
    elif kind == 2:
        question, answer = f"Write '{word}' in capital letters.", f"{word.upper()}"
    elif kind == 3:
        question, answer = f"How many letters are in '{word}'?", f"'{word}' has {len(word)} letters."
    elif kind == 4:
        question, answer = f"Which is larger, {a} or {b}?", (f"{max(a, b)} is larger." if a != b else "They are equal.")
    else:
        ordered = ", ".join(str(n) for n in sorted((a, b, c)))
        question, answer = f"Sort these numbers: {a}, {b}, {c}.", f"In order: {ordered}."
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def tiny_chat_examples(count: int = 600, seed: int = 0) -> list[dict]:
    """Chat examples (``{"messages": [...]}``) with correct answers, the content of the bundled ``tiny_chat.jsonl``."""
    import random

    rng = random.Random(seed)
    return [{"messages": _chat_example(rng)} for _ in range(count)]


def train_chat_tokenizer(texts: list[str], vocab_size: int = 768):
    """A byte-level BPE tokenizer trained on ``texts``, with Llama 3's special tokens and chat layout.

    Args:
        texts (list[str]): training text.
        vocab_size (int, default 768): size including the 256 byte tokens and the special tokens.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=LLAMA3_SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=BOS, eos_token="<|eot_id|>",
                                        pad_token=PAD)
    tokenizer.chat_template = LLAMA3_CHAT_TEMPLATE
    tokenizer.model_max_length = TINY_CHAT_SHAPE["max_positions"]
    return tokenizer


def write_bundled_chat_data(data_dir: Path = DATA_DIR) -> None:
    """(Re)write the bundled dataset and tokenizer; the shipped files are this function's output."""
    import json

    examples = tiny_chat_examples()
    data_dir.mkdir(parents=True, exist_ok=True)
    with open(data_dir / CHAT_FILE.name, "w") as f:
        f.writelines(json.dumps(example) + "\n" for example in examples)
    texts = [turn["content"] for example in examples for turn in example["messages"]]
    train_chat_tokenizer(texts).save_pretrained(data_dir / TOKENIZER_DIR.name)


def bundled_tokenizer():
    """The tokenizer shipped in the package (see :func:`write_bundled_chat_data`)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))


def save_builtin_model(path: str | Path, seed: int = 0) -> Path:
    """Write the randomly initialised builtin model (:data:`TINY_CHAT_SHAPE`, vocabulary of the bundled
    tokenizer) to ``path`` so that it loads with ``from_pretrained`` like any checkpoint (quantization included)."""
    from transformers import LlamaForCausalLM

    tokenizer = bundled_tokenizer()
    config = tiny_llama_config(vocab_size=len(tokenizer), **TINY_CHAT_SHAPE)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = (
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(path)
    return Path(path)


CACHE_ENV = "HF_OPTIM_CACHE"


def cache_dir() -> Path:
    """Where hf_optim keeps what it builds once: ``$HF_OPTIM_CACHE``, else ``$XDG_CACHE_HOME/hf_optim``, else
    ``~/.cache/hf_optim``."""
    import os

    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "hf_optim"


def builtin_model_dir(seed: int = 0) -> Path:
    """The builtin model saved once (with the bundled tokenizer) in :func:`cache_dir`, loadable by path.

    A lasting directory, not a temporary one: an adapter trained on it records this path as its base model, and
    peft, when it saves the adapter, reads the base model's config there (to tell whether the vocabulary was
    resized). The name holds what the files depend on (shape, vocabulary, seed, transformers' version), so another
    version never reads files it did not write; a new directory is written whole, then renamed into place.
    """
    import hashlib
    import json
    import shutil
    import tempfile

    import transformers

    tokenizer = bundled_tokenizer()
    key = json.dumps([TINY_CHAT_SHAPE, len(tokenizer), seed, transformers.__version__], sort_keys=True)
    target = cache_dir() / f"tiny-llama-3-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tiny-llama-3-", dir=target.parent))
    try:
        save_builtin_model(staging, seed)
        tokenizer.save_pretrained(staging)
        try:
            staging.rename(target)
        except OSError:  # another process put it there first: theirs is the same
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def builtin_data_dir() -> Path:
    """A directory in :func:`cache_dir` that holds only the bundled chat data (``tiny_chat.jsonl``), written on first
    use: ``datasets.load_dataset(DIR)`` and ``trl sft --dataset_name DIR`` read a directory of data files, while a
    path to one ``.jsonl`` file is no dataset name for them (and the package's own data directory holds the
    tokenizer's JSON files too)."""
    import os
    import tempfile

    target = cache_dir() / "tiny-chat"
    data = CHAT_FILE.read_bytes()
    path = target / CHAT_FILE.name
    if path.is_file() and path.read_bytes() == data:
        return target
    target.mkdir(parents=True, exist_ok=True)
    handle, staging = tempfile.mkstemp(prefix=".tiny_chat-", dir=target)
    with os.fdopen(handle, "wb") as f:
        f.write(data)
    os.replace(staging, path)  # whole or not at all, for a reader in another process
    return target


USAGE = """usage: python -m hf_optim.tiny {model,data}

Print the path of the builtin tiny model (a directory from_pretrained loads: config, weights and the bundled
tokenizer) or of a directory holding the bundled chat data, each written once into hf_optim's cache
($HF_OPTIM_CACHE, else ~/.cache/hf_optim). For command lines that take paths, e.g.:
  hf-optim run -- trl sft --model_name_or_path "$(python -m hf_optim.tiny model)" \\
      --dataset_name "$(python -m hf_optim.tiny data)" --optim lamb_8bit ..."""


def main(argv: list[str] | None = None) -> int:
    """``python -m hf_optim.tiny model|data``: print the path (see :data:`USAGE`); returns the exit status."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    if args in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    if args not in (["model"], ["data"]):
        print(f"{USAGE}\n\npython -m hf_optim.tiny: error: give one of: model, data", file=sys.stderr)
        return 2
    print(builtin_model_dir() if args == ["model"] else builtin_data_dir())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
