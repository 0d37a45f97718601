#!/bin/bash
# The GPU checks of work merged since the last GPU run, in one bounded call (about 6 minutes on an H200): the GPU
# tests (fp8's Triton branch, paging, Muon on CUDA among them), the step time of the fp8 and 8-bit optimizers, and
# Muon's step time beside torch.optim.Muon. Logs under $OUT (default ./gpu-out). The first version of this script
# (git history) also ran host_overhead.py, paged_memory.py and Nsight Compute: docs/lab/2026-measurements.md,
# "Second H200 run".
set -u
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl > "$OUT/pip.log" 2>&1 || echo "pip install of .whl/ failed (see pip.log)"
fi
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
part() { echo; echo "=== $1 ($(date +%T))"; }
ignore=$(python3 -c "import nbformat" 2>/dev/null || echo --ignore=tests/cli/test_notebooks.py)
{
    part env
    nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
    python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
    part "pytest -m gpu"
    timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --durations=8 $ignore tests
    part "step time"
    timeout 100 python3 benchmarks/performance/step_time.py --device cuda --sets llama-3.2-1b-lora,llama-3.2-1b --dtype bf16 \
        --steps 15 --warmup 4 --gbs --no-bnb --only "fused,AdamW8bit,AdamWFp8,LionFp8,AdEMAMixFp8,AdEMAMix8bit"
    part "Muon step time"
    timeout 70 python3 benchmarks/performance/muon_step.py --device cuda --sets llama-3.2-1b-lora,4096x4096 --steps 10 --warmup 3
    part done
} 2>&1 | grep -v "it/s\]\|s/it\]" | tee "$OUT/validate.log"
