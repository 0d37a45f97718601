"""Cold CPU runs on one large tensor: does a run slow itself down while its kernels compile and load?

    python benchmarks/performance/cold_runs.py                      # 10 cold runs, AdamW8bit, 4096 x 4096, 40 steps
    python benchmarks/performance/cold_runs.py --runs 3 --steps 30 --optimizer Lion8bit
    python benchmarks/performance/cold_runs.py --set llama-3.2-1b-lora --warm    # 224 tensors, a warm cache
    PYTHONPATH=<checkout of the "before" tree> python benchmarks/performance/cold_runs.py   # run from outside the tree

Each run is a fresh Python process with an empty inductor cache (``TORCHINDUCTOR_CACHE_DIR``) and
``HF_OPTIM_COMPILE=auto``, stepping one fp32 parameter with fixed random gradients. The first step waits for the
background compiler (a step of 16.8M elements is larger than what runs eagerly meanwhile); from the first step that
ran the compiled kernel on, each step's wall time is compared with the median of the compiled steps: a run that judges
the machine busy compiles a one-thread variant of its kernel beside the steps, and its steps meanwhile are the ones to
watch. Per run it prints the step times (ms), the worst step after the first compiled one over the median, the
number of one-thread variants compiled, and the other processes' load (``os.getloadavg`` at the start). The table at
the end is what ``docs/performance.md`` shows: run it on an idle machine, and say which CPU and ISA. ``--set``
steps a shape set of ``step_time.py`` instead (``llama-3.2-1b-lora``: 224 tensors, 11.3M elements); ``--warm`` gives
every run one cache, warmed first by a run that waits for its kernels, so each run loads them at its first step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def child(args) -> None:
    """One cold run, in this process: prints a JSON line."""
    import logging

    import torch

    import hf_optim
    from hf_optim.kernels.torch_path import cpu_compile

    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logging.getLogger("hf_optim").addHandler(Collect(level=logging.INFO))
    logging.getLogger("hf_optim").setLevel(logging.INFO)
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in shapes(args)]
    grads = [[torch.randn(p.shape, generator=generator) * 1e-2 for p in params] for _ in range(4)]
    opt = getattr(hf_optim, args.optimizer)(params, lr=1e-3)
    times, compiled = [], []
    for step in range(args.steps):
        for param, grad in zip(params, grads[step % len(grads)]):
            param.grad = grad
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
        compiled.append(any(entry.ready for entry in cpu_compile._entries.values()))
    if args.wait:  # the warm-up run of --warm: leave every kernel it asked for in the cache
        cpu_compile.wait(timeout=1800)
    # a one-thread variant compiled here, or loaded: compiled by an earlier run on the same cache (--warm)
    variants = sum("1 thread" in line and line.startswith(("compiling", "loaded")) for line in lines)
    print(json.dumps({"ms": [round(t * 1e3, 1) for t in times], "compiled": compiled, "variants": variants,
                      "lines": lines}))


def shapes(args) -> list[tuple[int, ...]]:
    """The parameters' shapes: one ``rows x cols`` tensor, or a shape set of step_time.py (``--set``)."""
    if not args.set:
        return [(args.rows, args.cols)]
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from step_time import shape_set

    return shape_set(args.set)


def summary(record: dict) -> tuple[float, float, int]:
    """(worst step after the first compiled one over the median of the compiled steps, that median in ms, the first
    compiled step's index)."""
    first = record["compiled"].index(True) if True in record["compiled"] else len(record["ms"])
    later = record["ms"][first + 1:]
    if not later:
        return float("nan"), float("nan"), first
    median = statistics.median(later)
    return max(later) / median, median, first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--optimizer", default="AdamW8bit")
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--set", default=None,
                        help="a shape set of step_time.py (llama-3.2-1b-lora: 224 tensors) instead of one tensor")
    parser.add_argument("--warm", action="store_true",
                        help="every run on one cache, warmed first by a run that waits for its kernels")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--wait", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    import hf_optim

    what = f"the {args.set} set" if args.set else f"one {args.rows} x {args.cols} fp32 tensor"
    print(f"hf_optim from {os.path.dirname(hf_optim.__file__)}; {args.runs} {'warm' if args.warm else 'cold'} runs "
          f"of {args.optimizer} on {what}, {args.steps} steps each")
    shared = tempfile.TemporaryDirectory(prefix="cold_runs.") if args.warm else None
    if shared is not None:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": shared.name, "HF_OPTIM_COMPILE": "auto"}
        out = subprocess.run([sys.executable, __file__, "--child", "--wait", *sys.argv[1:]], env=env,
                             capture_output=True, text=True, check=True)
        record = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"warm-up run: one-thread variants compiled {record['variants']}")
    rows = []
    for run in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="cold_runs.") as fresh:
            cache = shared.name if shared is not None else fresh
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "HF_OPTIM_COMPILE": "auto"}
            load = os.getloadavg()[0]
            out = subprocess.run([sys.executable, __file__, "--child", *sys.argv[1:]], env=env, capture_output=True,
                                 text=True, check=True)
            record = json.loads(out.stdout.strip().splitlines()[-1])
            # the background worker exits by itself once nobody waits; let it go before the next run's cache
            time.sleep(1)
        worst, median, first = summary(record)
        rows.append((worst, median, record["variants"], load))
        print(f"run {run + 1}: load {load:.2f}, first compiled step {first}, median {median:.1f} ms, worst/median "
              f"{worst:.1f}x, one-thread variants {record['variants']}")
        print("  ms: " + " ".join(f"{t:.0f}" for t in record["ms"]))
    print("\n| run | load at start | median compiled step ms | worst step after the first compiled one / median | "
          "one-thread variants compiled or loaded |")
    print("|---:|---:|---:|---:|---:|")
    for index, (worst, median, variants, load) in enumerate(rows, 1):
        print(f"| {index} | {load:.2f} | {median:.1f} | {worst:.1f}x | {variants} |")
    worst_all = max(row[0] for row in rows)
    print(f"\nworst over all runs: {worst_all:.1f}x the median; runs that compiled or loaded a one-thread variant: "
          f"{sum(row[2] > 0 for row in rows)} of {len(rows)}")


if __name__ == "__main__":
    main()
