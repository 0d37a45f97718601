"""What each formulation of the 8-bit codec costs in inductor's CPU code: decode and encode compiled alone.

The compiled 8-bit CPU kernel decodes and encodes through tables (``quant8``): inductor has no vector gather, so each
lookup is eight scalar loads through a stack array. This measures whether arithmetic without tables is cheaper, on
one signed state of ``--elements`` values (default 16.8M, one 4096 x 4096 tensor), with torch's thread count:

- decode: the map lookup (as ``quant8.dequantize``, what ships); ``codebook8.decode`` (fp32/int32 reinterpretation);
  the same arithmetic with the exponent found by compares instead of a reinterpretation (defined here);
- encode: the packed table (``quant8.encode_int8``, what ships); ``codebook8.encode`` (arithmetic guess, midpoint from
  two arithmetic decodes); the arithmetic guess with the midpoint looked up (one gather), the sign read with
  ``torch.signbit`` or, for comparison only, with ``< 0`` (which is wrong for -0.0 and negative NaN);
- a copy of the same fp32 values, for the memory floor.

Every formulation is first checked against the shipped one on the timed input (plus 0.0, -0.0 and +-1): a row that
differs says so and is not timed. Prints ms per call (median of ``--repeats``) and the ratio to the shipped one.

    python benchmarks/performance/cpu_codec.py [--elements 16777216] [--repeats 9]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from hf_optim.formats import quant8
from hf_optim.formats.dynamic_map import ZERO_CODE_SIGNED, dynamic_map, encoder_table
from hf_optim.kernels.torch_path.cpu_kernel import INDUCTOR_OPTIONS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "proofs"))
import codebook8  # noqa: E402  (research beside its proof, not part of the library)


def exponent_by_compares(j: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``floor(log2 j)`` (int32) and ``2**-floor(log2 j)`` (fp32, exact) of int32 ``j`` in 1..256, by compares
    against constants: no reinterpretation (``j = 0`` gives 0 and 1.0)."""
    exponent = torch.zeros_like(j)
    scale = torch.ones(j.shape, dtype=torch.float32)
    for k in range(1, 9):
        above = j >= (1 << k)
        exponent = exponent + above.int()
        scale = torch.where(above, 2.0**-k, scale)
    return exponent, scale


def decode_by_compares(codes: torch.Tensor) -> torch.Tensor:
    """``codebook8.decode`` of signed codes with :func:`exponent_by_compares` in place of its reinterpretations."""
    centred = (codes.int() & 255) - ZERO_CODE_SIGNED
    j = centred.abs()
    exponent, scale = exponent_by_compares(j)
    m, m_next = j.float() * scale, (j + 1).float() * scale
    value = (codebook8._linspace_at(m) + codebook8._linspace_at(m_next)) * codebook8._decade_factor(exponent, True)
    value = torch.where(j == 0, 0.0, torch.clamp_max(value, 1.0))
    return torch.where(centred < 0, -value, value)


def encode_with_midpoint_lookup(normalized: torch.Tensor, midpoints: torch.Tensor, sign_bit: bool) -> torch.Tensor:
    """``codebook8.encode`` (signed) with the pair's midpoint read from ``midpoints`` (one gather); ``sign_bit=False``
    reads the sign with ``< 0`` instead of ``torch.signbit`` (wrong for -0.0: a cost comparison only)."""
    negative = torch.signbit(normalized) if sign_bit else normalized < 0
    magnitude = normalized.abs()
    pair = codebook8.guess(magnitude, True, torch.where(negative, codebook8.TOP_PAIR[True] - 1,
                                                        codebook8.TOP_PAIR[True]))
    settled = pair + (~(magnitude <= torch.ops.aten._unsafe_index(midpoints, [pair]))).int()
    settled = torch.maximum(settled, negative.int())
    return ZERO_CODE_SIGNED + torch.where(negative, -settled, settled)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=1 << 24)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    blocks = -(-args.elements // 256)
    generator = torch.Generator().manual_seed(0)
    qmap, table = dynamic_map(True), encoder_table(True, "cpu")
    midpoints = ((qmap[1:] + qmap[:-1]) * 0.5)[ZERO_CODE_SIGNED:].contiguous()
    codes = torch.randint(0, 256, (blocks, 256), dtype=torch.uint8, generator=generator).view(torch.int8)
    absmax = torch.rand(blocks, 1, generator=generator)
    values = (torch.randn(blocks, 256, generator=generator) * 0.3).clamp(-1, 1)
    values[0, :4] = torch.tensor([0.0, -0.0, 1.0, -1.0])
    decoded, encoded = torch.empty(blocks, 256), torch.empty_like(codes)

    def decode_into(decode: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], torch.Tensor]:
        return lambda: decoded.copy_(decode(codes) * absmax)

    def encode_into(encode: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], torch.Tensor]:
        return lambda: encoded.copy_(encode(values).to(torch.int8))

    rows: dict[str, tuple[str, Callable[[], torch.Tensor]]] = {
        "copy (memory floor)": ("", lambda: decoded.copy_(values * 1.0)),
        "decode: map lookup (shipped)": ("decode", decode_into(
            lambda c: torch.ops.aten._unsafe_index(qmap, [c.int() & 255]))),
        "decode: codebook8 (reinterpretation)": ("decode", decode_into(lambda c: codebook8.decode(c, True))),
        "decode: codebook8 by compares": ("decode", decode_into(decode_by_compares)),
        "encode: packed table (shipped)": ("encode", encode_into(lambda v: quant8.encode_int8(v, table, True))),
        "encode: codebook8 (two decodes)": ("encode", encode_into(lambda v: codebook8.encode(v, True))),
        "encode: guess + midpoint lookup, signbit": ("encode", encode_into(
            lambda v: encode_with_midpoint_lookup(v, midpoints, True))),
        "encode: guess + midpoint lookup, < 0 (wrong for -0.0)": ("encode", encode_into(
            lambda v: encode_with_midpoint_lookup(v, midpoints, False))),
    }
    reference = {"decode": (qmap[codes.int() & 255] * absmax).clone(),
                 "encode": quant8.encode_int8(values, table, True).clone()}
    print(f"one signed 8-bit state of {blocks * 256:,} elements, {torch.get_num_threads()} threads, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}\n")
    print("| formulation | exact | ms | x shipped |\n|---|---|---:|---:|")
    shipped: dict[str, float] = {}
    for name, (kind, run) in rows.items():
        compiled = torch.compile(run, fullgraph=True, options=dict(INDUCTOR_OPTIONS))
        result = compiled().clone()
        exact = ""
        if kind:
            same = torch.equal(result.view(torch.int32), reference[kind].view(torch.int32)) if kind == "decode" \
                else torch.equal(result, reference[kind])
            exact = "yes" if same else ("no (-0.0)" if "< 0" in name else "NO")
        times = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            compiled()
            times.append(time.perf_counter() - started)
        ms = statistics.median(times) * 1e3
        if "(shipped)" in name:
            shipped[kind] = ms
        ratio = f"{ms / shipped[kind]:.2f}" if kind in shipped else ""
        print(f"| {name} | {exact} | {ms:.1f} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
