"""Optimizer-state bytes per parameter after one real training step, per optimizer, side by side in one run.

A Llama-3-shaped model (GQA, tied embeddings) of about 120M parameters is built on the CPU from a config (no
download), fully fine-tuned for one step on random tokens with each optimizer, and ``hf_optim.state_memory`` of
the optimizer is read (torch's AdamW is measured the same way: its ``exp_avg``/``exp_avg_sq`` in the parameter
dtype, plus its step tensors).

    python benchmarks/performance/state_memory.py [--dtype bf16]
    python benchmarks/performance/state_memory.py --sets 4096x4096,llama-3.2-1b-lora  # step_time.py's sets

With ``--sets``, each set's tensors (``benchmarks/performance/step_time.py``'s presets, fp32) get one step of random
gradients with each optimizer instead of the model.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

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
    "hf_optim AdamW4bitBlockwise": lambda params: hf_optim.AdamW4bitBlockwise(params, lr=1e-5),
    "hf_optim Lion4bitBlockwise": lambda params: hf_optim.Lion4bitBlockwise(params, lr=1e-5),
    "hf_optim AdamW4bitRank1": lambda params: hf_optim.AdamW4bitRank1(params, lr=1e-5),
    "hf_optim AdEMAMix4bitRank1": lambda params: hf_optim.AdEMAMix4bitRank1(params, lr=1e-5),
}


def row(name: str, optimizer, n: int) -> str:
    memory = hf_optim.state_memory(optimizer)
    by_dtype = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in sorted(memory.by_dtype.items()))
    return f"| {name} | {memory.total_bytes / 2**20:.1f} | {memory.total_bytes / n:.4f} | {by_dtype} |"


def shape_sets(sets: str) -> None:
    """One step of each optimizer on each of step_time.py's shape sets."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from step_time import shape_set

    for spec in sets.split(","):
        shapes = shape_set(spec)
        n = sum(torch.Size(shape).numel() for shape in shapes)
        print(f"\n{spec}: {len(shapes)} tensors, {n:,} elements, fp32, one step\n")
        print("| optimizer | state MiB | state bytes / param | by dtype |")
        print("|---|---:|---:|---|")
        gen = torch.Generator().manual_seed(0)
        for name, factory in OPTIMIZERS.items():
            params = [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in shapes]
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            optimizer = factory(params)
            optimizer.step()
            print(row(name, optimizer, n), flush=True)
            del optimizer, params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16", help="parameter dtype (default bf16)")
    parser.add_argument("--sets", default="", help="step_time.py's shape sets (comma-separated) instead of the model")
    args = parser.parse_args()
    if args.sets:
        shape_sets(args.sets)
        return
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
        print(row(name, optimizer, n), flush=True)
        del optimizer


if __name__ == "__main__":
    main()
