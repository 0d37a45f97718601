"""Muon step time and state bytes, side by side in one run: torch.optim.Muon, hf_optim's Muon in 32/8/4-bit, and
hf_optim's AdamW8bit, on the shape sets of benchmarks/performance/step_time.py.

    python benchmarks/performance/muon_step.py  # CPU: quickstart-lora and llama-3.2-1b-lora
    python benchmarks/performance/muon_step.py --sets 4096x4096 --steps 3       # the 16.8M-element matrix (slow on CPU)
    python benchmarks/performance/muon_step.py --device cuda --sets 4096x4096,llama-3.2-1b-lora

Prints per set and optimizer: ms per step (median of ``--steps`` timed steps after ``--warmup``), ``x torch`` (row
/ torch.optim.Muon, same run) and optimizer-state bytes per parameter element (``hf_optim.state_memory``; torch's
momentum buffers counted directly). Every tensor in the sets is 2-D, so every one takes the Muon rule.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from step_time import shape_set  # noqa: E402  (benchmarks/ is a directory of scripts)

import hf_optim  # noqa: E402
from hf_optim.kernels.torch_path import cpu_compile  # noqa: E402

OPTIMIZERS = {
    "torch.optim.Muon": lambda params: torch.optim.Muon(params, lr=0.02),
    "hf_optim Muon32bit": lambda params: hf_optim.Muon32bit(params, lr=0.02),
    "hf_optim Muon8bit": lambda params: hf_optim.Muon8bit(params, lr=0.02),
    "hf_optim Muon4bit": lambda params: hf_optim.Muon4bit(params, lr=0.02),
    # Muon's AdamW rule on every tensor: the route LoRA adapters take by default (muon_lora=False)
    "hf_optim Muon8bit (AdamW side)": lambda params: hf_optim.Muon8bit([{"params": params, "use_muon": False}],
                                                                      lr=1e-3),
    "hf_optim AdamW8bit": lambda params: hf_optim.AdamW8bit(params, lr=1e-3),
}


def state_bytes(opt: torch.optim.Optimizer) -> int:
    if isinstance(opt, hf_optim.HfOptimizer):
        return hf_optim.state_memory(opt).total_bytes
    return sum(v.nbytes for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))


def time_steps(build, shapes, device: str, warmup: int, steps: int) -> tuple[float, float]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in shapes]
    grads = [torch.randn(s, generator=gen).to(device) for s in shapes]
    for p, g in zip(params, grads):
        p.grad = g
    opt = build(params)
    times = []
    for index in range(warmup + steps):
        if index == 1 and device == "cpu":  # the first step started the background compiles: time compiled steps
            cpu_compile.wait()
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        opt.step()
        if device == "cuda":
            torch.cuda.synchronize()
        if index >= warmup:
            times.append(time.perf_counter() - start)
    numel = sum(p.numel() for p in params)
    return statistics.median(times) * 1e3, state_bytes(opt) / numel


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", default="quickstart-lora,llama-3.2-1b-lora")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--only", default=None, help="hf_optim rows to run, by name, separated by commas "
                        "(torch.optim.Muon, the reference, always runs)")
    args = parser.parse_args(argv)
    chosen = {name: build for name, build in OPTIMIZERS.items() if name == "torch.optim.Muon" or args.only is None
              or name in args.only.split(",")}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {args.device}")
    print("| set | optimizer | ms/step | x torch | state B/param |\n|---|---|---|---|---|")
    for spec in args.sets.split(","):
        shapes = shape_set(spec)
        reference = None
        for name, build in chosen.items():
            ms, per_param = time_steps(build, shapes, args.device, args.warmup, args.steps)
            reference = reference or ms
            print(f"| {spec} | {name} | {ms:.1f} | {ms / reference:.2f} | {per_param:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
