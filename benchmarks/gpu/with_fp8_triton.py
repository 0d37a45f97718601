"""Run a script or module with fp8's Triton branch forced on (``Fp8.triton``: on by default since its interpreter
mismatch and sm_90 occupancy were fixed; this stays for scripts that call it, and for trying a branch switched off).

    python3 benchmarks/gpu/with_fp8_triton.py -m pytest -m gpu tests/test_triton_kernels.py -k Fp8
    python3 benchmarks/gpu/with_fp8_triton.py benchmarks/step_time.py --device cuda --only AdamWFp8

Nothing else changes.
"""
import runpy
import sys

from hf_optim.kernels.formats.fp8 import Fp8

Fp8.triton = True
args = sys.argv[1:]
if args[:1] == ["-m"]:
    sys.argv = [args[1], *args[2:]]
    runpy.run_module(args[1], run_name="__main__", alter_sys=True)
else:
    sys.argv = args
    runpy.run_path(args[0], run_name="__main__")
