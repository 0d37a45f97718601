"""Where a GPU optimizer step's time goes: synced wall, host enqueue time, device kernel time, host hot spots.

    python3 benchmarks/gpu/step_profile.py      # on a CUDA machine, from the repository root

Sets: the LoRA set, one 4096x4096 tensor and the Llama-3.2-1B set of benchmarks/performance/step_time.py, bf16
parameters.
"""
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "performance"))
from step_time import fresh_params, shape_set  # noqa: E402

import hf_optim  # noqa: E402


def profile(set_name: str, name: str, make, steps: int = 20, cprof: bool = True) -> None:
    params = fresh_params(shape_set(set_name), torch.bfloat16, "cuda")
    opt = make(params)
    for _ in range(5):
        opt.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        opt.step()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / steps
    start = time.perf_counter()
    for _ in range(steps):
        opt.step()
    host = (time.perf_counter() - start) / steps
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            opt.step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    device = sum(e.self_device_time_total for e in events) / steps / 1e3
    launches = sum(e.count for e in events if e.self_device_time_total > 0) / steps
    print(f"\n##### {set_name} {name}: wall {wall * 1e3:.2f} ms (synced) | host enqueue {host * 1e3:.2f} ms "
          f"| device kernels {device:.2f} ms | {launches:.0f} device ops per step")
    print(events.table(sort_by="self_device_time_total", row_limit=8, max_name_column_width=60))
    if cprof:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(steps):
            opt.step()
        torch.cuda.synchronize()
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(18)
    del opt, params
    torch.cuda.empty_cache()


for set_name in ("llama-3.2-1b-lora", "4096x4096", "llama-3.2-1b"):
    profile(set_name, "hf_optim AdamW8bit", hf_optim.AdamW8bit, cprof=set_name != "llama-3.2-1b")
    profile(set_name, "torch AdamW fused", lambda p: torch.optim.AdamW(p, fused=True), cprof=False)
profile("llama-3.2-1b", "hf_optim PagedAdamW8bit", hf_optim.PagedAdamW8bit)
profile("llama-3.2-1b-lora", "hf_optim AdamW32bit", hf_optim.AdamW32bit, cprof=False)
