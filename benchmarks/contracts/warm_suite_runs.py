"""A suite that steps many optimizers in one process, run again and again on a warm inductor cache, so that every
saved CPU kernel loads in mid-suite: does any run break (a pytest internal error, a loaded kernel's guard raising,
``dictionary changed size during iteration``)?

    python benchmarks/contracts/warm_suite_runs.py                       # 10 runs of this tree
    python benchmarks/contracts/warm_suite_runs.py --tree /path/to/an/older/checkout --runs 6   # "before"

The suite is ``tests/algorithms/test_algorithm_conformance.py`` of ``--tree`` (every registered algorithm x state
format on a few small tensors, one pytest process, no xdist), with ``HF_OPTIM_COMPILE=auto``. First one process
steps each of its cases once and waits for the background compiler, which leaves every kernel the suite needs saved
in a cache; then each run gets a copy of that cache, so its kernels load while its tests step (the path of issue
43's crash). Per run it prints pytest's summary line, its exit code, and the counts of internal errors, guard
failures, ``dictionary changed size`` errors and kernel loads found in the log (pytest's live log at INFO). Logs
stay in ``--out``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SUITE = "tests/algorithms/test_algorithm_conformance.py"

WARMUP = """
import sys, warnings
sys.path[:0] = ["tests", "tests/algorithms"]
from helpers import make_params, set_grads
import test_algorithm_conformance as conformance
from hf_optim.kernels.torch_path import cpu_compile
warnings.simplefilter("ignore")
for case in conformance.CASES:
    family, fmt, paged = case.values
    params = make_params(conformance.SHAPES)
    optimizer = conformance.make(family, fmt, paged, params)
    set_grads(params, 0)
    optimizer.step()
cpu_compile.wait(timeout=3600)
"""

COUNTS = {
    "internal errors": r"INTERNALERROR",
    "guard failures": r"GuardManager check failed",
    "dict changed": r"dictionary changed size during iteration",
    "loads": r"(?i)loaded the optimizer|loading the optimizer",
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parents[2], help="checkout to test")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None, help="where the logs go (default: a new temp dir)")
    args = parser.parse_args()
    tree = args.tree.resolve()
    out = args.out or Path(tempfile.mkdtemp(prefix="warm_suite_runs."))
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_OPTIM_COMPILE": "auto", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(tree)}
    warm = out / "warm_cache"
    print(f"warming {warm} with the kernels of {SUITE} in {tree} ...", flush=True)
    subprocess.run([sys.executable, "-c", WARMUP], cwd=tree, env={**env, "TORCHINDUCTOR_CACHE_DIR": str(warm)},
                   check=True)
    saved = len(list((warm / "hf_optim").glob("*.ready")))
    print(f"{saved} kernels saved\n")
    print("| run | exit code | pytest | " + " | ".join(COUNTS) + " |")
    print("|---:|---:|---|" + "---:|" * len(COUNTS))
    broken = 0
    for run in range(1, args.runs + 1):
        cache = out / f"cache{run}"
        shutil.copytree(warm, cache)
        log = out / f"run{run}.log"
        with log.open("w") as stream:
            code = subprocess.run([sys.executable, "-m", "pytest", "-n", "0", "-q", "-p", "no:cacheprovider",
                                   "-o", "log_cli=true", "--log-cli-level=INFO", SUITE], cwd=tree,
                                  env={**env, "TORCHINDUCTOR_CACHE_DIR": str(cache)}, stdout=stream,
                                  stderr=subprocess.STDOUT).returncode
        shutil.rmtree(cache, ignore_errors=True)
        text = log.read_text(errors="replace")
        summary = ([line.strip("= ") for line in text.splitlines() if re.search(r" (passed|failed|error)", line)]
                   or ["(no summary)"])[-1]
        counts = [len(re.findall(pattern, text)) for pattern in COUNTS.values()]
        broken += code != 0 or any(counts[:3])
        print(f"| {run} | {code} | {summary} | " + " | ".join(map(str, counts)) + " |", flush=True)
    print(f"\n{broken} of {args.runs} runs broken; logs in {out}")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
