"""Optimizer step time, side by side in one run: hf_optim vs torch.optim.AdamW and bitsandbytes.

    python benchmarks/step_time.py                      # CPU, one 4096x4096 fp32 tensor (16.8M elements)
    python benchmarks/step_time.py --device cuda --shapes 4096x4096 --dtype bf16      # (a) one large tensor
    python benchmarks/step_time.py --device cuda --shapes llama-3.2-1b --dtype bf16   # (b) every Llama-3.2-1B tensor

Prints ms per step (median of timed steps after warm-up; the first step, which includes any compilation, is
reported separately), achieved GB/s from the bytes each optimizer must stream (optimizers.md section 5: parameter
read and write, gradient read, each state read and written, 8-bit absmax included), the % of the memory
bandwidth peak on GPUs (from a table of known cards, or ``--peak-gbs``), and the ratios the project tracks:
hf_optim / bitsandbytes and hf_optim / torch fused AdamW. hf_optim's backend (``triton`` on CUDA when triton is
installed; ``HF_OPTIM_BACKEND`` forces one) is printed in the header.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
import warnings
from collections.abc import Callable

import torch

import hf_optim

LLAMA_3_2_1B = dict(hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8, head_dim=64, vocab=128256)


def llama_shapes(cfg: dict) -> list[tuple[int, ...]]:
    """Trainable tensor shapes of a Llama model (tied embeddings) from its config numbers."""
    h, i, kv = cfg["hidden"], cfg["intermediate"], cfg["kv_heads"] * cfg["head_dim"]
    per_layer = [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i), (h,), (h,)]
    return [(cfg["vocab"], h)] + per_layer * cfg["layers"] + [(h,)]


PEAK_GBS = {
    # Memory bandwidth peaks (GB/s) from the vendors' data sheets, matched against torch.cuda.get_device_name().
    "H200": 4800, "H100 NVL": 3900, "H100 PCIe": 2000, "H100": 3350, "GH200": 4000, "B200": 8000,
    "A100-SXM4-80GB": 2039, "A100 80GB PCIe": 1935, "A100-SXM4-40GB": 1555, "A100-PCIE-40GB": 1555,
    "L40S": 864, "L40": 864, "L4": 300, "A10G": 600, "A10": 600, "T4": 320, "V100": 900,
    "RTX 4090": 1008, "RTX 3090": 936, "MI300X": 5300, "MI250X": 3277,
}


def peak_bandwidth(device: str) -> tuple[str, float]:
    """(device name, peak GB/s or 0 when unknown) for a CUDA/ROCm device; the longest matching key wins."""
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return device, 0.0
    name = torch.cuda.get_device_name(torch.device(device))
    matches = [key for key in PEAK_GBS if key.lower() in name.lower()]
    return name, float(PEAK_GBS[max(matches, key=len)]) if matches else 0.0


def bytes_per_element(name: str, param_bytes: int) -> float:
    """Bytes an optimizer step must read and write per parameter element (p read+write, g read, state r+w)."""
    state = {"8bit": 2 * 1.0 + 2 * 4 / 256, "32bit": 2 * 4.0}
    states = 3 if "AdEMAMix" in name else (1 if ("Lion" in name or "RMSprop" in name) else 2)
    kind = "8bit" if "8bit" in name else "32bit"
    return 3 * param_bytes + states * state[kind]


def time_steps(make: Callable, params: list[torch.Tensor], steps: int, warmup: int) -> tuple[float, float]:
    """(first step seconds, median seconds of the timed steps)."""
    opt = make(params)
    sync = torch.cuda.synchronize if params[0].is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    opt.step()
    sync()
    first = time.perf_counter() - start
    for _ in range(warmup):
        opt.step()
    times = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        opt.step()
        sync()
        times.append(time.perf_counter() - start)
    return first, statistics.median(times)


def bnb_class(bnb, name: str) -> Callable:
    """bitsandbytes' class for ``name``; its ``AdEMAMix32bit`` crashes on CPU (it inherits the generic two-state
    base), so the 32-bit AdEMAMix row uses ``AdEMAMix(optim_bits=32)``, the same algorithm through its own base."""
    if name == "AdEMAMix32bit":
        return functools.partial(bnb.optim.AdEMAMix, optim_bits=32)
    return getattr(bnb.optim, name)


def contenders(include_bnb: bool, device: str) -> list[tuple[str, Callable]]:
    """(row name, optimizer factory); bitsandbytes' rows use its CUDA kernels on a CUDA device."""
    rows: list[tuple[str, Callable]] = [
        ("torch AdamW fused", lambda p: torch.optim.AdamW(p, fused=True)),
        ("torch AdamW foreach", lambda p: torch.optim.AdamW(p, foreach=True)),
    ]
    for name in ("AdamW8bit", "AdamW32bit", "AdEMAMix8bit", "AdEMAMix32bit", "Lion8bit", "Lion32bit", "LAMB8bit",
                 "LAMB32bit", "RMSprop8bit"):
        rows.append((f"hf_optim {name}", getattr(hf_optim, name)))
        if include_bnb and name not in ("LAMB8bit", "LAMB32bit"):  # bitsandbytes' LAMB is another algorithm
            import bitsandbytes as bnb

            rows.append((f"bitsandbytes {name}", bnb_class(bnb, name)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shapes", default="4096x4096", help="'4096x4096', comma-separated shapes, or llama-3.2-1b")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-bnb", action="store_true", help="skip bitsandbytes")
    parser.add_argument("--only", default="", help="comma-separated substrings: run only matching rows")
    parser.add_argument("--peak-gbs", type=float, default=0.0,
                        help="memory bandwidth peak in GB/s for the %% column (default: looked up by GPU name)")
    args = parser.parse_args()

    if args.shapes == "llama-3.2-1b":
        shapes = llama_shapes(LLAMA_3_2_1B)
    else:
        shapes = [tuple(int(d) for d in s.split("x")) for s in args.shapes.split(",")]
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    numel = sum(torch.Size(s).numel() for s in shapes)
    param_bytes = torch.empty((), dtype=dtype).element_size()
    backend = hf_optim.AdamW8bit([torch.zeros(1, device=args.device)]).backend
    device_name, peak = peak_bandwidth(args.device)
    if args.peak_gbs:
        peak = args.peak_gbs
    print(f"device={args.device} ({device_name}) dtype={args.dtype} tensors={len(shapes)} elements={numel:,} "
          f"torch={torch.__version__} threads={torch.get_num_threads()} hf_optim backend={backend}"
          + (f" peak={peak:.0f} GB/s" if peak else ""))

    results: dict[str, float] = {}
    header = f"{'optimizer':<28}{'first step s':>13}{'ms/step':>10}{'GB/s':>8}"
    print(header + (f"{'% peak':>8}" if peak else ""))
    for name, make in contenders(not args.no_bnb, args.device):
        if args.only and not any(s in name for s in args.only.split(",")):
            continue
        gen = torch.Generator(device=args.device).manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, device=args.device, dtype=dtype, generator=gen)) for s in shapes]
        for p in params:
            p.grad = torch.randn(p.shape, device=args.device, dtype=dtype, generator=gen)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                first, median = time_steps(make, params, args.steps, args.warmup)
            except Exception as error:  # report and go on: one failing contender must not hide the others
                print(f"{name:<28}  failed: {type(error).__name__}: {error}")
                continue
        results[name] = median
        gbs = bytes_per_element(name, param_bytes) * numel / median / 1e9
        line = f"{name:<28}{first:>13.2f}{median * 1e3:>10.1f}{gbs:>8.1f}"
        if peak:
            line += f"{100 * gbs / peak:>8.1f}"
        print(line, flush=True)
        del params
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()

    print("\nratios (lower is faster):")
    fused = results.get("torch AdamW fused")
    for name, median in results.items():
        if not name.startswith("hf_optim"):
            continue
        algo = name.split(" ", 1)[1]
        parts = []
        if f"bitsandbytes {algo}" in results:
            parts.append(f"{median / results[f'bitsandbytes {algo}']:.3f}x bitsandbytes")
        if fused:
            parts.append(f"{median / fused:.2f}x torch fused AdamW")
        print(f"  {name:<26} " + ", ".join(parts))


if __name__ == "__main__":
    main()
