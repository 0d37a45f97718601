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
    from hf_optim.formats import BLOCKWISE8
    from hf_optim.kernels.triton_path import elementwise as te
    from hf_optim.kernels.triton_path.tile import BF16

    algorithm = hf_optim.AdamW.definition
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    major, minor = torch.cuda.get_device_capability() if device.type == "cuda" else (9, 0)
    # the fused kernel as AdamW8bit launches it for bf16 parameters' whole tiles
    config = te.FusedConfig(algorithm.name, algorithm.resolve(algorithm.triton_rule), (BLOCKWISE8.code,) * 2,
                            (True, False), BF16.value, BF16.value, full=True, arch=major * 10 + minor)
    meta = torch.zeros(16, dtype=torch.int64, device=device)
    tiles = torch.zeros(2, dtype=torch.int32, device=device)
    hyper = kernel_scalars(algorithm.hyper(*[0.1] * len(algorithm.hyper._fields)))
    launch_args = (meta, tiles, meta, *te.row_maps(config, device), hyper, meta, meta)
    constants = dict(config.constants(), **config.launch_options())
    kernel = te._fused_update_kernel
    print(f"Triton {triton.__version__}, torch {torch.__version__}, {args.repeats} calls each")
    if device.type == "cuda":
        options = constants
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
    options = dict(constants, debug=False, instrumentation_mode="", fpsan_homomorphic_casts=False)
    cache: dict = {}

    def bind():
        _, specialization, parsed = binder(*launch_args, **options)
        compute_cache_key(cache, specialization, parsed)

    print(f"no GPU: Triton's argument binding and cache key for sm_90, {per_call_us(bind, args.repeats):.1f} us "
          "per launch (warmup's work before its cache hit)")


if __name__ == "__main__":
    main()
