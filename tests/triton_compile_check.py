"""Compile every hf_optim Triton kernel for an H100 (sm_90) without a GPU; run by test_triton_compile.py.

The CPU interpreter (test_triton_kernels.py) checks the math but accepts code the GPU compiler rejects; this
compiles each kernel to PTX (Triton's ahead-of-time path: no device needed) and checks the properties the
bit-compatibility and bandwidth claims rest on: IEEE division and square root, no contraction of separate
multiplies and adds into FMAs, and 128-bit vector accesses on whole tiles.
"""

import collections
import os
import re
import sys

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("run without TRITON_INTERPRET: interpreted kernels cannot be compiled")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from hf_optim.kernels import (  # noqa: E402
    triton_adafactor,
    triton_blockwise,
    triton_elementwise,
    triton_lamb,
)
from hf_optim.kernels.algorithm import resolve  # noqa: E402
from hf_optim.optim import registry  # noqa: E402

H100 = GPUTarget("cuda", 90, 32)


def compile_ptx(kernel, signature: dict, constants: dict, **options) -> str:
    names = kernel.arg_names
    signature = {**signature, **{name: "constexpr" for name in constants}}
    constexprs = {(names.index(name),): value for name, value in constants.items()}
    ptx = triton.compile(ASTSource(kernel, signature, constexprs), target=H100, options=options).asm["ptx"]
    print(f"compiled {kernel.__name__}", flush=True)
    return ptx


def accesses(ptx: str) -> collections.Counter:
    return collections.Counter(re.findall(r"(?:ld|st)\.global[a-z0-9._]*", ptx))


# bf16 stochastic rounding's arguments (the parameter ordinals and the step's key words)
ROUNDING = {"ordinals": "*i64", "key": "*i64"}


def check_fused_update(algorithm, stochastic: bool = False) -> None:
    """The fused kernel with ``algorithm``'s Triton rule (its scalars: its ``hyper`` class of fp32 values)."""
    hyper = algorithm.hyper(*["fp32"] * len(algorithm.hyper._fields))
    signature = {"meta": "*i64", "tiles": "*i32", "partials": "*fp32", "maps": "*i64", "h": hyper, **ROUNDING}
    out = not algorithm.triton_plan.elementwise  # LAMB: the direction, with per-tile norms
    signed = [spec.signed for spec in algorithm.slots for _ in range(spec.rows)] + [False] * 3
    constants = {"RULE": resolve(algorithm.triton_rule), "ROWS": algorithm.state_rows, "SIGNED0": signed[0],
                 "SIGNED1": signed[1], "SIGNED2": signed[2], "WRITE_OUT": out, "NORMS": out,
                 "BLOCKS": triton_elementwise.TILE_BLOCKS, "COLS": 16, "ALIGNED": True, "SR": stochastic}
    ptx = compile_ptx(triton_elementwise._fused_update_kernel, signature, constants, enable_fp_fusion=False)
    found = accesses(ptx)
    assert found["ld.global.v4.b32"] > 0 and found["st.global.v4.b32"] + found["st.global.v2.b32"] > 0, found
    assert "div.full" not in ptx and "sqrt.approx" not in ptx  # IEEE division and square root
    fmas = len(re.findall(r"\bfma\.rn\.f32", ptx))
    assert fmas == 0, fmas  # one rounding per operation, as the PyTorch rules (exact_math.lerp included)


def check_other_kernels() -> None:
    compile_ptx(triton_lamb._ratio_kernel, {"meta": "*i64", "partials": "*fp32", "ratios": "*fp32",
                "max_trust_ratio": "fp32", "max_unorm": "fp32"},
                {"ADAPT": True, "CLAMP": True, "UNORM": True, "CHUNK": 1024, "BLOCKS": 4, "COLS": 16})
    for stochastic in (False, True):
        compile_ptx(triton_lamb._apply_kernel, {"meta": "*i64", "tiles": "*i32", "ratios": "*fp32", "lr": "fp32",
                    **ROUNDING}, {"BLOCKS": 4, "COLS": 16, "ALIGNED": True, "SR": stochastic})
    compile_ptx(triton_blockwise._quantize_kernel, {"values_ptr": "*fp32", "codes_ptr": "*u8", "absmax_ptr": "*fp32",
                "table_ptr": "*i32", "n": "i32", "blocks_per_row": "i32"}, {"SIGNED": True, "BLOCKS": 4})
    compile_ptx(triton_blockwise._dequantize_kernel, {"codes_ptr": "*u8", "absmax_ptr": "*fp32", "qmap_ptr": "*fp32",
                "out_ptr": "*fp32", "n": "i32", "blocks_per_row": "i32"}, {"BLOCKS": 4})
    check_adafactor_kernels()


def check_adafactor_kernels() -> None:
    table = {"meta": "*i64", "units": "*i32"}
    adafactor = {"NCOLS": triton_adafactor.META_COLS}
    compile_ptx(triton_adafactor._row_stats_kernel, {**table, "row_sums": "*fp32", "param_sq": "*fp32",
                "eps1": "fp32"}, {"BR": 16, "BC": 256, **adafactor})
    compile_ptx(triton_adafactor._col_stats_kernel, {**table, "col_sums": "*fp32", "eps1": "fp32"},
                {"BR": 16, "BC": 256, **adafactor})
    scratch = {"row_factor": "*fp32", "col_factor": "*fp32"}
    finalize = {**table, "row_sums": "*fp32", "param_sq": "*fp32", "col_sums": "*fp32", **scratch,
                "lrs": "*fp32", "step_size": "fp32", "eps2": "fp32", "beta2t": "fp32", "one_minus_beta2t": "fp32"}
    for scale in (True, False):
        ptx = compile_ptx(triton_adafactor._finalize_kernel, finalize, {"SCALE": scale, "CHUNK": 1024, **adafactor})
        # IEEE RMS, means and divisions (rsqrt stays the hardware one, as torch's CUDA rsqrt)
        assert "div.full" not in ptx and not re.search(r"(?<!r)sqrt\.approx", ptx)
    compile_ptx(triton_adafactor._update_sq_kernel, {"meta": "*i64", "tiles": "*i32", **scratch,
                "partials": "*fp32", "beta2t": "fp32", "one_minus_beta2t": "fp32", "eps1": "fp32"},
                {"BLOCKS": 4, **adafactor})
    clip = {"meta": "*i64", "partials": "*fp32", "clip_denominators": "*fp32", "inverse_clip_threshold": "fp32"}
    ptx = compile_ptx(triton_adafactor._clip_kernel, clip, {"CHUNK": 1024, "BLOCKS": 4, **adafactor})
    assert "div.full" not in ptx and "sqrt.approx" not in ptx
    for stochastic in (False, True):
        compile_ptx(triton_adafactor._apply_kernel, {"meta": "*i64", "tiles": "*i32", **scratch,
                    "clip_denominators": "*fp32", "lrs": "*fp32", "eps1": "fp32", "negative_decay": "fp32",
                    "qmap": "*fp32", "table": "*i32", "beta1": "fp32", "one_minus_beta1": "fp32", "ordinals": "*i64",
                    "sr_key": "*i64"}, {"HAS_M": True, "HAS_DECAY": True, "BLOCKS": 4, "SR": stochastic, **adafactor})


if __name__ == "__main__":
    import hf_optim  # noqa: F401  (registers the algorithms)

    for family in registry.families():
        if family.algorithm.triton_rule is not None:
            check_fused_update(family.algorithm)
    check_fused_update(registry.lookup_algorithm("adamw").algorithm, stochastic=True)
    check_other_kernels()
    print("all kernels compiled")
