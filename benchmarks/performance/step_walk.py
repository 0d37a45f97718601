"""The walk of one optimizer step, read from the running code: the chain of calls (the call stack) from
``optimizer.step()`` to the Triton kernel's launch and to the PyTorch path's elementwise update (which runs the rule),
and every hf_optim function one tensor's step calls, for comparing two trees.

    python benchmarks/performance/step_walk.py
    cd /tmp && PYTHONPATH=/tmp/before python /path/to/benchmarks/performance/step_walk.py  # another tree

(From another folder: run from the checkout, the checkout's own ``hf_optim`` comes first on ``sys.path``.)

For each path it prints the calls from ``step`` down (one per line: file and function), then their counts: calls
(hops), files, folders, and returns (entering a file the chain had left); how often a step asks
``backend.uses_triton`` per tensor; and the whole step of one 256x256 tensor (every hf_optim function it calls, in
order): calls, distinct functions, files, folders, and re-entries into a file it had left. AdamW8bit on
``host_overhead.py``'s CPU set (``llama-3.2-1b``'s 146 tensors, dimensions capped at 256). ``triton``:
``HF_OPTIM_BACKEND=triton`` in the interpreter, the launch replaced by a no-op; ``torch``: the multi-tensor PyTorch
path, eager (``HF_OPTIM_COMPILE=0``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

SCRIPT = """
import json, os, sys, traceback
sys.path.insert(0, {here!r})
import torch, hf_optim
import host_overhead
from hf_optim.kernels import backend
from hf_optim.kernels.triton_path import guard

chains = {{}}
package = os.path.dirname(hf_optim.__file__)

def record(path):
    frames = [f for f in traceback.extract_stack()[:-2] if f.filename.startswith(package)
              and not f.filename.endswith("triton_path/guard.py")]
    start = max(i for i, f in enumerate(frames) if f.name == "step" and f.filename.endswith("base.py"))
    chains.setdefault(path, [(os.path.relpath(f.filename, package), f.name) for f in frames[start:]])

guard.launch = lambda *args, **kwargs: record("triton")
from hf_optim.kernels.torch_path import elementwise
run_rule = elementwise.update
def traced_update(*args, **kwargs):
    record("torch")
    return run_rule(*args, **kwargs)
elementwise.update = traced_update
asked = [0]
uses_triton = backend.uses_triton
def counted(*args, **kwargs):
    asked[0] += 1
    return uses_triton(*args, **kwargs)
backend.uses_triton = counted
params = [torch.nn.Parameter(torch.randn(s)) for s in host_overhead.shapes_for("llama-3.2-1b", "cpu", 256)]
for p in params:
    p.grad = torch.randn_like(p)
opt = hf_optim.AdamW8bit(params, lr=1e-3)
opt.step()
asked[0] = 0
opt.step()
single = [torch.nn.Parameter(torch.randn(256, 256))]
single[0].grad = torch.randn_like(single[0])
one = hf_optim.AdamW8bit(single, lr=1e-3)
one.step()
walk = []
def watch(frame, event, arg):
    if event == "call" and frame.f_code.co_filename.startswith(package):
        walk.append((os.path.relpath(frame.f_code.co_filename, package), frame.f_code.co_name))
sys.setprofile(watch)
one.step()
sys.setprofile(None)
print(json.dumps({{"chains": chains, "asked": asked[0], "tensors": len(params), "walk": walk}}))
"""


def measure(path: str) -> dict:
    env = dict(os.environ, HF_OPTIM_COMPILE="0", HF_OPTIM_BACKEND=path)  # host_overhead defaults to triton
    if path == "triton":
        env.update(TRITON_INTERPRET="1")
    here = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(here=here)], env=env, capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def counts(chain: list[list[str]]) -> dict:
    files = [file for file, _ in chain]
    returns = sum(1 for i, file in enumerate(files) if i and file != files[i - 1] and file in files[: i - 1])
    return {"calls": len(chain) - 1, "files": len(set(files)), "folders": len({os.path.dirname(f) for f in files}),
            "returns": returns}


def walk_counts(walk: list[list[str]]) -> dict:
    """The whole step of one tensor, every hf_optim function called in order: how many calls, distinct functions,
    files and folders, and how often the walk re-enters a file it had left."""
    files = [file for file, _ in walk]
    reentries = sum(1 for i, file in enumerate(files) if i and file != files[i - 1] and file in files[: i - 1])
    return {"calls": len(walk), "functions": len({tuple(w) for w in walk}), "files": len(set(files)),
            "folders": len({os.path.dirname(f) for f in files}), "re-entries": reentries}


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    for path in ("triton", "torch"):
        result = measure(path)
        chain = result["chains"].get(path)
        if chain is None:
            print(f"{path}: the step never reached it")
            continue
        target = "the kernel launch" if path == "triton" else "the elementwise update"
        print(f"{path}: from optimizer.step() to {target}")
        for file, function in chain:
            print(f"    {file}: {function}")
        print(f"    {counts(chain)}; backend.uses_triton asked {result['asked'] / result['tensors']:.2f} times per "
              f"tensor per step")
        print(f"    the whole step of one 256x256 tensor: {walk_counts(result['walk'])}")


if __name__ == "__main__":
    main()
