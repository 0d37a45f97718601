"""CPU cost of one optimizer step, side by side, measured so that a busy machine moves it little: the process's CPU
time (not wall time) per step, one thread, the optimizers' steps interleaved (each round steps every optimizer once),
compiled kernels waited for. A proxy for ``step_time.py`` where other processes share the cores: wall time there
measures the scheduler as much as the step.

    python benchmarks/performance/cpu_time_ratio.py --sets 4096x4096,llama-3.2-1b-lora \\
        --optimizers AdamW8bit,AdamW4bit,AdamW4bitBlockwise,AdamW32bit

Prints, per shape set (``step_time.py``'s), each optimizer's median CPU milliseconds and nanoseconds per element,
and its ratio to the first optimizer named.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_OPTIM_COMPILE", "1")  # compile before the first step: no eager steps timed

import torch  # noqa: E402

import hf_optim  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_time import shape_set  # noqa: E402  (the shape sets are step_time.py's)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sets", default="4096x4096,llama-3.2-1b-lora", help="step_time.py's shape sets")
    parser.add_argument("--optimizers", default="AdamW8bit,AdamW4bit,AdamW4bitBlockwise",
                        help="hf_optim class names; ratios are to the first")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds (default 7)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds after compilation (default 3)")
    args = parser.parse_args(argv)
    names = args.optimizers.split(",")
    unknown = [name for name in names if not hasattr(hf_optim, name)]
    if unknown:
        print(f"error: --optimizers: unknown hf_optim class {unknown[0]!r}")
        return 2
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, process CPU time, load average {os.getloadavg()[0]:.1f} at start")
    for spec in args.sets.split(","):
        shapes = shape_set(spec)
        gen = torch.Generator().manual_seed(0)
        optimizers = {}
        for name in names:
            params = [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in shapes]
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            optimizers[name] = getattr(hf_optim, name)(params, lr=1e-3)
        for opt in optimizers.values():
            for _ in range(args.warmup):
                opt.step()
        times: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(args.rounds):
            for name, opt in optimizers.items():
                start = time.process_time()
                opt.step()
                times[name].append(time.process_time() - start)
        numel = sum(torch.Size(shape).numel() for shape in shapes)
        base = statistics.median(times[names[0]])
        print(f"\n{spec}: {len(shapes)} tensors, {numel:,} elements, load average {os.getloadavg()[0]:.1f}\n")
        print(f"| optimizer | CPU ms / step | ns / element | x {names[0]} |")
        print("|---|---:|---:|---:|")
        for name in names:
            median = statistics.median(times[name])
            print(f"| {name} | {median * 1e3:.1f} | {median * 1e9 / numel:.2f} | {median / base:.2f} |")
        del optimizers
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
