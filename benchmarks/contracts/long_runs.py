"""Every algorithm x state format steps a while, its CPU kernels compiled in the background and loaded in mid-run,
on a cold and then a warm inductor cache: no step may raise, and no call may be refused by a loaded kernel.

    python benchmarks/contracts/long_runs.py                  # every algorithm, 60 s cold + 60 s warm each
    python benchmarks/contracts/long_runs.py --seconds 20 --algorithms ademamix,adamw

One process per algorithm and cache state (``HF_OPTIM_COMPILE=auto``; cold: a new empty ``TORCHINDUCTOR_CACHE_DIR``,
warm: the same directory again). In it, one optimizer per state format the algorithm supports (its named class, or
the generic class given ``state_format``) steps two parameter groups in turn until the time is up: the issue's
reproduction (a 10 x 5 and a 10-element tensor, ``min_8bit_size=0``: a flat state of one chunk) and a 520 x 520
tensor (a flat state of two chunks). Each row: steps taken, the kernels loaded or compiled by the end, calls a loaded
kernel refused (they run eagerly), and the error if a step raised.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback


def child(algorithm: str, seconds: float) -> None:
    import warnings

    import torch

    from hf_optim.kernels.torch_path import cpu_compile
    from hf_optim.optim import registry

    warnings.simplefilter("ignore")  # paged classes on a CPU
    family = next(f for f in registry.families() if f.algorithm.name == algorithm)
    generator = torch.Generator().manual_seed(0)
    runs = []
    for fmt in family.base._supported_formats():
        try:
            cls = family.class_for(fmt, False)
            kwargs = {}
        except ValueError:
            cls, kwargs = family.base, {"state_format": fmt.name}
        if cls.__name__ == "Adafactor":
            kwargs.update(beta1=0.9, relative_step=False)
        small = [torch.nn.Parameter(torch.randn(10, 5, generator=generator)),
                 torch.nn.Parameter(torch.randn(10, generator=generator))]
        large = [torch.nn.Parameter(torch.randn(520, 520, generator=generator))]
        try:
            opt = cls([{"params": small}, {"params": large}], lr=1e-3, min_8bit_size=0, **kwargs)
        except TypeError:  # no min_8bit_size (32-bit classes)
            opt = cls([{"params": small}, {"params": large}], lr=1e-3, **kwargs)
        runs.append((f"{cls.__name__}({fmt.name})", opt, small + large))
    steps = {name: 0 for name, _, _ in runs}
    error = ""
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            for name, opt, params in runs:
                for p in params:
                    p.grad = torch.randn(p.shape, generator=generator) * 1e-2
                opt.step()
                steps[name] += 1
    except Exception as failure:  # noqa: BLE001 (reported)
        error = f"{type(failure).__name__}: {str(failure).splitlines()[0][:200]}"
        traceback.print_exc()
    entries = list(cpu_compile._entries.values())
    print(json.dumps({"steps": steps, "error": error, "kernels": len(entries),
                      "ready": sum(bool(entry.ready) for entry in entries),
                      "loaded": sum(len(entry.loaded) for entry in entries),
                      "misfits": sum(entry.misfits for entry in entries)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--algorithms", default="", help="comma-separated (default: every registered algorithm)")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], float(args.child[1]))
        return
    from hf_optim.optim import registry

    algorithms = [a for a in args.algorithms.split(",") if a] or [f.algorithm.name for f in registry.families()]
    print("| algorithm | cache | steps per format | kernels ready / loaded from a saved file | refused calls | error |")
    print("|---|---|---|---|---:|---|")
    failures = 0
    for algorithm in algorithms:
        with tempfile.TemporaryDirectory(prefix="long_runs.") as cache:
            for state in ("cold", "warm"):
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "HF_OPTIM_COMPILE": "auto"}
                out = subprocess.run([sys.executable, __file__, "--child", algorithm, str(args.seconds)], env=env,
                                     capture_output=True, text=True)
                lines = out.stdout.strip().splitlines()
                if out.returncode != 0 or not lines:
                    failures += 1
                    print(f"| {algorithm} | {state} | - | - | - | exit {out.returncode}: "
                          f"{out.stderr.strip().splitlines()[-1:]} |")
                    continue
                record = json.loads(lines[-1])
                failures += bool(record["error"]) + bool(record["misfits"])
                steps = ", ".join(f"{name} {count}" for name, count in record["steps"].items())
                print(f"| {algorithm} | {state} | {steps} | {record['ready']} of {record['kernels']} / "
                      f"{record['loaded']} | {record['misfits']} | {record['error'] or '-'} |", flush=True)
                time.sleep(2)  # the background worker exits once nobody waits
    print(f"\n{failures} failure(s)")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
