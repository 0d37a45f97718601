"""Python function calls per optimizer step: a deterministic measure of the host work a step does, for comparing two
trees on a machine too noisy to time it (a VM's wall and CPU time move by 50% between runs).

    python benchmarks/performance/host_calls.py
    PYTHONPATH=/tmp/before python benchmarks/performance/host_calls.py  # another tree (before/after)

The parameters are ``llama-3.2-1b``'s 146 tensors with each dimension capped at 256 (``host_overhead.py``'s CPU set).
Two paths: ``triton`` (``HF_OPTIM_BACKEND=triton`` with ``TRITON_INTERPRET=1`` and the kernel launch replaced by a
no-op, as ``host_overhead.py`` does: the Triton path's host side) and ``torch`` (the multi-tensor PyTorch path,
eager: ``HF_OPTIM_COMPILE=0``). Prints calls per step counted by ``cProfile`` over 10 steps after 3 warm-up steps.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

SCRIPT = """
import cProfile, os, pstats, sys
sys.path.insert(0, {here!r})
import torch, hf_optim
import host_overhead
from hf_optim.kernels.triton_path import guard
guard.launch = lambda *args, **kwargs: None
params = [torch.nn.Parameter(torch.randn(s)) for s in host_overhead.shapes_for("llama-3.2-1b", "cpu", 256)]
for p in params:
    p.grad = torch.randn_like(p)
opt = getattr(hf_optim, {name!r})(params, lr=1e-3)
for _ in range(3):
    opt.step()
profile = cProfile.Profile()
profile.enable()
for _ in range(10):
    opt.step()
profile.disable()
print(pstats.Stats(profile).total_calls // 10)
"""


def calls(name: str, path: str) -> int:
    env = {**os.environ, "HF_OPTIM_BACKEND": path, "HF_OPTIM_COMPILE": "0"}
    if path == "triton":
        env["TRITON_INTERPRET"] = "1"
    here = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(here=here, name=name)], env=env, capture_output=True,
                          text=True, check=True)
    return int(done.stdout.split()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizers", default="AdamW8bit,Lion8bit")
    args = parser.parse_args(argv)
    import hf_optim

    print(f"hf_optim from {os.path.dirname(hf_optim.__file__)}")
    print("| optimizer | Triton path calls/step | PyTorch path calls/step |\n|---|---:|---:|")
    for name in args.optimizers.split(","):
        print(f"| {name} | {calls(name, 'triton'):,} | {calls(name, 'torch'):,} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
