"""Optimizer step time, side by side in one run: hf_optim vs torch.optim.AdamW and bitsandbytes, on shape sets.

    python benchmarks/performance/step_time.py  # CPU: every preset shape set, one table
    python benchmarks/performance/step_time.py --sets llama-3.2-1b-lora --steps 10 # one set
    python benchmarks/performance/step_time.py --device cuda --sets 4096x4096,llama-3.2-1b --dtype bf16

Shape sets (``--sets``, separated by commas; a set is a preset name or shapes joined by ``+``, e.g. ``64x80+5000``):

- ``quickstart-lora``: the 28 LoRA adapters (r=32) of the quickstart recipe's tiny model (77,824 elements; the
  1024-element ones are below ``min_8bit_size``, so an 8-bit optimizer keeps two state layouts);
- ``4096x4096``: one 16.8M-element tensor (the easiest case: one big contiguous update);
- ``llama-3.2-1b-lora``: the 224 LoRA adapters (r=16, q/k/v/o/gate/up/down of 16 layers; A is r x in, B is
  out x r), 11.27M elements: what the LoRA recipes step;
- ``llama-3.2-1b``: every Llama-3.2-1B tensor (146, 1.24B elements; a full fine-tune).

Prints one table: per set and optimizer, ms per step (median of ``--steps`` timed steps after ``--warmup``; the
first step, which includes compilation, is reported separately), and the ratios the project tracks:
``x ref`` = hf_optim / its reference (bitsandbytes' class of the same name; transformers' Adafactor) and
``x fused`` = row / torch fused AdamW, all from the same run. ``--gbs`` adds
achieved GB/s from the bytes each optimizer must stream (optimizers.md section 5) and the % of the memory
bandwidth peak on GPUs. hf_optim's backend (``triton`` on CUDA when triton is installed, ``torch-compile`` on CPU;
``HF_OPTIM_BACKEND`` and ``HF_OPTIM_COMPILE=0`` change it) is printed in the header.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

import hf_optim

try:
    from hf_optim.kernels.torch_path import cpu_compile, cpu_threads
except ImportError:  # hf_optim before issue 23 (first_step.py compares with it): nothing to wait for
    cpu_compile = cpu_threads = None

LLAMA_3_2_1B = dict(hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8, head_dim=64, vocab=128256)


def llama_shapes(cfg: dict) -> list[tuple[int, ...]]:
    """Trainable tensor shapes of a Llama model (tied embeddings) from its config numbers."""
    h, i, kv = cfg["hidden"], cfg["intermediate"], cfg["kv_heads"] * cfg["head_dim"]
    per_layer = [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i), (h,), (h,)]
    return [(cfg["vocab"], h)] + per_layer * cfg["layers"] + [(h,)]


def llama_lora_shapes(cfg: dict, rank: int = 16) -> list[tuple[int, ...]]:
    """LoRA adapter shapes on every linear layer of a Llama model: A is (rank, in), B is (out, rank)."""
    h, i, kv = cfg["hidden"], cfg["intermediate"], cfg["kv_heads"] * cfg["head_dim"]
    linears = [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)]  # (in, out): q, k, v, o, gate, up, down
    return [shape for fan_in, fan_out in linears for shape in ((rank, fan_in), (fan_out, rank))] * cfg["layers"]


QUICKSTART_MODEL = dict(hidden=64, intermediate=192, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=512)
"""``hf_optim.tiny.tiny_llama``'s numbers: the quickstart recipe's model."""

PRESETS = {
    "quickstart-lora": lambda: llama_lora_shapes(QUICKSTART_MODEL, rank=32),
    "4096x4096": lambda: [(4096, 4096)],
    "llama-3.2-1b-lora": lambda: llama_lora_shapes(LLAMA_3_2_1B),
    "llama-3.2-1b": lambda: llama_shapes(LLAMA_3_2_1B),
}


def shape_set(spec: str) -> list[tuple[int, ...]]:
    """A preset's shapes, or ``AxB+C+...`` parsed; a bad spec names the presets."""
    if spec in PRESETS:
        return PRESETS[spec]()
    try:
        return [tuple(int(d) for d in shape.split("x")) for shape in spec.split("+")]
    except ValueError:
        raise SystemExit(
            f"unknown shape set {spec!r}: use one of {', '.join(PRESETS)} or shapes like 64x80+5000"
        ) from None


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
    # read + write of codes and scales: stochastic4 one fp32 scale per 64, blockwise4 per 128, 8-bit per 256
    state = {"4bitBlockwise": 2 * 0.5 + 2 * 4 / 128, "4bitRank1": 2 * 0.5, "4bit": 2 * 0.5 + 2 * 4 / 64,
             "8bit": 2 * 1.0 + 2 * 4 / 256, "32bit": 2 * 4.0}
    states = 3 if "AdEMAMix" in name else (1 if ("Lion" in name or "RMSprop" in name) else 2)
    kind = next((kind for kind in ("4bitBlockwise", "4bitRank1", "4bit", "8bit") if kind in name), "32bit")
    return 3 * param_bytes + states * state[kind]


def rss_bytes(field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (peak since the last reset) of this process, from /proc (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def track_large_allocations() -> None:
    """Make glibc map every allocation of 64 KiB or more on its own and unmap it when freed, so the resident set
    follows the live tensors (by default glibc keeps freed memory for reuse and the peak would hide)."""
    import ctypes

    m_mmap_threshold = -3
    ctypes.CDLL("libc.so.6").mallopt(m_mmap_threshold, 64 * 1024)


def step_peak_extra_bytes(opt) -> int:
    """How far one step's peak resident memory rises above the resident memory before it (CPU, Linux): the
    kernel's high-water mark is reset first (``clear_refs`` 5). Temporaries, scratch and padding all count."""
    Path("/proc/self/clear_refs").write_text("5")
    before = rss_bytes("VmRSS")
    opt.step()
    return rss_bytes("VmHWM") - before


def time_steps(make: Callable, params: list[torch.Tensor], steps: int, warmup: int, memory: bool = False
               ) -> tuple[float, float, int | None]:
    """(first step seconds, median seconds of the timed steps, peak extra bytes of a step or None)."""
    opt = make(params)
    sync = torch.cuda.synchronize if params[0].is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    opt.step()
    sync()
    first = time.perf_counter() - start
    if cpu_compile is not None:  # HF_OPTIM_COMPILE=auto: a small set's first steps run eagerly while compiling
        cpu_compile.wait()
    for _ in range(warmup):
        opt.step()
    times = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        opt.step()
        sync()
        times.append(time.perf_counter() - start)
    return first, statistics.median(times), step_peak_extra_bytes(opt) if memory else None


@contextlib.contextmanager
def busy_processes(count: int):
    """``count`` processes spinning on the CPU (a pure-Python loop each, at this process's priority, as dataloader
    workers or a second job would be) for the duration of the block; they are killed on the way out."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        if spinners:
            time.sleep(1.0)  # past their interpreter start-up: spinning
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
        for spinner in spinners:
            spinner.wait()


def time_busy(opt, steps: int, levels: list[int], rounds: int, settle: int) -> dict[int, tuple]:
    """{busy processes: (median wall seconds per step, CPU seconds of this process per step)} for an optimizer that
    has already stepped (compiled and warm); the levels take turns, ``rounds`` times: ``settle`` untimed steps
    under the new load (the thread-count choice adapts), then ``steps`` timed ones."""
    walls: dict[int, list[float]] = {level: [] for level in levels}
    cpus: dict[int, list[float]] = {level: [] for level in levels}
    for _ in range(rounds):
        for level in levels:
            with busy_processes(level):
                for _ in range(settle):
                    opt.step()
                for _ in range(steps):
                    wall, cpu = time.perf_counter(), time.process_time()
                    opt.step()
                    walls[level].append(time.perf_counter() - wall)
                    cpus[level].append(time.process_time() - cpu)
    return {level: (statistics.median(walls[level]), statistics.median(cpus[level])) for level in levels}


@contextlib.contextmanager
def kernel_threads(count: int | None):
    """hf_optim's compiled CPU kernels run with ``count`` OpenMP threads in the block (None: torch's count), not
    with the thread-count choice's (``hf_optim.kernels.torch_path.cpu_threads``)."""
    choose = cpu_compile.threads_for
    cpu_compile.threads_for = lambda kernel: count
    try:
        yield
    finally:
        cpu_compile.threads_for = choose


class TorchThreads:
    """An hf_optim optimizer whose compiled CPU kernels always run with torch's thread count: the behaviour before
    the thread-count choice, for comparison."""

    def __init__(self, opt) -> None:
        self.opt = opt

    def step(self) -> None:
        with kernel_threads(None):
            self.opt.step()


class OneThread:
    """An optimizer whose step runs with one thread: hf_optim's compiled kernels with their one-thread variant, any
    other optimizer's ATen operations with ``torch.set_num_threads(1)``; the floor a busy machine is compared with."""

    def __init__(self, opt) -> None:
        self.opt = opt

    def step(self) -> None:
        if isinstance(self.opt, hf_optim.HfOptimizer):
            with kernel_threads(1):
                self.opt.step()
            return
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            self.opt.step()
        finally:
            torch.set_num_threads(before)


BUSY_ROWS = ("torch AdamW fused", "hf_optim AdamW8bit", "hf_optim AdamW8bit (torch's threads)",
             "hf_optim AdamW8bit (1 thread)", "bitsandbytes AdamW8bit", "bitsandbytes AdamW8bit (1 thread)",
             "hf_optim AdamW32bit", "hf_optim AdamW32bit (torch's threads)")
"""The rows ``--busy`` measures unless ``--only`` says otherwise."""


def fresh_params(shapes, dtype, device: str) -> list[torch.nn.Parameter]:
    """Parameters of ``shapes`` with gradients, the same random values for every contender (seed 0)."""
    gen = torch.Generator(device=device).manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device=device, dtype=dtype, generator=gen)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, device=device, dtype=dtype, generator=gen)
    return params


def measure_busy(shapes, dtype, device: str, args, levels: list[int]) -> dict[str, dict[int, tuple]]:
    """{row name: {busy processes: (median wall s, CPU s per step)}} for the ``--busy`` table."""
    results = {}
    for name, make in contenders(not args.no_bnb, device, busy=True):
        if not (any(s in name for s in args.only.split(",")) if args.only else name in BUSY_ROWS):
            continue
        params = fresh_params(shapes, dtype, device)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = make(params)
            opt.step()
            cpu_compile.wait()
            for _ in range(args.warmup):  # compiled and warm before any load starts
                opt.step()
            with busy_processes(max(levels)):  # under the heaviest load the thread-count choice may compile its
                for _ in range(2 + cpu_threads.WARMUP):  # one-thread variant: before the timing
                    opt.step()
                cpu_compile.wait()
            results[name] = time_busy(opt, args.steps, levels, args.rounds, args.settle)
        cells = "  ".join(f"busy {level}: {wall * 1e3:.1f} ms" for level, (wall, _) in results[name].items())
        print(f"  {name:<28} {cells}", flush=True)
        del opt, params
    return results


def family(name: str) -> str:
    """A row's library and algorithm, without the variant: ``hf_optim AdamW8bit (1 thread)`` -> ``hf_optim
    AdamW8bit``."""
    return name.split(" (")[0]


def print_busy_table(table: dict[str, dict], sets: list[str], levels: list[int]) -> None:
    """One row per (set, optimizer): wall ms per step and CPU ns per element at each load, and the slowdowns
    against the first level (``x idle``: the row's own; ``x best``: the fastest row of the same library and
    algorithm, e.g. hf_optim AdamW8bit with its thread choice, torch's threads or one thread; ``x 1t``: that
    family's one-thread row)."""
    header = " | ".join(f"busy {level}: ms | CPU ns/el" + (" | x idle | x best | x 1t" if level != levels[0] else "")
                        for level in levels)
    print(f"\n| set | optimizer | {header} |")
    print("|---|---|" + "---:|---:|" + "---:|---:|---:|---:|---:|" * (len(levels) - 1))
    for spec in sets:
        numel = sum(torch.Size(s).numel() for s in shape_set(spec))
        idle = {name: by_level[levels[0]][0] for name, by_level in table[spec].items()}
        for name, by_level in table[spec].items():
            best = min(wall for other, wall in idle.items() if family(other) == family(name))
            one = idle.get(f"{family(name)} (1 thread)")
            cells = []
            for level in levels:
                wall, cpu = by_level[level]
                cells += [f"{wall * 1e3:.1f}", f"{cpu / numel * 1e9:.2f}"]
                if level != levels[0]:
                    cells += [f"{wall / idle[name]:.2f}", f"{wall / best:.2f}", f"{wall / one:.2f}" if one else ""]
            print(f"| {spec} | {name} | " + " | ".join(cells) + " |")


def bnb_class(bnb, name: str) -> Callable:
    """bitsandbytes' class for ``name``; its ``AdEMAMix32bit`` crashes on CPU (it inherits the generic two-state
    base), so the 32-bit AdEMAMix row uses ``AdEMAMix(optim_bits=32)``, the same algorithm through its own base."""
    if name == "AdEMAMix32bit":
        return functools.partial(bnb.optim.AdEMAMix, optim_bits=32)
    return getattr(bnb.optim, name)


def contenders(include_bnb: bool, device: str, busy: bool = False) -> list[tuple[str, Callable]]:
    """(row name, optimizer factory); bitsandbytes' rows use its CUDA kernels on a CUDA device; ``busy``: also the
    rows of hf_optim optimizers that keep torch's thread count under load."""
    rows: list[tuple[str, Callable]] = [
        ("torch AdamW fused", lambda p: torch.optim.AdamW(p, fused=True)),
        ("torch AdamW foreach", lambda p: torch.optim.AdamW(p, foreach=True)),
    ]
    for name in ("AdamW8bit", "AdamW32bit", "AdEMAMix8bit", "AdEMAMix32bit", "Lion8bit", "Lion32bit", "LAMB8bit",
                 "LAMB32bit", "RMSprop8bit", "RMSprop32bit"):
        rows.append((f"hf_optim {name}", getattr(hf_optim, name)))
        if include_bnb and name not in ("LAMB8bit", "LAMB32bit"):  # bitsandbytes' LAMB is another algorithm
            import bitsandbytes as bnb

            rows.append((f"bitsandbytes {name}", bnb_class(bnb, name)))
    # no bitsandbytes namesake (torchao's: not installed); *4bit: stochastic4 (the default 4-bit), *4bitBlockwise:
    # blockwise4 (torchao's format, the default before), *4bitRank1: rank1_4bit (per tensor, eager); *Fp8: fp8
    for name in ("AdamW4bit", "AdEMAMix4bit", "Lion4bit", "AdamW4bitBlockwise", "AdEMAMix4bitBlockwise",
                 "Lion4bitBlockwise", "AdamW4bitRank1", "AdEMAMix4bitRank1", "AdamWFp8", "AdEMAMixFp8", "LionFp8"):
        rows.append((f"hf_optim {name}", getattr(hf_optim, name)))
    if busy:  # the rows without the thread-count choice, and the one-thread floors
        for name in ("AdamW8bit", "AdamW32bit"):
            cls = getattr(hf_optim, name)
            rows.append((f"hf_optim {name} (torch's threads)", lambda p, cls=cls: TorchThreads(cls(p))))
            rows.append((f"hf_optim {name} (1 thread)", lambda p, cls=cls: OneThread(cls(p))))
            if include_bnb:
                import bitsandbytes as bnb

                twin = getattr(bnb.optim, name)
                rows.append((f"bitsandbytes {name} (1 thread)", lambda p, twin=twin: OneThread(twin(p))))
    # Adafactor as the Trainer's optim="adafactor" builds it; the reference is transformers' own class.
    adafactor = dict(lr=1e-3, relative_step=False, scale_parameter=False, warmup_init=False)
    rows.append(("hf_optim Adafactor", lambda p: hf_optim.Adafactor(p, **adafactor)))
    try:
        from transformers.optimization import Adafactor as TransformersAdafactor
    except ImportError:
        return rows
    rows.append(("transformers Adafactor", lambda p: TransformersAdafactor(p, **adafactor)))
    return rows


REFERENCE_PREFIXES = ("bitsandbytes", "transformers")
"""Rows an hf_optim row of the same algorithm name is compared with (the "x ref" column)."""


def measure(shapes, dtype, device: str, args) -> dict[str, tuple]:
    """{row name: (first step s, median s, peak extra bytes or None)} for every contender on fresh parameters."""
    results = {}
    for name, make in contenders(not args.no_bnb, device):
        if args.only and not any(s in name for s in args.only.split(",")):
            continue
        params = fresh_params(shapes, dtype, device)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                results[name] = time_steps(make, params, args.steps, args.warmup, args.memory)
            except Exception as error:  # report and go on: one failing contender must not hide the others
                print(f"  {name}: failed: {type(error).__name__}: {error}", flush=True)
        if name in results:
            _, median, extra = results[name]
            memory = "" if extra is None else f"   step peak +{extra / 2**20:.1f} MiB"
            print(f"  {name:<28} {median * 1e3:9.1f} ms{memory}", flush=True)
        del params
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return results


def ratio_text(name: str, results: dict) -> list[str]:
    """The ``x ref`` (bitsandbytes' or transformers' class of the same name) and ``x fused`` (torch fused AdamW)
    cells of a row, from the same set's results."""
    median = results[name][1]
    algorithm = name.split(" ", 1)[1]
    twins = [f"{prefix} {algorithm}" for prefix in REFERENCE_PREFIXES if f"{prefix} {algorithm}" in results]
    parts = [f"{median / results[twins[0]][1]:.3f}" if name.startswith("hf_optim") and twins else ""]
    fused = results.get("torch AdamW fused")
    parts.append(f"{median / fused[1]:.2f}" if fused and name != "torch AdamW fused" else "")
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sets", default="4096x4096,llama-3.2-1b-lora,llama-3.2-1b",
                        help=f"comma-separated shape sets: presets {', '.join(PRESETS)} or shapes like 64x80+5000")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-bnb", action="store_true", help="skip bitsandbytes")
    parser.add_argument("--only", default="", help="comma-separated substrings: run only matching rows")
    parser.add_argument("--gbs", action="store_true", help="also print GB/s (and %% of peak on known GPUs)")
    parser.add_argument("--memory", action="store_true",
                        help="instead of timing, measure how far a step's peak RSS rises above the RSS before it "
                             "(CPU, Linux; it makes glibc map and unmap every allocation of 64 KiB or more, which "
                             "slows allocating steps: run it apart from the timing run)")
    parser.add_argument("--busy", default="",
                        help="comma-separated numbers of spinning processes to time the steps under, e.g. 0,2,4,8 "
                             "(the script starts and stops them; the optimizers compile and warm up before): prints "
                             "wall ms per step, CPU ns per element and the slowdown against the first level "
                             f"(rows: {', '.join(BUSY_ROWS)} unless --only)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="with --busy: how many times the load levels take turns (steps each time)")
    parser.add_argument("--settle", type=int, default=3,
                        help="with --busy: untimed steps after each change of load (hf_optim's thread-count choice "
                             "adapts to the load within a few steps)")
    parser.add_argument("--peak-gbs", type=float, default=0.0,
                        help="memory bandwidth peak in GB/s for the %% column (default: looked up by GPU name)")
    args = parser.parse_args()

    if args.memory:
        track_large_allocations()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    param_bytes = torch.empty((), dtype=dtype).element_size()
    backend = hf_optim.AdamW8bit([torch.zeros(1, device=args.device)]).backend
    device_name, peak = peak_bandwidth(args.device)
    peak = args.peak_gbs or peak
    print(f"device={args.device} ({device_name}) dtype={args.dtype} torch={torch.__version__} "
          f"threads={torch.get_num_threads()} hf_optim backend={backend} steps={args.steps} warmup={args.warmup} "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}")

    sets = [s for s in args.sets.split(",") if s]
    if args.busy:
        levels = [int(level) for level in args.busy.split(",")]
        print(f"load average before: {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")
        busy_table = {}
        for spec in sets:
            shapes = shape_set(spec)
            print(f"{spec}: {len(shapes)} tensors, {sum(torch.Size(s).numel() for s in shapes):,} elements", flush=True)
            busy_table[spec] = measure_busy(shapes, dtype, args.device, args, levels)
        print_busy_table(busy_table, sets, levels)
        print(f"load average after: {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")
        return
    table: dict[str, dict[str, tuple]] = {}
    for spec in sets:
        shapes = shape_set(spec)
        numel = sum(torch.Size(s).numel() for s in shapes)
        print(f"{spec}: {len(shapes)} tensors, {numel:,} elements", flush=True)
        table[spec] = measure(shapes, dtype, args.device, args)
        if args.gbs:
            for name, (_, median, _) in table[spec].items():
                gbs = bytes_per_element(name, param_bytes) * numel / median / 1e9
                print(f"  {name:<28} {gbs:8.1f} GB/s" + (f" {100 * gbs / peak:5.1f}% of peak" if peak else ""))

    names = list(dict.fromkeys(name for results in table.values() for name in results))
    if args.memory:
        columns = " | ".join(f"{spec}: step peak above the RSS before it (MiB)" for spec in sets)
        print(f"\n| optimizer | {columns} |")
        print("|---|" + "---:|" * len(sets))
        for name in names:
            cells = [f"{table[spec][name][2] / 2**20:.1f}" if name in table[spec] else "" for spec in sets]
            print(f"| {name} | " + " | ".join(cells) + " |")
        return
    header = "| optimizer | " + " | ".join(f"{spec} ms | x ref | x fused | first s" for spec in sets) + " |"
    print("\n" + header)
    print("|---|" + "---:|---:|---:|---:|" * len(sets))
    for name in names:
        cells = []
        for spec in sets:
            results = table[spec]
            if name not in results:
                cells += ["", "", "", ""]
                continue
            first, median, _ = results[name]
            cells += [f"{median * 1e3:.1f}", *ratio_text(name, results), f"{first:.2f}"]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
