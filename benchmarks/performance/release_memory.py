"""Peak CPU memory of a full fine-tuning step of a ~100M-parameter Llama-shaped model, with and without gradient
release, per optimizer; bytes per parameter.

    python benchmarks/performance/release_memory.py  # the table in docs/performance.md#memory-per-parameter
    python benchmarks/performance/release_memory.py --layers 2 --hidden 256 --vocab 4096   # a quick smoke run

What is measured: each configuration runs in a fresh process (``HF_OPTIM_COMPILE=0``: inductor's compile-time
memory is not training memory). The model is built from its config directly in bfloat16 (random weights,
embeddings tied, as Llama 3.2). A warm-up forward+backward loads everything lazy, its gradients are dropped; then
the kernel's peak resident set size of the process (``VmHWM`` in ``/proc/self/status``) is reset through
``/proc/self/clear_refs`` and read after each measured step: peak RSS minus the RSS before the step is the memory
the step added on top of the weights (gradients, optimizer state, activations, temporaries). glibc is told to
serve every allocation of 128 KiB or more by ``mmap`` (``MALLOC_MMAP_THRESHOLD_``), so a freed tensor leaves the
RSS at once and the RSS follows the live tensors instead of the allocator's cache. Step 1 creates the state;
step 2 is a step of steady training (``zero_grad`` between, as the Trainer does).

The optimizers are built on the model's parameters directly (no Trainer), so embeddings get quantized state too;
the Trainer's 8-bit and 4-bit names keep embeddings' state in fp32 (as transformers does for bitsandbytes), which
adds 8 bytes per embedding element. Activations (batch 1 x 128 tokens) are included in the step's peak; the
``forward+backward`` row (no optimizer, gradients kept) shows weights + gradients + activations alone.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CONFIGS = [
    ("forward+backward", None, False),
    ("adamw_torch", "torch.optim.AdamW", False),
    ("adamw_32bit", "hf_optim.AdamW32bit", False),
    ("adamw_32bit", "hf_optim.AdamW32bit", True),
    ("paged_adamw_8bit", "hf_optim.PagedAdamW8bit", False),
    ("paged_adamw_8bit", "hf_optim.PagedAdamW8bit", True),
    ("adamw_4bit", "hf_optim.AdamW4bit", False),
    ("adamw_4bit", "hf_optim.AdamW4bit", True),
]


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def measure(optimizer: str | None, release: bool, vocab: int, hidden: int, layers: int, tokens: int) -> dict:
    """One configuration, in this process (a fresh one: see main)."""
    import gc

    import torch
    from transformers import LlamaForCausalLM

    import hf_optim
    from hf_optim.tiny import tiny_llama_config

    torch.manual_seed(0)
    config = tiny_llama_config(vocab_size=vocab, hidden_size=hidden, layers=layers, heads=hidden // 64,
                               kv_heads=max(1, hidden // 256), intermediate_size=hidden * 8 // 3)
    model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    params = [p for p in model.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in params)
    batch = torch.randint(0, vocab, (1, tokens))

    def forward_backward():
        model(input_ids=batch, labels=batch).loss.backward()

    forward_backward()  # warm-up: lazy imports and kernels
    model.zero_grad(set_to_none=True)
    gc.collect()
    opt = None
    if optimizer == "torch.optim.AdamW":
        opt = torch.optim.AdamW(params, lr=1e-4)
    elif optimizer is not None:
        cls = getattr(hf_optim, optimizer.split(".")[1])
        opt = cls(params, lr=1e-4, release_gradients=release)
    steps = []
    for _ in range(2):
        before = _status("VmRSS")
        _reset_peak()
        forward_backward()
        if opt is not None:
            opt.step()
        peak = _status("VmHWM")
        alive_grads = sum(p.grad is not None for p in params)
        steps.append({"before": before, "peak": peak, "after": _status("VmRSS"), "grads_alive": alive_grads})
        model.zero_grad(set_to_none=True)
        gc.collect()
    return {"numel": numel, "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one configuration, print JSON
    args = parser.parse_args()
    shape = dict(vocab=args.vocab, hidden=args.hidden, layers=args.layers, tokens=args.tokens)
    if args.one:
        optimizer, release = json.loads(args.one)
        print(json.dumps(measure(optimizer, release, **shape)))
        return

    env = {**os.environ, "HF_OPTIM_COMPILE": "0", "MALLOC_MMAP_THRESHOLD_": str(128 * 1024),
           "HF_HUB_OFFLINE": "1"}
    rows = []
    for label, optimizer, release in CONFIGS:
        command = [sys.executable, __file__, *sum(([f"--{k}", str(v)] for k, v in shape.items()), []),
                   "--one", json.dumps([optimizer, release])]
        run = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
        if run.returncode != 0:
            raise SystemExit(f"{label} failed:\n{run.stderr[-3000:]}")
        result = json.loads(run.stdout.strip().splitlines()[-1])
        rows.append((label, release, result))

    numel, weights = rows[0][2]["numel"], rows[0][2]["weight_bytes"]
    print(f"model: Llama-shaped, vocab {args.vocab}, hidden {args.hidden}, {args.layers} layers, "
          f"{numel / 1e6:.1f}M parameters, bf16 weights {weights / 2**20:.0f} MiB ({weights / numel:.1f} B/param); "
          f"batch 1 x {args.tokens} tokens")
    print("peak = kernel's peak RSS during the step (VmHWM) minus RSS before it; B/param = bytes per parameter")
    print()
    # activations (and autograd's temporaries): the forward+backward row's step-2 peak minus its gradients
    plain = rows[0][2]["steps"]
    activations = plain[1]["peak"] - plain[0]["before"] - weights
    print(f"activations of the forward+backward row: {activations / 2**20:.0f} MiB "
          f"({activations / numel:.2f} B/param), subtracted in the last column")
    print()
    print("| setup | release | step-1 peak above weights | B/param above weights | B/param total "
          "| step-2 peak above weights | B/param total (step 2) | gradients alive after the step "
          "| B/param total (step 2) without activations |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, release, result in rows:
        cells = [label, "yes" if release else "no"]
        first, second = result["steps"]
        # both against the RSS before step 1 (weights, libraries): step 2's peak then includes the state
        extra1, extra2 = first["peak"] - first["before"], second["peak"] - first["before"]
        cells += [f"{extra1 / 2**20:.0f} MiB", f"{extra1 / numel:.2f}", f"{(weights + extra1) / numel:.2f}",
                  f"{extra2 / 2**20:.0f} MiB", f"{(weights + extra2) / numel:.2f}", str(second["grads_alive"]),
                  f"{(weights + extra2 - activations) / numel:.2f}"]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
