"""4-bit quantize + dequantize round trip of one large state tensor on CPU: hf_optim's PyTorch path eagerly and
compiled by inductor, against the same done by torchao (when installed) and by the 8-bit format for scale.

    PYTHONPATH=. python benchmarks/quality/quant4_roundtrip.py                       # 16.8M elements, both maps
    PYTHONPATH=. python benchmarks/quality/quant4_roundtrip.py --numel 1048576 --rounds 3

torchao is compared when importable; keep it out of the project environment (transformers would import it on every
Trainer import) and point at a side install: ``pip install --no-deps --target /tmp/torchao_site torchao``, then
``PYTHONPATH=.:/tmp/torchao_site``.

Reports the median wall time and the process CPU (thread) time of one round trip, per implementation and map,
after a warm-up round (which includes inductor's compilation). A round trip is what an optimizer step does to a
state: dequantize the stored codes, then quantize new values into the same buffers.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from hf_optim.formats import quant4 as blockwise4
from hf_optim.formats import quant8 as blockwise
from hf_optim.formats.dynamic_map import dynamic_map, encoder_table


def ours4(signed: bool, values: torch.Tensor) -> Callable[[], None]:
    thresholds, qmap = blockwise4.encoder_thresholds(signed), blockwise4.qmap4(signed)
    codes, scale = blockwise4.quantize(values, thresholds)

    def round_trip() -> None:
        decoded = blockwise4.dequantize(codes, scale, qmap, values.shape[-1])
        blockwise4.quantize_into(decoded, thresholds, codes, scale)

    return round_trip


def ours8(signed: bool, values: torch.Tensor) -> Callable[[], None]:
    table, qmap = encoder_table(signed, "cpu"), dynamic_map(signed)
    codes, absmax = blockwise.quantize(values, table, signed)

    def round_trip() -> None:
        blockwise.quantize_into(blockwise.dequantize(codes, absmax, qmap), table, signed, codes, absmax)

    return round_trip


def torchao4(signed: bool, values: torch.Tensor) -> Callable[[], None]:
    from torchao.optim.subclass_4bit import OptimState4bit

    state = OptimState4bit.zeros(values.numel(), signed=signed, block_size=128)
    state.copy_(values.flatten())

    def round_trip() -> None:
        state.copy_(state.dequantize())

    return round_trip


def timed(fn: Callable[[], None], rounds: int) -> tuple[float, float]:
    fn()  # warm-up (compiles)
    walls, cpus = [], []
    for _ in range(rounds):
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=1 << 24)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.numel} elements")
    builders = {"hf_optim 4-bit": ours4, "hf_optim 8-bit": ours8}
    try:
        import torchao

        builders["torchao 4-bit"] = torchao4
        print(f"torchao {torchao.__version__}")
    except ImportError:
        print("torchao not installed: its row is skipped")
    torch.manual_seed(0)
    for signed in (True, False):
        values = torch.randn(1, args.numel)
        values = values if signed else values.square()
        for name, build in builders.items():
            for compiled in (False, True):
                fn = build(signed, values.clone())
                fn = torch.compile(fn) if compiled else fn
                wall, cpu = timed(fn, args.rounds)
                mode = "compiled" if compiled else "eager"
                print(f"{'signed' if signed else 'unsigned':8} {name:15} {mode:8} wall {wall * 1e3:8.1f} ms  "
                      f"cpu {cpu * 1e3:8.1f} ms")
            torch._dynamo.reset()


if __name__ == "__main__":
    main()
