"""Exhaustive check of the Triton 4-bit encoders (``hf_optim.kernels.triton_path.quant4.encode4``) against the
PyTorch path's threshold count (``hf_optim.formats.quant4.encode``), on every fp32 value in [-1, 1] and the
special values.

    python benchmarks/proofs/encoder4_proof.py            # every fp32 in [-1, 1] (2 x 1.07e9 values), about 10 min
    python benchmarks/proofs/encoder4_proof.py --sample 20  # a sample, and every value near a threshold

The Triton encoders compute the count arithmetically, without the thresholds (the module docstring of
``triton_blockwise4`` has the argument); this script runs the same integer and fp32 operations with torch on the
CPU (:func:`arithmetic_codes`, a line-by-line copy of ``encode4``) and compares them with the threshold count for
every input. Each fp32 operation of the copy rounds exactly as Triton's does (single IEEE operations on fp32
tensors; integer operations are exact), so equality here is equality of the kernels' codes. The interpreter tests
(``tests/formats/test_blockwise4.py``) run the kernel itself on the values near each threshold.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hf_optim.formats import quant4 as blockwise4  # noqa: E402
from hf_optim.kernels.triton_path.quant4 import ONE_BITS, T7, ZERO_CODE, signed_keys  # noqa: E402

KEYS = torch.tensor(signed_keys(), dtype=torch.int64)


def arithmetic_codes(normalized: torch.Tensor, signed: bool) -> torch.Tensor:
    """The codes ``triton_blockwise4.encode4`` computes, with the same operations (int64 holds the int32 values)."""
    if signed:
        bits = normalized.view(torch.int32).long()
        negative = torch.where(normalized >= 0.0, 0, -1).long()
        key = 2 * torch.clamp_max(bits & 0x7FFFFFFF, ONE_BITS.value) + negative
        s = KEYS
        four = key >= s[3]
        two = key >= torch.where(four, s[5], s[1])
        one = key >= torch.where(four, torch.where(two, s[6], s[4]), torch.where(two, s[2], s[0]))
        count = four.long() * 4 + two.long() * 2 + one.long()
        return ZERO_CODE.value + (count ^ negative) - negative + (normalized >= T7.value).long()
    # the kernel's fma rounds 16 y - 0.5 once; float64 holds it exactly for |y| >= 2**-28, and below that both
    # roundings give a value in [-0.5, 0) (code 0)
    shifted = (normalized.double() * 16.0 - 0.5).float()
    shifted = torch.clamp_max(torch.fmax(shifted, torch.zeros_like(shifted)), 15.0)  # fmax: max.f32's NaN rule
    return shifted.long()  # truncation, as the kernel's float-to-int conversion


def check(values: torch.Tensor) -> int:
    """Mismatches between the arithmetic codes and the threshold count, over both maps."""
    bad = 0
    for signed in (True, False):
        reference = blockwise4.encode(values, blockwise4.encoder_thresholds(signed)).long()
        bad += int((arithmetic_codes(values, signed) != reference).sum())
    return bad


def near_thresholds(ulps: int = 4096) -> torch.Tensor:
    """Every fp32 within ``ulps`` of each threshold of both maps, both signs, and the special values."""
    thresholds = torch.cat([blockwise4.encoder_thresholds(True), blockwise4.encoder_thresholds(False)])
    bits = thresholds.abs().view(torch.int32).long()
    around = (bits[:, None] + torch.arange(-ulps, ulps + 1)[None, :]).flatten().to(torch.int32).view(torch.float32)
    specials = torch.tensor([0.0, -0.0, 1.0, -1.0, float("inf"), -float("inf"), float("nan"), -float("nan"), 1e-45,
                             -1e-45])
    return torch.cat([around, -around, specials, blockwise4.qmap4(True), blockwise4.qmap4(False)])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sample", type=int, default=0, help="check every 2**SAMPLE-th bit pattern (default: all)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    bad = check(near_thresholds())
    step = 1 << args.sample
    chunk = 1 << 24
    top = torch.tensor(1.0).view(torch.int32).item()  # |value| <= 1.0
    checked = 0
    for first in range(0, top + 1, chunk):
        patterns = torch.arange(first, min(first + chunk, top + 1), step, dtype=torch.int32)
        values = patterns.view(torch.float32)
        bad += check(values) + check(-values)
        checked += 2 * patterns.numel()
    print(f"{checked} values of [-1, 1] (every {step}-th fp32 bit pattern) and every fp32 within 4096 ulps of a "
          f"threshold: {bad} mismatches, {time.perf_counter() - start:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
