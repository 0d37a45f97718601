"""Host (Python) time of one optimizer step on the Triton path, per step and per tensor.

    python benchmarks/performance/host_overhead.py  # CPU: host side only, kernel launches replaced by no-ops
    PYTHONPATH=/work/main python benchmarks/performance/host_overhead.py  # another tree (before/after)
    python benchmarks/performance/host_overhead.py --device cuda  # a GPU: real launches; wall (synced), host, device ms

On CPU (the default) the parameters are CPU tensors, ``HF_OPTIM_BACKEND=triton`` and ``TRITON_INTERPRET=1`` send
them down the Triton path, and ``triton_guard.launch`` is replaced by a no-op: what is timed is everything
``optimizer.step()`` does on the host (planning, grouping, building or refreshing the launch tables, the launch's
argument preparation) except Triton's own launcher (argument binding, the driver call), which only exists on a
GPU. It is Python host time, not GPU time.

Shape sets (``--sets``): ``llama-3.2-1b-lora`` (224 tensors, 11.3M elements, real size), ``4096x4096`` (one tensor,
real size), ``llama-3.2-1b`` (146 tensors; on CPU each dimension is capped at ``--cap`` (default 256) to keep memory
small: the same count of tensors and of distinct shapes, far fewer elements; element counts only change the tables'
values, not the host work; on CUDA the real shapes).

Two gradient modes: ``same`` (the gradients stay the same tensors between steps) and ``new`` (before each step every
``p.grad`` is replaced by another preallocated tensor, alternating between two sets, as
``zero_grad(set_to_none=True)`` followed by backward gives new gradient tensors at new addresses). Replacing the
gradients is not timed.

Prints per set, optimizer and mode: host ms per step (wall clock, median of ``--repeats`` rounds of ``--steps``
steps, after ``--warmup`` steps) and microseconds per tensor; on CPU also the same from the thread's CPU time
(``time.thread_time``: on a busy machine the wall clock also counts the time other processes had the core); on CUDA
synced wall ms and device kernel ms (torch profiler), and torch's fused AdamW for reference.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_OPTIM_BACKEND", "triton")

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--sets", default="llama-3.2-1b-lora,4096x4096,llama-3.2-1b")
    parser.add_argument("--optimizers", default="AdamW8bit,AdamW32bit,Lion8bit")
    parser.add_argument("--modes", default="same,new", help="gradient modes: same, new (see the module)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cap", type=int, default=256, help="CPU: largest dimension of llama-3.2-1b's tensors")
    return parser.parse_args()


ARGS = _parse()
if ARGS.device == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: CPU tensors may take the Triton path

import torch  # noqa: E402
from step_time import shape_set  # noqa: E402

import hf_optim  # noqa: E402
from hf_optim.kernels.triton_path import guard as triton_guard  # noqa: E402


def shapes_for(name: str, device: str, cap: int) -> list[tuple[int, ...]]:
    shapes = shape_set(name)
    if device == "cpu" and name == "llama-3.2-1b":
        shapes = [tuple(min(d, cap) for d in shape) for shape in shapes]
    return shapes


def make_params(shapes, device: str):
    """bf16 parameters and two sets of gradients for them (the ``new`` mode alternates between the sets)."""
    gen = torch.Generator(device=device).manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device=device, dtype=torch.bfloat16, generator=gen) * 0.1)
              for s in shapes]
    grads = [[torch.randn(s, device=device, dtype=torch.bfloat16, generator=gen) * 0.01 for s in shapes]
             for _ in range(2)]
    for p, g in zip(params, grads[0]):
        p.grad = g
    return params, grads


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_steps(opt, params, grads, mode: str, device: str, steps: int, synced: bool,
               clock=time.perf_counter) -> float:
    """Seconds per step over ``steps`` steps (only ``opt.step()`` is timed, by ``clock``)."""
    total = 0.0
    for i in range(steps):
        if mode == "new":
            for p, g in zip(params, grads[i % 2]):
                p.grad = g
        sync(device)
        start = clock()
        opt.step()
        if synced:
            sync(device)
        total += clock() - start
    sync(device)
    return total / steps


def device_ms(opt, params, grads, mode: str, steps: int) -> float:
    """Device kernel ms per step (sum of the profiler's device times)."""
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        time_steps(opt, params, grads, mode, "cuda", steps, synced=True)
    return sum(e.self_device_time_total for e in prof.key_averages()) / steps / 1e3


def contenders(names: list[str], device: str):
    found = [(name, getattr(hf_optim, name)) for name in names]
    if device == "cuda":
        found.append(("torch AdamW fused", lambda p: torch.optim.AdamW(p, fused=True)))
    return found


def main() -> None:
    device = ARGS.device
    if device == "cpu":
        triton_guard.launch = lambda kernel, grid, *args, **kwargs: None  # host side only: no kernel runs
    print(f"hf_optim from {Path(hf_optim.__file__).parent} | device {device}"
          f"{' (' + torch.cuda.get_device_name() + ')' if device == 'cuda' else ' (launches stubbed)'} | "
          f"HF_OPTIM_BACKEND={os.environ.get('HF_OPTIM_BACKEND')} | torch {torch.__version__}")
    header = f"{'set':<20} {'tensors':>7} {'optimizer':<18} {'grads':<5} {'host ms':>8} {'us/tensor':>9}"
    header += f" {'wall ms':>8} {'device ms':>9}" if device == "cuda" else f" {'cpu ms':>7} {'us/tensor':>9}"
    print(header)
    for set_name in ARGS.sets.split(","):
        shapes = shapes_for(set_name, device, ARGS.cap)
        for name, make in contenders(ARGS.optimizers.split(","), device):
            params, grads = make_params(shapes, device)
            opt = make(params)
            for mode in ARGS.modes.split(","):
                time_steps(opt, params, grads, mode, device, ARGS.warmup, synced=True)
                host = statistics.median(time_steps(opt, params, grads, mode, device, ARGS.steps, synced=False)
                                         for _ in range(ARGS.repeats)) * 1e3
                line = (f"{set_name:<20} {len(shapes):>7} {name:<18} {mode:<5} {host:>8.3f} "
                        f"{host * 1e3 / len(shapes):>9.2f}")
                if device == "cpu":  # the thread's CPU time: what a busy machine inflates least
                    cpu = statistics.median(time_steps(opt, params, grads, mode, device, ARGS.steps, synced=False,
                                                       clock=time.thread_time) for _ in range(ARGS.repeats)) * 1e3
                    line += f" {cpu:>7.3f} {cpu * 1e3 / len(shapes):>9.2f}"
                if device == "cuda":
                    wall = statistics.median(time_steps(opt, params, grads, mode, device, ARGS.steps, synced=True)
                                             for _ in range(ARGS.repeats)) * 1e3
                    line += f" {wall:>8.3f} {device_ms(opt, params, grads, mode, ARGS.steps):>9.3f}"
                print(line, flush=True)
            del opt, params, grads
            if device == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
