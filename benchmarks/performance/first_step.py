"""The first optimizer steps on a cold and on a warm inductor cache, per algorithm and state format, fresh processes.

    python benchmarks/performance/first_step.py  # every algorithm x format, quickstart and LoRA sets
    python benchmarks/performance/first_step.py --sets quickstart-lora --optimizers AdamW8bit,AdamW32bit --modes auto,1

Each measurement runs in a fresh Python process with caches of its own: ``cold`` is a new empty directory for
inductor's cache (``TORCHINDUCTOR_CACHE_DIR``), Triton's cache and the temporary directory (``TMPDIR``, where
inductor keeps the precompiled headers that every cache directory of a user shares: a machine's first compilation
builds them); ``warm`` is a second process on the same directories. The parameters are a shape set of
``benchmarks/performance/step_time.py`` (``quickstart-lora``: the quickstart recipe's 28 LoRA tensors;
``llama-3.2-1b-lora``: Llama-3.2-1B's 224), fp32, with fixed random gradients. Per run:

- ``first s``: the first ``optimizer.step()`` (wall seconds; the process's imports are not included);
- ``N steps s``: the first ``--steps`` steps together (wall);
- ``eager``: how many of them ran some chunk eagerly (``HF_OPTIM_COMPILE=auto`` while the kernel compiles);
- ``ready s``: when the last compilation had finished, from the first step on (after the timed steps the child
  waits for compilations still running, so that the warm run finds a complete cache);
- ``CPU s``: CPU seconds of the whole process tree (the Python process, gcc, compile workers) from start to exit,
  imports included, which is less sensitive to other load than wall time;
- ``graphs``: graphs dynamo compiled (or loaded from inductor's cache through dynamo) in the process;
- ``longest s``: the longest step after the first (where a kernel's compilation or loading can hold up a step) and
  ``eager s``: the median of the steps that ran a chunk eagerly (what a step costs while the kernel is not ready).

``--modes``: values of ``HF_OPTIM_COMPILE``: ``auto`` (compile in the background, the default), ``1`` (compile
before the first step), ``0`` (eager). The load average is printed with every row: on a shared machine compare rows
of the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OPTIMIZERS = ("AdamW8bit", "AdamW32bit", "AdamW4bit", "AdEMAMix8bit", "AdEMAMix32bit", "AdEMAMix4bit", "Lion8bit",
              "Lion32bit", "Lion4bit", "RMSprop8bit", "RMSprop32bit", "LAMB8bit", "LAMB32bit", "Adafactor")


def child(args) -> None:
    """One measurement, in this process: prints a JSON line."""
    import torch
    from step_time import shape_set

    import hf_optim
    from hf_optim.kernels.torch_path import multi_tensor

    try:
        from hf_optim.kernels.torch_path.cpu_compile import wait
    except ImportError:  # hf_optim before background compilation (for a before/after comparison)
        def wait():
            return True

    eager_calls = [0]
    run_update = multi_tensor.run_update

    def counting(*call, **kwargs):
        ran = run_update(*call, **kwargs)
        eager_calls[0] += ran is False  # (None before run_update said which path ran)
        return ran

    multi_tensor.run_update = counting
    for setting in filter(None, args.inductor.split(",")):  # experiments: inductor settings for every compilation
        name, value = setting.split("=")
        import torch._inductor.config

        target = torch._inductor.config
        *path, last = name.split(".")
        for part in path:
            target = getattr(target, part)
        setattr(target, last, json.loads(value))
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shape_set(args.sets)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    cls = getattr(hf_optim, args.optimizers)
    kwargs = dict(lr=1e-3, relative_step=False, scale_parameter=False, warmup_init=False) if args.optimizers == (
        "Adafactor") else {}
    opt = cls(params, **kwargs)
    times, eager_times = [], []
    begin = time.perf_counter()
    for _ in range(args.steps):
        before = eager_calls[0]
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
        if eager_calls[0] > before:
            eager_times.append(times[-1])
    wait()
    ready = time.perf_counter() - begin
    from torch._dynamo.utils import counters

    print(json.dumps(dict(first=times[0], total=sum(times), eager=len(eager_times), ready=ready,
                          graphs=counters["stats"]["unique_graphs"], longest=max(times[1:], default=0.0),
                          eager_median=sorted(eager_times)[len(eager_times) // 2] if eager_times else None)),
          flush=True)


def run_child(spec: str, optimizer: str, mode: str, steps: int, root: Path, inductor: str = "") -> dict:
    """Run :func:`child` in a fresh process on the caches under ``root``; adds the process tree's CPU seconds."""
    for sub in ("tmp", "inductor", "triton"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_OPTIM_COMPILE": mode, "TMPDIR": str(root / "tmp"),
           "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"), "TRITON_CACHE_DIR": str(root / "triton"),
           "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent),
                                                                                 os.environ.get("PYTHONPATH")]))}
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    before = usage.ru_utime + usage.ru_stime
    done = subprocess.run([sys.executable, __file__, "--child", "--sets", spec, "--optimizers", optimizer,
                           "--steps", str(steps), "--inductor", inductor], env=env, capture_output=True, text=True)
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise RuntimeError(f"{optimizer} on {spec} ({mode}) failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["cpu"] = usage.ru_utime + usage.ru_stime - before
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sets", default="quickstart-lora,llama-3.2-1b-lora")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    parser.add_argument("--modes", default="auto", help="comma-separated HF_OPTIM_COMPILE values: auto, 1, 0")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--inductor", default="",
                        help="experiments: comma-separated inductor settings NAME=JSON_VALUE for the measured "
                             "processes, e.g. cpp_cache_precompile_headers=false")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    rows = []
    print("| set | optimizer | HF_OPTIM_COMPILE | cold: first s | N steps s | eager | ready s | CPU s | graphs | "
          "warm: first s | N steps s | eager | longest s | eager s | ready s | CPU s | load avg |")
    print("|---|---|---|" + "---:|" * 14)
    for spec in args.sets.split(","):
        for optimizer in args.optimizers.split(","):
            for mode in args.modes.split(","):
                with tempfile.TemporaryDirectory(prefix="hf_optim_first_step_") as root:
                    cold = run_child(spec, optimizer, mode, args.steps, Path(root), args.inductor)
                    warm = run_child(spec, optimizer, mode, args.steps, Path(root), args.inductor)
                load = Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else ""
                cells = [f"{cold['first']:.2f}", f"{cold['total']:.2f}", str(cold["eager"]), f"{cold['ready']:.1f}",
                         f"{cold['cpu']:.1f}", str(cold["graphs"]), f"{warm['first']:.2f}", f"{warm['total']:.2f}",
                         str(warm["eager"]), f"{warm['longest']:.2f}",
                         "-" if warm["eager_median"] is None else f"{warm['eager_median']:.2f}",
                         f"{warm['ready']:.1f}", f"{warm['cpu']:.1f}", load]
                rows.append(f"| {spec} | {optimizer} | {mode} | " + " | ".join(cells) + " |")
                print(rows[-1], flush=True)
    print(f"\n(N = {args.steps} steps)")


if __name__ == "__main__":
    main()
