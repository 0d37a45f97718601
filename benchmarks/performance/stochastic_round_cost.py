"""Step-time cost of ``bf16_stochastic_round`` on the CPU path: one bf16 tensor, with and without the option.

    PYTHONPATH=. python benchmarks/performance/stochastic_round_cost.py [--shape 4096x4096] [--steps 10] [--threads 1]

Per variant: the median over ``--steps`` steps (after two warm-up steps, the first of which compiles) of the
step's CPU time (``time.process_time``: every thread of the process, so other jobs on the machine inflate it far
less than wall time) and of its wall time. Variants alternate step by step, so a change in the machine's load
affects both alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import hf_optim


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="4096x4096")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--optim", default="AdamW8bit")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shape = tuple(int(n) for n in args.shape.split("x"))
    cls = getattr(hf_optim, args.optim)
    variants = {}
    for stochastic in (False, True):
        gen = torch.Generator().manual_seed(0)
        param = torch.nn.Parameter(torch.randn(shape, generator=gen).to(torch.bfloat16))
        param.grad = (torch.randn(shape, generator=gen) * 1e-3).to(torch.bfloat16)
        variants[stochastic] = (cls([param], lr=1e-5, bf16_stochastic_round=stochastic), [], [])
    for _ in range(2):
        for opt, _, _ in variants.values():
            opt.step()
    for _ in range(args.steps):
        for opt, cpu, wall in variants.values():
            c, w = time.process_time(), time.perf_counter()
            opt.step()
            cpu.append(time.process_time() - c)
            wall.append(time.perf_counter() - w)
    numel = torch.Size(shape).numel()
    print(f"{args.optim}, one bf16 tensor {args.shape} ({numel / 1e6:.1f}M elements), {args.threads} thread(s), "
          f"median of {args.steps} steps, backend {variants[False][0].backend}")
    base = statistics.median(variants[False][1])
    for stochastic, (_, cpu, wall) in variants.items():
        label = "bf16_stochastic_round=True " if stochastic else "bf16_stochastic_round=False"
        cpu_ms, wall_ms = statistics.median(cpu) * 1e3, statistics.median(wall) * 1e3
        print(f"  {label}: {cpu_ms:8.1f} ms CPU ({cpu_ms * 1e6 / numel:.2f} ns/element), {wall_ms:8.1f} ms wall"
              + ("" if not stochastic else f"   overhead {100 * (statistics.median(cpu) / base - 1):+.0f}% CPU"))


if __name__ == "__main__":
    main()
