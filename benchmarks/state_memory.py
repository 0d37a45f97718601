"""Optimizer-state bytes per parameter after one real training step, per optimizer, side by side in one run.

A Llama-3-shaped model (GQA, tied embeddings) of about 120M parameters is built on the CPU from a config (no
download), fully fine-tuned for one step on random tokens with each optimizer, and ``hf_optim.state_memory`` of
the optimizer is read (torch's AdamW is measured the same way: its ``exp_avg``/``exp_avg_sq`` in the parameter
dtype, plus its step tensors).

    python benchmarks/state_memory.py [--dtype bf16]
"""

from __future__ import annotations

import argparse

import torch

import hf_optim
from hf_optim.tiny import tiny_llama_config

OPTIMIZERS = {
    "torch AdamW": lambda params: torch.optim.AdamW(params, lr=1e-5),
    "hf_optim AdamW32bit": lambda params: hf_optim.AdamW32bit(params, lr=1e-5),
    "hf_optim AdamW8bit": lambda params: hf_optim.AdamW8bit(params, lr=1e-5),
    "hf_optim AdamW4bit": lambda params: hf_optim.AdamW4bit(params, lr=1e-5),
    "hf_optim Lion4bit": lambda params: hf_optim.Lion4bit(params, lr=1e-5),
    "hf_optim AdEMAMix4bit": lambda params: hf_optim.AdEMAMix4bit(params, lr=1e-5),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16", help="parameter dtype (default bf16)")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    from transformers import LlamaForCausalLM

    config = tiny_llama_config(vocab_size=32000, hidden_size=1024, layers=8, heads=16, kv_heads=4,
                               intermediate_size=2816)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(dtype)
    n = sum(p.numel() for p in model.parameters())
    tokens = torch.randint(0, config.vocab_size, (1, 32))
    print(f"Llama-3-shaped model: {n / 1e6:.1f}M parameters ({args.dtype}), full fine-tune, one step\n")
    print("| optimizer | state MiB | state bytes / param | by dtype |")
    print("|---|---:|---:|---|")
    for name, factory in OPTIMIZERS.items():
        optimizer = factory(model.parameters())
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        memory = hf_optim.state_memory(optimizer)
        by_dtype = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in sorted(memory.by_dtype.items()))
        print(f"| {name} | {memory.total_bytes / 2**20:.1f} | {memory.total_bytes / n:.3f} | {by_dtype} |",
              flush=True)
        del optimizer


if __name__ == "__main__":
    main()
