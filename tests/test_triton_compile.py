"""Every hf_optim Triton kernel compiles for an H100 (sm_90) without a GPU, with IEEE division and square root,
no contracted multiply-adds and vector accesses on whole tiles (see triton_compile_check.py).

The CPU interpreter (test_triton_kernels.py) checks the math but accepts code the GPU compiler rejects. Kernels
defined under the interpreter cannot be compiled, and conftest sets TRITON_INTERPRET on machines without a GPU,
so the compilation runs in a fresh process without it. When test_gpu_static.py ran earlier in the session, it left
every configuration's sm_90 binary in a Triton cache under the session's tmp: this reads them from there (Triton's
cache key covers the source, signature, constants, options and target: a hit is the binary a compilation would give)
instead of compiling the same kernels a second time; the checks on them are the same.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


@pytest.mark.slow  # ~30 s of compilation on 2 cores: the only check of the GPU code path without a GPU
def test_every_kernel_compiles_for_sm90(tmp_path_factory):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # Never the user's Triton cache (~/.triton/cache): its key hashes the kernel's own source, not the whole file, so
    # after an edit elsewhere in a kernel's file a cached PTX's line numbers point at other lines, and the contraction
    # check (which reads the source line of every fma) fails on a kernel that is fine (seen after a quant4.py edit).
    shared = tmp_path_factory.getbasetemp() / "triton_aot_cache"  # test_gpu_static.SHARED_CACHE
    cache = shared if shared.is_dir() else tmp_path_factory.mktemp("triton_cache")
    env["TRITON_CACHE_DIR"] = str(cache)
    root = Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    script = Path(__file__).with_name("triton_compile_check.py")
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "all kernels compiled" in result.stdout
