#!/bin/bash
# The GPU checks of the whole project in one bounded run (docs/benchmarks.md, "GPU runs"): versions, the step-time
# table, the GPU tests, paging, the profile of a step, the doctor and the quickstart on CUDA. Each part has its own
# time limit and log under $OUT (default ./gpu-out), so a slow or failing part leaves the others' results.
#
#   bash benchmarks/gpu/session.sh                    # about 6 minutes on an H200 with a cold Triton cache
#
# Packages the machine lacks can come as wheels in .whl/ (downloaded elsewhere with `pip download --no-deps`):
# they are installed into /tmp/site first. Run from the repository root.
set -u
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
ROOT=$PWD
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl > "$OUT/pip.log" 2>&1 || echo "pip install of .whl/ failed (see pip.log)"
fi
export PYTHONPATH=/tmp/site:$ROOT HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
hf_optim_cli() { python3 -c 'import sys; from hf_optim.cli import main; sys.exit(main())' "$@"; }
part() { echo; echo "=== $1 ($(date +%T))"; }
{
    part env
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,clocks.max.sm --format=csv
    python3 -c 'import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
for m in ("triton", "transformers", "bitsandbytes", "trl", "peft", "accelerate", "datasets", "pydantic"):
    try:
        print(m, importlib.import_module(m).__version__)
    except Exception as e:
        print(m, "import failed:", type(e).__name__, e)'
} 2>&1 | tee "$OUT/env.log"
part step_time | tee "$OUT/step_time.log"
timeout 150 python3 benchmarks/step_time.py --device cuda --sets 4096x4096,llama-3.2-1b-lora,llama-3.2-1b \
    --dtype bf16 --steps 20 --warmup 5 --gbs 2>&1 | tee -a "$OUT/step_time.log"
part "pytest -m gpu" | tee "$OUT/gpu_tests.log"
# tests/test_notebooks.py needs nbformat (a test extra) at import and has no GPU case: left out where it is missing
ignore=$(python3 -c "import nbformat" 2>/dev/null || echo --ignore=tests/test_notebooks.py)
timeout 170 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs --durations=15 $ignore tests 2>&1 | tee -a "$OUT/gpu_tests.log"
{
    part profile
    timeout 90 python3 benchmarks/gpu/step_profile.py
    part paged_memory
    timeout 60 python3 benchmarks/paged_memory.py --parts speed,peak,resume,pressure --rounds 3 --steps 3
    part doctor
    timeout 75 hf_optim_cli doctor
    part "quickstart on cuda"
    timeout 60 hf_optim_cli train quickstart training.use_cpu=false --overwrite \
        --sweep training.optim=adamw_torch,adamw_8bit,paged_adamw_8bit --output-dir /tmp/hf_optim_gpu_sweep \
        && cat /tmp/hf_optim_gpu_sweep/compare.md
} 2>&1 | grep -v "it/s\]\|s/it\]" | tee "$OUT/rest.log"
part done
