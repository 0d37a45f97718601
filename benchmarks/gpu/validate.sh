#!/bin/bash
# The GPU checks of work merged since the last GPU run, in one bounded call (about 6 minutes): the GPU tests,
# fp8's Triton branch switched on (tests and step time), the step-time table, host time per step, paging speed
# and pressure, and Nsight Compute on the fused 8-bit kernel. Logs under $OUT (default ./gpu-out).
set -u
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl > "$OUT/pip.log" 2>&1 || echo "pip install of .whl/ failed (see pip.log)"
fi
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
part() { echo; echo "=== $1 ($(date +%T))"; }
ignore=$(python3 -c "import nbformat" 2>/dev/null || echo --ignore=tests/test_notebooks.py)
{
    part env
    nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
    python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
    part "pytest -m gpu"
    timeout 170 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --durations=8 $ignore tests
    part "fp8 Triton branch on: GPU kernel tests"
    timeout 70 python3 benchmarks/gpu/with_fp8_triton.py -m pytest -m gpu -q -p no:cacheprovider -rfE \
        tests/test_triton_kernels.py tests/test_fp8.py -k "Fp8 or fp8"
    part "step time (fp8 Triton branch on)"
    timeout 100 python3 benchmarks/gpu/with_fp8_triton.py benchmarks/step_time.py --device cuda \
        --sets llama-3.2-1b-lora,llama-3.2-1b --dtype bf16 --steps 15 --warmup 4 --gbs \
        --only "fused,AdamW8bit,AdamWFp8,Lion8bit,AdamW32bit"
    part "host time per step"
    timeout 45 python3 benchmarks/host_overhead.py --device cuda
    part "paged: speed and pressure"
    timeout 60 python3 benchmarks/paged_memory.py --parts speed,pressure --rounds 3 --steps 3
    part "ncu: fused 8-bit kernel on the 1B set"
    timeout 60 ncu --clock-control none --kernel-name regex:_fused_update_kernel --launch-skip 4 --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
        python3 benchmarks/gpu/ncu_step.py --set llama-3.2-1b --optimizer AdamW8bit
    part done
} 2>&1 | grep -v "it/s\]\|s/it\]" | tee "$OUT/validate.log"
