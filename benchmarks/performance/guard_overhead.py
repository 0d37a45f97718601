"""Host cost of hf_optim's compile-before-launch guard (hf_optim/kernels/triton_path/guard.py), per kernel launch.

Each guarded step calls Triton's ``JITFunction.warmup`` once per launch before launching: one more argument binding
and cache lookup on the host. This times that on the fused AdamW kernel's real arguments:

- with a CUDA GPU: ``warmup`` of an already compiled kernel, beside a whole launch (``kernel[grid](...)``);
- without one: Triton's argument binder and cache key for an sm_90 target (what ``warmup`` does before finding the
  kernel in its cache), since nothing can be launched.

    python benchmarks/performance/guard_overhead.py [--repeats 20000]
"""

from __future__ import annotations

import argparse
import time

import torch


def per_call_us(function, repeats: int) -> float:
    for _ in range(min(100, repeats)):
        function()
    start = time.perf_counter()
    for _ in range(repeats):
        function()
    return (time.perf_counter() - start) / repeats * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20000)
    args = parser.parse_args()
    import triton

    import hf_optim
    from hf_optim.core.algorithm import kernel_scalars
    from hf_optim.kernels.triton_path import elementwise as te

    algorithm = hf_optim.AdamW.definition
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    meta = torch.zeros(16, dtype=torch.int64, device=device)
    tiles = torch.zeros(2, dtype=torch.int32, device=device)
    hyper = kernel_scalars(algorithm.hyper(*[0.1] * len(algorithm.hyper._fields)))
    launch_args = (meta, tiles, meta, meta, hyper, meta, meta)
    constants = dict(RULE=algorithm.resolve(algorithm.triton_rule), ROWS=2, SIGNED0=True, SIGNED1=False, SIGNED2=True,
                     WRITE_OUT=False, NORMS=False, BLOCKS=te.TILE_BLOCKS, COLS=16, ALIGNED=True, SR=False)
    kernel = te._fused_update_kernel
    print(f"Triton {triton.__version__}, torch {torch.__version__}, {args.repeats} calls each")
    if device.type == "cuda":
        options = dict(constants, enable_fp_fusion=False)
        kernel[(1,)](*launch_args, **options)  # compiles once
        torch.cuda.synchronize()
        warmup = per_call_us(lambda: kernel.warmup(*launch_args, grid=(1,), **options), args.repeats)
        launch = per_call_us(lambda: kernel[(0,)](*launch_args, **options), args.repeats)
        torch.cuda.synchronize()
        print(f"{torch.cuda.get_device_name()}: warmup of a compiled kernel {warmup:.1f} us; "
              f"a launch of an empty grid {launch:.1f} us; the guard adds {warmup / launch:.2f}x a launch's host time")
        return
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import compute_cache_key, create_function_from_signature

    binder = create_function_from_signature(kernel.signature, kernel.params, make_backend(GPUTarget("cuda", 90, 32)))
    options = dict(constants, enable_fp_fusion=False, debug=False, instrumentation_mode="",
                   fpsan_homomorphic_casts=False)
    cache: dict = {}

    def bind():
        _, specialization, parsed = binder(*launch_args, **options)
        compute_cache_key(cache, specialization, parsed)

    print(f"no GPU: Triton's argument binding and cache key for sm_90, {per_call_us(bind, args.repeats):.1f} us "
          "per launch (warmup's work before its cache hit)")


if __name__ == "__main__":
    main()
