"""A few optimizer steps on one shape set, for Nsight Compute to profile one launch of the fused kernel.

    ncu --kernel-name regex:_fused_update_kernel --launch-skip 4 --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
        python3 benchmarks/gpu/ncu_step.py --set llama-3.2-1b --optimizer AdamW8bit

Parameters are bf16 (benchmarks/performance/step_time.py's sets); the whole-tile launch is the large one of each step.
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "performance"))
from step_time import fresh_params, shape_set  # noqa: E402

import hf_optim  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--set", default="llama-3.2-1b")
parser.add_argument("--optimizer", default="AdamW8bit")
parser.add_argument("--steps", type=int, default=6)
args = parser.parse_args()
params = fresh_params(shape_set(args.set), torch.bfloat16, "cuda")
optimizer = getattr(hf_optim, args.optimizer)(params)
for _ in range(args.steps):
    optimizer.step()
torch.cuda.synchronize()
print(f"{args.steps} steps of {args.optimizer} on {args.set}")
