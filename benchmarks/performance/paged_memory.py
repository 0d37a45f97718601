"""Paged 8-bit AdamW against unpaged, side by side: step time, peak torch-allocated memory, and resume.

    python benchmarks/performance/paged_memory.py                                 # all parts, Llama-3.2-1B shapes, CUDA
    python benchmarks/performance/paged_memory.py --parts speed --rounds 10
    python benchmarks/performance/paged_memory.py --parts pressure  # ordinary allocations crowd the state out
    python benchmarks/performance/paged_memory.py --model tiny --device cpu  # smoke run (no paging)

Parts:

* ``speed``: with everything fitting, ``PagedAdamW8bit.step()`` vs ``AdamW8bit.step()`` on the parameters of a
  Llama-3.2-1B-shaped model (bf16), interleaved rounds timed with CUDA events; prints the paged / unpaged ratio
  (the project's target: within 5%) and the host time of each step (the time ``step()`` takes to return).
* ``peak``: ``torch.cuda.max_memory_allocated`` of a full fine-tuning step (forward, backward, optimizer step) of
  that model, built from its config with random weights in bf16, for each optimizer; the paged run should be
  lower by about the paged state size, which torch's allocator does not see (it is managed memory).
* ``resume``: save the paged optimizer's state dict with ``torch.save``, ``torch.load(weights_only=True)`` it
  into a new paged optimizer, and check with ``cudaPointerGetAttributes`` that the state is still managed memory;
  then compare the peak of a step before and after the resume.
* ``pressure``: fill the card with ordinary device allocations until about half of the paged state is evicted to
  host and time the paged step against the same step without pressure, then the first step after the fillers are
  freed (which prefetches the state back: ``hf_optim.paging.short_of_memory``) and the steps after it.

Managed memory is never requested beyond half of what ``torch.cuda.mem_get_info`` reports free: a shared GPU can
hang when managed memory is oversubscribed. Pressure is made with ordinary allocations only.
"""

from __future__ import annotations

import argparse
import gc
import io
import statistics
import time
import warnings

import torch

import hf_optim
from hf_optim.paging import PAGED_MIN_NUMEL, cudart, managed

GIB = 2**30
MODELS = {
    # Public Llama-3.2-1B config values (hidden, intermediate, layers, heads, kv heads, vocab; tied embeddings).
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256),
    "tiny": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=4096),
}


def build_model(name: str, device: str, seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**MODELS[name], tie_word_embeddings=True, rope_theta=500000.0, max_position_embeddings=4096)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    return model


def managed_estimate(params: list[torch.Tensor]) -> int:
    """Bytes of managed memory PagedAdamW8bit will ask for: two uint8 codes per element of each big tensor."""
    return sum(2 * p.numel() for p in params if p.numel() >= PAGED_MIN_NUMEL)


def require_free(managed_bytes: int, device: str) -> None:
    """Refuse to run when the managed state would take more than half of the card's free memory."""
    if not device.startswith("cuda"):
        return
    free, total = torch.cuda.mem_get_info()
    if managed_bytes > free // 2:
        raise SystemExit(
            f"refusing: the paged state needs {managed_bytes / GIB:.2f} GiB of managed memory and the card has "
            f"{free / GIB:.2f} of {total / GIB:.2f} GiB free (the limit is half of the free memory)"
        )


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def peak_allocated(device: str) -> int:
    return torch.cuda.max_memory_allocated() if device.startswith("cuda") else 0


def reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()


def device_used(device: str) -> int:
    """What the card reports in use (nvidia-smi's view): torch's reservations plus resident managed pages."""
    if not device.startswith("cuda"):
        return 0
    free, total = torch.cuda.mem_get_info()
    return total - free


def cleanup(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def make_optimizer(cls: type, params) -> torch.optim.Optimizer:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU fallback notice in a --device cpu smoke run
        return cls(params)


def random_grads(params: list[torch.Tensor], seed: int) -> None:
    gen = torch.Generator(device=params[0].device).manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, device=p.device, dtype=p.dtype) * 1e-3


def timed_steps(opt: torch.optim.Optimizer, steps: int, device: str) -> float:
    """Milliseconds per step over ``steps`` steps."""
    return timed_steps_with_host(opt, steps, device)[0]


def timed_steps_with_host(opt: torch.optim.Optimizer, steps: int, device: str) -> tuple[float, float]:
    """(milliseconds per step, host milliseconds per step: the time ``step()`` takes to return, before waiting for
    the device) over ``steps`` steps. A step is host-bound when its host time reaches its step time."""
    if device.startswith("cuda"):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        begin = time.perf_counter()
        for _ in range(steps):
            opt.step()
        host = (time.perf_counter() - begin) * 1000 / steps
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / steps, host
    begin = time.perf_counter()
    for _ in range(steps):
        opt.step()
    wall = (time.perf_counter() - begin) * 1000 / steps
    return wall, wall


def shortage(device: str) -> str:
    """Whether the device is short of memory now (``hf_optim.paging.short_of_memory``: a paged step prefetches only
    at the first step after a shortage), with the numbers it is decided from."""
    if not device.startswith("cuda"):
        return "no (no paging off CUDA)"
    free, _ = torch.cuda.mem_get_info()
    paged = hf_optim.paging.managed_bytes()
    short = hf_optim.paging.short_of_memory(free, paged)
    return f"{'yes' if short else 'no'} ({free / GIB:.2f} GiB free, {paged / GIB:.3f} GiB paged)"


def part_speed(args) -> None:
    model = build_model(args.model, args.device)
    params = [p for p in model.parameters() if p.requires_grad]
    require_free(managed_estimate(params), args.device)
    random_grads(params, seed=1)
    optimizers = {cls.__name__: make_optimizer(cls, params) for cls in (hf_optim.AdamW8bit, hf_optim.PagedAdamW8bit)}
    for opt in optimizers.values():
        timed_steps(opt, args.warmup, args.device)  # creates the state; warms kernels and caches
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in optimizers}
    for _ in range(args.rounds):  # interleaved, so drift in clocks or neighbours hits both alike
        for name, opt in optimizers.items():
            times[name].append(timed_steps_with_host(opt, args.steps, args.device))
    (unpaged, unpaged_host), (paged, paged_host) = (
        (statistics.median(t for t, _ in times[name]), statistics.median(h for _, h in times[name]))
        for name in ("AdamW8bit", "PagedAdamW8bit")
    )
    elements = sum(p.numel() for p in params)
    print(f"\n## speed: optimizer step, {args.model} parameters ({elements / 1e9:.3f}B elements, bf16), "
          f"median of {args.rounds} rounds x {args.steps} steps")
    print("| optimizer | ms/step | host ms/step | paged / unpaged |\n|---|---:|---:|---:|")
    print(f"| AdamW8bit | {unpaged:.2f} | {unpaged_host:.2f} | |")
    print(f"| PagedAdamW8bit | {paged:.2f} | {paged_host:.2f} | {paged / unpaged:.3f}x |")
    memory = hf_optim.state_memory(optimizers["PagedAdamW8bit"])
    print(f"paged state: {memory.paged_bytes / GIB:.3f} GiB managed of {memory.total_bytes / GIB:.3f} GiB")
    print(f"device short of memory (a step prefetches only right after a shortage): {shortage(args.device)}")
    print(f"target paged / unpaged <= 1.05: {'met' if paged / unpaged <= 1.05 else 'NOT met'}")
    del optimizers, model, params
    cleanup(args.device)


def finetune_step(model, opt, batch: torch.Tensor) -> None:
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def part_peak(args) -> None:
    rows = []
    for cls in (hf_optim.AdamW8bit, hf_optim.PagedAdamW8bit):
        model = build_model(args.model, args.device)
        require_free(managed_estimate(list(model.parameters())), args.device)
        opt = make_optimizer(cls, model.parameters())
        gen = torch.Generator().manual_seed(0)
        batch = torch.randint(0, model.config.vocab_size, (args.batch, args.seq_len), generator=gen)
        batch = batch.to(args.device)
        finetune_step(model, opt, batch)  # first step creates the optimizer state
        sync(args.device)
        reset_peak(args.device)
        finetune_step(model, opt, batch)
        sync(args.device)
        memory = hf_optim.state_memory(opt)
        rows.append((cls.__name__, peak_allocated(args.device), memory.total_bytes, memory.paged_bytes,
                     device_used(args.device)))
        del model, opt, batch
        cleanup(args.device)
    print(f"\n## peak: full fine-tuning step, {args.model} (bf16, random init), batch {args.batch} x "
          f"{args.seq_len} tokens; peak measured over the second step")
    print("| optimizer | max_memory_allocated GiB | state GiB | paged (managed) GiB | device in use GiB |")
    print("|---|---:|---:|---:|---:|")
    for name, peak, total, paged, used in rows:
        print(f"| {name} | {peak / GIB:.3f} | {total / GIB:.3f} | {paged / GIB:.3f} | {used / GIB:.3f} |")
    saved = rows[0][1] - rows[1][1]
    paged = rows[1][3]
    ratio = f"{saved / paged:.3f}" if paged else "n/a (nothing paged)"
    print(f"peak lowered by {saved / GIB:.3f} GiB; paged state {paged / GIB:.3f} GiB; lowered / paged = {ratio}")


def is_managed(tensor: torch.Tensor) -> bool:
    if not tensor.is_cuda:
        return False
    return managed.runtime().pointer_type(tensor.data_ptr()) == cudart.MEMORY_TYPE_MANAGED


def count_managed(opt: torch.optim.Optimizer) -> tuple[int, int]:
    """(state buffers in managed memory, state buffers big enough to be paged)."""
    buffers = [
        value for state in opt.state.values() for key, value in state.items()
        if key in ("state1", "state2") and value.numel() >= PAGED_MIN_NUMEL
    ]
    return sum(is_managed(b) for b in buffers), len(buffers)


def part_resume(args) -> None:
    model = build_model(args.model, args.device)
    require_free(2 * managed_estimate(list(model.parameters())), args.device)  # two optimizers alive at once
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, model.config.vocab_size, (args.batch, args.seq_len), generator=gen).to(args.device)
    opt = make_optimizer(hf_optim.PagedAdamW8bit, model.parameters())
    finetune_step(model, opt, batch)
    sync(args.device)
    reset_peak(args.device)
    finetune_step(model, opt, batch)
    sync(args.device)
    peak_before = peak_allocated(args.device)
    before = count_managed(opt)

    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    size = buffer.tell()
    buffer.seek(0)
    del opt
    cleanup(args.device)
    loaded = torch.load(buffer, weights_only=True)
    on_cpu = all(
        t.device.type == "cpu" for s in loaded["state"].values()
        for t in [*s.values(), *s.get("__bnb_optimizer_quant_state__", {}).values()] if isinstance(t, torch.Tensor)
    )
    resumed = make_optimizer(hf_optim.PagedAdamW8bit, model.parameters())
    resumed.load_state_dict(loaded)
    del loaded
    after = count_managed(resumed)
    sync(args.device)
    reset_peak(args.device)
    finetune_step(model, resumed, batch)
    sync(args.device)
    peak_after = peak_allocated(args.device)
    print(f"\n## resume: PagedAdamW8bit, {args.model}; checkpoint {size / GIB:.3f} GiB, all tensors on CPU: {on_cpu}")
    print(f"managed state buffers before save: {before[0]}/{before[1]}; after load_state_dict: {after[0]}/{after[1]}")
    print(f"max_memory_allocated of a step: before save {peak_before / GIB:.3f} GiB, after resume "
          f"{peak_after / GIB:.3f} GiB")
    del resumed, model
    cleanup(args.device)


def part_pressure(args) -> None:
    if not args.device.startswith("cuda"):
        print("\n## pressure: needs CUDA (skipped)")
        return
    model = build_model(args.model, args.device)
    params = [p for p in model.parameters() if p.requires_grad]
    require_free(managed_estimate(params), args.device)
    random_grads(params, seed=1)
    opt = make_optimizer(hf_optim.PagedAdamW8bit, params)
    timed_steps(opt, args.warmup, args.device)
    relaxed = statistics.median(timed_steps(opt, args.steps, args.device) for _ in range(3))
    paged = hf_optim.state_memory(opt).paged_bytes
    relaxed_short = shortage(args.device)
    # The step's temporaries are cached by torch's allocator after the warm-up. Free memory does not include the
    # resident managed pages, so the fillers take all of it (less the headroom) and half the paged state's size on
    # top: the driver evicts about that much to host, and every step faults pages back (and evicts others).
    sync(args.device)
    free, _ = torch.cuda.mem_get_info()
    fillers, remaining, chunk = [], free + paged // 2 - int(args.headroom_gib * GIB), GIB
    while remaining > 2**20 and chunk >= 2**24:
        size = min(remaining, chunk)
        try:
            fillers.append(torch.empty(size, dtype=torch.uint8, device=args.device))  # ordinary memory only
            remaining -= size
        except torch.OutOfMemoryError:  # the driver would not evict that much: smaller pieces
            chunk //= 2
    filled = sum(f.numel() for f in fillers)
    try:
        pressed_short = shortage(args.device)
        pressed = statistics.median(timed_steps(opt, args.steps, args.device) for _ in range(3))
    finally:
        del fillers
        cleanup(args.device)
    sync(args.device)
    recovered_short = shortage(args.device)
    first = timed_steps(opt, 1, args.device)  # prefetches the whole state back: the shortage has just ended
    after = statistics.median(timed_steps(opt, args.steps, args.device) for _ in range(3))
    print(f"\n## pressure: PagedAdamW8bit step, {args.model}; {filled / GIB:.2f} GiB of ordinary allocations "
          f"({(filled - free) / GIB:+.2f} GiB beyond what was free) crowd out about half of the "
          f"{paged / GIB:.3f} GiB paged state")
    print("| condition | ms/step | device short of memory |\n|---|---:|---|")
    print(f"| everything fits | {relaxed:.2f} | {relaxed_short} |")
    print(f"| under pressure (page faults, no prefetch) | {pressed:.2f} | {pressed_short} |")
    print(f"| first step after the fillers are freed (prefetch) | {first:.2f} | {recovered_short} |")
    print(f"| the steps after it | {after:.2f} | |")
    print(f"pressure / fits = {pressed / relaxed:.2f}x (pages move over PCIe/NVLink-C2C every step); "
          f"after / fits = {after / relaxed:.2f}x (should be about 1: the state is resident again)")
    del opt, model, params
    cleanup(args.device)


PARTS = {"speed": part_speed, "peak": part_peak, "resume": part_resume, "pressure": part_pressure}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="llama-3.2-1b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--parts", default="speed,peak,resume", help=f"comma-separated, from {sorted(PARTS)}")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps per timed round")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds (speed)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--headroom-gib", type=float, default=0.25,
                        help="room left for managed pages beyond half the paged state (pressure)")
    args = parser.parse_args()
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"unknown part(s) {unknown}; valid: {sorted(PARTS)}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU (or --model tiny --device cpu for a smoke run)")
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, device "
          f"{torch.cuda.get_device_name() if args.device.startswith('cuda') else args.device}")
    if args.device.startswith("cuda"):
        print(f"CUDA runtime used for paging: {managed.runtime().path} (version {managed.runtime().version})")
    for part in parts:
        PARTS[part](args)


if __name__ == "__main__":
    main()
