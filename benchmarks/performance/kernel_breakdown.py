"""Where the compiled 8-bit CPU kernel's time goes: one AdamW8bit chunk, with pieces of the kernel replaced.

Each variant replaces one piece (map lookups, encoder table lookups, the fp32 -> int32 reinterpretation) by an
operation of the same shape without it. The math is then WRONG: this measures time only. Each variant runs in a
fresh process (the replacement must be in place before inductor compiles), with glibc's mmap and trim thresholds
raised so that page faults do not blur the figures.

    python benchmarks/performance/kernel_breakdown.py [--numel 262144]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

VARIANTS = {
    "the kernel as shipped": "",
    "dequantize without the map lookup": "nodq",
    "encoder without the table lookup": "notab",
    "encoder without the fp32 -> int32 reinterpretation": "nobits",
    "neither table lookup nor reinterpretation in the encoder": "notab,nobits",
    "no lookup and no reinterpretation at all": "nodq,notab,nobits",
}


def patch(variant: set[str]) -> None:
    import torch

    from hf_optim.formats import quant8 as blockwise
    from hf_optim.formats.dynamic_map import KEY_SHIFT, LOW_MASK, encoder_keys

    if "nodq" in variant:
        blockwise.dequantize = lambda codes, absmax, qmap: codes.float() * absmax.unsqueeze(-1)
    if variant & {"notab", "nobits"}:
        def encode_int8(normalized, table, signed):
            bits = (normalized * 1e6).int() if "nobits" in variant else normalized.view(torch.int32)
            keys = encoder_keys(bits)
            entry = keys if "notab" in variant else torch.ops.aten._unsafe_index(table, [keys])
            further = ((bits & LOW_MASK) > (entry & LOW_MASK)).int()
            if signed:
                further = torch.where(bits < 0, -further, further)
            return ((entry >> KEY_SHIFT) + further).to(torch.int8)

        blockwise.encode_int8 = encode_int8


def measure(numel: int) -> float:
    import torch

    from hf_optim.formats import BLOCKWISE8, SlotLayout
    from hf_optim.formats.blockwise8 import shared_map
    from hf_optim.formats.dynamic_map import encoder_table
    from hf_optim.kernels.torch_path import multi_tensor
    from hf_optim.optim.adamw import ADAMW

    torch.manual_seed(0)
    blocks = numel // 256
    param, grad = torch.randn(blocks, 256), torch.randn(blocks, 256)
    tensors = []
    for signed in (True, False):
        codes = torch.randint(0, 256, (1, blocks, 256), dtype=torch.uint8).view(torch.int8)
        tensors += [codes, torch.rand(1, blocks), shared_map(signed, "cpu"), encoder_table(signed, "cpu")]
    hyper = multi_tensor.hyper_tensors(ADAMW.hyper_at(
        {"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.01, "eps": 1e-8}, 3))
    layouts = (SlotLayout(BLOCKWISE8, True), SlotLayout(BLOCKWISE8, False))

    def run() -> None:
        multi_tensor.run_update(ADAMW.rule, layouts, param, grad, None, tensors, hyper)

    for _ in range(3):
        run()
    reps = max(3, (1 << 24) // numel)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(reps):
            run()
        best = min(best, (time.perf_counter() - start) / reps / numel * 1e9)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1 << 18, help="elements of the chunk (a multiple of 256)")
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # internal: run one variant in this process
    args = parser.parse_args()
    if args.variant is not None:
        os.environ["HF_OPTIM_COMPILE"] = "1"  # compiled before the first call (not in the background)
        patch(set(filter(None, args.variant.split(","))))
        print(f"{measure(args.numel):.3f}")
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "1000000000", "MALLOC_TRIM_THRESHOLD_": "1000000000"}
    print(f"AdamW8bit chunk of {args.numel} elements, best of 5, wall time per element (all threads)\n")
    print("| variant | ns per element |\n|---|---:|")
    for label, variant in VARIANTS.items():
        out = subprocess.run([sys.executable, __file__, "--numel", str(args.numel), "--variant", variant],
                             capture_output=True, text=True, env=env, check=True).stdout.split()[-1]
        print(f"| {label} | {out} |", flush=True)


if __name__ == "__main__":
    main()
