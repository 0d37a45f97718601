"""Proof that the arithmetic 8-bit encoder (``hf_optim.kernels.triton_path.encode8``) gives the reference codes.

The reference is ``dynamic_map._nearest_codes`` (round to nearest against the map's fp32 midpoints, exact ties to
the code nearer zero) with bitsandbytes' sign fix. The encoder's arithmetic is modelled operation by operation by
the PyTorch twin ``hf_optim.formats.encode8`` (the interpreter tests tie the Triton code to the twin).

1. ``encode8``, exhaustively: every fp32 bit pattern in [-1, 1] (2 x 1,065,353,217 values per map, -0.0
   included), both maps, against the reference; on the way, the guessed pair is checked to be monotone in the
   value, and the fast model used here is checked against the twin on a sample of every chunk.
2. ``quantize8``'s guess, for every code boundary: the guess is computed from ``q0 = rn(s' * y)``, where ``y`` is
   an approximate reciprocal of the scaled absmax (relative error at most ``RECIPROCAL_TOLERANCE`` = 2**-17; the
   GPU's ``rsqrt.approx`` squared is within about 2**-21), so ``|q0 - x| <= delta * |x|`` with ``delta = 2**-17 +
   2**-23`` for the exact quotient ``x = s / absmax``. The settling step (3) is exact for every pair, so the code
   is right whenever the guessed pair holds it, i.e. is ``c - 1`` or ``c`` for the reference code ``c`` of x. The
   guess being monotone (part 1, and past +-1 here), it suffices to check, at every boundary ``b`` between codes
   ``j`` and ``j + 1``, that the largest fp32 at most ``b + delta*|b|`` guesses a pair <= j and the smallest at
   least ``b - delta*|b|`` a pair >= j.
3. The settling step, by argument (printed below) and by test: adversarial (values, absmax) blocks, with absmax
   at every power of two from 2**-149 to 2**127, subnormal, FLT_MAX and random, values within ulps of every
   midpoint times absmax and of every rounding boundary times absmax, +-absmax, zeros, -0.0; the twin's codes are
   compared with the reference quantization (IEEE division, then the reference encoder) for reciprocals moved by
   up to 64 ulps either way; and on a sample the sign of the settling fma result is compared with the exact
   rational sign.

0. The table-free arithmetic of ``benchmarks/proofs/codebook8.py`` (``table_free``): its decode of all 256
   codes against the map, its midpoint of every pair against the reference's, and its encode of every fp32 in
   [-1, 1] (both signs, -0.0 included) against the reference, for both maps.

The fp32 fma used throughout is Triton's interpreter's C fma where this Triton has one (a private function,
checked against the twin's ``fma32`` and against exact rational arithmetic), else the twin's ``fma32`` (checked
against exact rational arithmetic; slower).

    python benchmarks/proofs/encoder8_proof.py [--maps signed unsigned] [--chunk-log2 22] [--skip-exhaustive]
                                        [--parts 0 1 2]

Parts 0 and 1 take about 15 minutes per map each on an idle 2-core machine (most of it the reference's bucketize;
part 0 took 36-41 minutes per map on a heavily loaded one).
"""

from __future__ import annotations

import argparse
import time
from fractions import Fraction

import codebook8 as cb  # beside this script (research, not part of the library)
import numpy as np
import torch

from hf_optim.formats import encode8 as e8
from hf_optim.formats import quant8 as blockwise
from hf_optim.formats.dynamic_map import (
    ZERO_CODE_SIGNED,
    _nearest_codes,
    create_dynamic_map,
    dynamic_map,
    encoder_table,
)

ONE_BITS = 0x3F800000
DELTA = e8.RECIPROCAL_TOLERANCE + 2.0**-23


def _c_fma():
    """Triton's interpreter's exact fp32 fma (C ``std::fma``), much faster than the twin's ``fma32``; None where
    Triton lacks it (a private function: Triton 3.8 has none) or is not installed."""
    try:
        from triton._C.libtriton import interpreter

        fma_fp32 = interpreter.fma_fp32
    except (ImportError, AttributeError):
        return None

    def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        a, b, c = (np.ascontiguousarray(t.numpy()) for t in torch.broadcast_tensors(a.float(), b.float(), c.float()))
        return torch.from_numpy(fma_fp32(a, b, c))

    return fma


def _round_to_float32(exact: Fraction) -> float:
    """``exact`` rounded once to the nearest fp32, ties to even (+-inf past the largest fp32's rounding range)."""
    if exact == 0:
        return 0.0
    magnitude = abs(exact)
    exponent = magnitude.numerator.bit_length() - magnitude.denominator.bit_length()
    if Fraction(2) ** exponent > magnitude:  # now 2**exponent <= magnitude < 2**(exponent + 1)
        exponent -= 1
    ulp = Fraction(2) ** (max(exponent, -126) - 23)  # subnormals: 2**-149
    rounded = round(magnitude / ulp) * ulp  # Fraction's round() takes an exact half to the even integer
    value = float("inf") if rounded > (2**24 - 1) * 2**104 else float(rounded)
    return value if exact > 0 else -value


def check_exact_fma(fma) -> tuple[int, int, int]:
    """The proof's fma against exact rational arithmetic rounded once, on 2048 random triples and 128
    double-rounding ties. Returns (mismatches, values checked, how many ties the naive float64 route gets wrong:
    about half, where ties-to-even picks the wrong side; this shows the ties are real)."""
    generator = torch.Generator().manual_seed(5)
    n = 2048
    a = torch.randn(n, generator=generator) * torch.exp2(torch.randint(-40, 40, (n,), generator=generator).float())
    b = torch.randn(n, generator=generator)
    c = torch.randn(n, generator=generator) * torch.exp2(torch.randint(-40, 40, (n,), generator=generator).float())
    ties = _double_rounding_ties(64)
    a, b, c = torch.cat([a, ties[0]]), torch.cat([b, ties[1]]), torch.cat([c, ties[2]])
    exact = torch.tensor([_round_to_float32(Fraction(x) * Fraction(y) + Fraction(z))
                          for x, y, z in zip(a.tolist(), b.tolist(), c.tolist(), strict=True)])
    mismatches = int((fma(a, b, c) != exact).sum())
    naive_wrong = int((((ties[0].double() * ties[1].double()) + ties[2].double()).float() != exact[n:]).sum())
    return mismatches, len(exact), naive_wrong


def _double_rounding_ties(count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triples where float64 arithmetic then rounding to fp32 goes wrong: a * b = 2**-24 + e with 0 < |e| <
    2**-53, c = 1, so the float64 sum is 1 + 2**-24, exactly halfway between two fp32 values, while the exact sum
    is not (the fma rounds up when e > 0, down when e < 0; float64-then-fp32 ties to even)."""
    generator = torch.Generator().manual_seed(4)
    found: list[tuple[float, float]] = []
    target = Fraction(1, 2**24)
    while len(found) < count:
        b = float(1 + torch.randint(0, 2**23, (1,), generator=generator).item() / 2**23)
        a = float(torch.tensor(2.0**-24 / b, dtype=torch.float64).float())
        error = Fraction(a) * Fraction(b) - target
        if error != 0 and abs(error) < Fraction(1, 2**53):
            found.append((a, b))
    a, b = (torch.tensor(column, dtype=torch.float32) for column in zip(*found))
    return torch.cat([a, -a]), torch.cat([b, b]), torch.cat([torch.ones(count), -torch.ones(count)])


def check_fast_fma(fma) -> int:
    """The C fma against the twin's fma32, bit for bit, on 2**20 random triples and 128 double-rounding ties.
    Returns the mismatches."""
    generator = torch.Generator().manual_seed(0)
    n = 1 << 20
    a = torch.randn(n, generator=generator) * torch.exp2(torch.randint(-40, 40, (n,), generator=generator).float())
    b = torch.randn(n, generator=generator)
    c = torch.randn(n, generator=generator) * torch.exp2(torch.randint(-40, 40, (n,), generator=generator).float())
    ties = _double_rounding_ties(64)
    a, b, c = torch.cat([a, ties[0]]), torch.cat([b, ties[1]]), torch.cat([c, ties[2]])
    return int((fma(a, b, c).view(torch.int32) != e8.fma32(a, b, c).view(torch.int32)).sum())


def reference(x: torch.Tensor, signed: bool, qmap: torch.Tensor) -> torch.Tensor:
    codes = _nearest_codes(x, qmap)
    negative = x.view(torch.int32) < 0
    if signed:
        codes = torch.where(negative & (codes == ZERO_CODE_SIGNED), ZERO_CODE_SIGNED - 1, codes)
    else:
        codes = torch.where(negative, 0, codes)
    return codes.to(torch.uint8)


def exhaustive(signed: bool, fma, chunk_log2: int) -> dict:
    """Part 1 for one map: every fp32 in [-1, 1]."""
    qmap = create_dynamic_map(signed)
    lines = e8.line_table(signed)
    entries = e8.entry_table(signed)
    mu, hu = entries[:, 0].contiguous(), entries[:, 1].contiguous()
    chunk = 1 << chunk_log2
    assert chunk <= 1 << 23  # a chunk stays inside one binade: one row of lines
    generator = torch.Generator().manual_seed(1)
    stats = {"values": 0, "mismatches": 0, "monotone_breaks": 0, "twin_sample_mismatches": 0,
             "pair_range": {}, "examples": []}
    started = time.time()
    for sign in (0, 1):
        previous = None
        low_pair, high_pair = 255, 0
        for start in range(0, ONE_BITS + 1, chunk):
            if start % (1 << 27) == 0:
                done = (sign * (ONE_BITS + 1) + start) / (2 * (ONE_BITS + 1))
                print(f"  {'-' if sign else '+'}{start >> 23:3d} binades ({done:4.0%}, {time.time() - started:.0f} s)",
                      flush=True)
            magnitude = torch.arange(start, min(start + chunk, ONE_BITS + 1), dtype=torch.int64)
            bits = (magnitude | (sign << 31)).to(torch.int64)
            bits = torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32)
            x = bits.view(torch.float32)
            key = (start >> 23) | (sign << 8)
            slope1, intercept1, slope2, intercept2 = (lines[key, j].expand(len(x)) for j in range(4))
            position = torch.fmin(fma(x, slope1, intercept1), fma(x, slope2, intercept2))
            pairs = ((position.view(torch.int32) & e8.ENTRY_MASK) >> 3).long()
            # settle with norm = 1: fma(1, mu, -x) is the single rounding of mu - x, fma(1, hu, t) that of hu + t
            below = hu[pairs] + (mu[pairs] - x)
            codes = (pairs + (below.view(torch.int32) < 0).long()).to(torch.uint8)
            expected = reference(x, signed, qmap)
            bad = codes != expected
            stats["mismatches"] += int(bad.sum())
            if bad.any() and len(stats["examples"]) < 5:
                index = int(bad.nonzero()[0])
                stats["examples"].append((float(x[index]), int(codes[index]), int(expected[index])))
            # the guess moves monotonically: pairs rise with x, i.e. with |x| for positive values, fall for negative
            steps = pairs.diff() if sign == 0 else -pairs.diff()
            stats["monotone_breaks"] += int((steps < 0).sum())
            if previous is not None:
                stats["monotone_breaks"] += int((pairs[0] < previous) if sign == 0 else (pairs[0] > previous))
            previous = int(pairs[-1])
            low_pair, high_pair = min(low_pair, int(pairs.min())), max(high_pair, int(pairs.max()))
            sample = torch.randint(0, len(x), (1024,), generator=generator)
            twin = e8.encode_twin(x[sample], signed)
            stats["twin_sample_mismatches"] += int((twin != codes[sample]).sum())
            stats["values"] += len(x)
        stats["pair_range"]["negative" if sign else "positive"] = (low_pair, high_pair)
    return stats


def _boundaries(signed: bool) -> list[tuple[int, float]]:
    """(j, b): the real boundary b between codes j and j + 1 (x above b encodes as j + 1 or more)."""
    entries = e8.entry_table(signed).double()
    found = []
    for j in range(255):
        if signed and j == ZERO_CODE_SIGNED - 1:
            continue  # codes 126 | 127 is the sign bit (the sign fix), not a value boundary
        found.append((j, float(entries[j, 0] + entries[j, 1])))
    return found


def _float_at_most(value: float) -> torch.Tensor:
    f = torch.tensor(value, dtype=torch.float64).float()
    return torch.nextafter(f, torch.tensor(float("-inf"))) if float(f) > value else f


def _float_at_least(value: float) -> torch.Tensor:
    f = torch.tensor(value, dtype=torch.float64).float()
    return torch.nextafter(f, torch.tensor(float("inf"))) if float(f) < value else f


def guess_tolerance(signed: bool, fma) -> dict:
    """Part 2 for one map."""
    failures = []
    for j, boundary in _boundaries(signed):
        high = _float_at_most(boundary + DELTA * abs(boundary))
        low = _float_at_least(boundary - DELTA * abs(boundary))
        pairs = e8.guess_pairs(torch.stack([high, low]), signed, fma)
        if int(pairs[0]) > j or int(pairs[1]) < j:
            failures.append((j, boundary, int(pairs[0]), int(pairs[1])))
    # past +-1 (a guess may overshoot by delta): every fp32 up to 1 + 2 delta guesses the top (or, negative, the
    # bottom) pair, continuing part 1's monotone sequence
    top = torch.arange(ONE_BITS, ONE_BITS + int(2 * DELTA * 2**23) + 2, dtype=torch.int32).view(torch.float32)
    beyond = {"positive": sorted(set(e8.guess_pairs(top, signed, fma).tolist()))}
    if signed:
        beyond["negative"] = sorted(set(e8.guess_pairs(-top, signed, fma).tolist()))
    return {"boundaries": len(_boundaries(signed)), "failures": failures, "beyond_one": beyond}


def _adversarial_absmax() -> torch.Tensor:
    generator = torch.Generator().manual_seed(2)
    powers = torch.exp2(torch.arange(-149, 128, dtype=torch.float64)).float()
    random_bits = torch.randint(0x00000001, 0x7F7FFFFF, (160,), generator=generator, dtype=torch.int64).to(torch.int32)
    subnormal_bits = torch.randint(1, 0x00800000, (40,), generator=generator, dtype=torch.int64).to(torch.int32)
    special = torch.tensor([3.4028234663852886e38, 1.1754943508222875e-38, 1.0, 0.5, 1.0 - 2.0**-24,
                            1.0 + 2.0**-23, 2.0**-126 * (2 - 2.0**-23), 0.1, 1e-3, 3.0])
    return torch.cat([powers, random_bits.view(torch.float32), subnormal_bits.view(torch.float32), special])


def _adversarial_blocks(signed: bool) -> torch.Tensor:
    """Blocks (n, 256) whose first value is the absmax and the rest sit at the settling's edges."""
    entries = e8.entry_table(signed)
    real = entries[:255, 0].abs() < 2.0  # the sign-fix entry's placeholder is not a midpoint
    mids = entries[:255, 0][real]
    edges = (entries[:255, 0].double() + entries[:255, 1].double())[real]
    blocks = []
    for absmax in _adversarial_absmax():
        a64 = float(absmax)
        targets = torch.cat([(mids.double() * a64).float(), (edges * a64).float()])
        values = [targets, -targets]
        for steps in (-2, -1, 1, 2):
            values += [e8.nudge(targets, steps), -e8.nudge(targets, steps)]
        flat = torch.cat(values + [torch.tensor([0.0, -0.0, -absmax, 2.0**-149, -(2.0**-149)])])
        flat = flat[flat.abs() <= absmax]  # a block's values never exceed its absmax
        per_block = 255
        count = -(-len(flat) // per_block)
        padded = torch.cat([flat, torch.zeros(count * per_block - len(flat))]).view(count, per_block)
        blocks.append(torch.cat([torch.full((count, 1), float(absmax)), padded], dim=1))
    return torch.cat(blocks)


def _exact_sign(norm: float, mu: float, hu: float, scaled: float) -> int:
    value = Fraction(norm) * (Fraction(mu) + Fraction(hu)) - Fraction(scaled)
    return (value > 0) - (value < 0)


def settling(signed: bool, fma) -> dict:
    """Part 3 for one map."""
    blocks = _adversarial_blocks(signed)
    expected, expected_absmax = blockwise.quantize(blocks.reshape(1, -1), encoder_table(signed, "cpu"), signed)
    expected = expected.view(blocks.shape)
    results = {"blocks": blocks.shape[0], "values": blocks.numel(), "mismatches": {}}
    for ulps in (-64, -8, -2, -1, 0, 1, 2, 8, 64):
        codes, absmax = e8.quantize_twin(blocks.unsqueeze(0), signed, reciprocal_ulps=ulps, fma=fma)
        assert torch.equal(absmax.flatten(), expected_absmax.flatten())
        results["mismatches"][ulps] = int((codes.view(blocks.shape) != expected).sum())
    # blocks whose absmax is not finite: the reference divides a NaN block by 1 (values pass through, beyond +-1
    # too) and an infinite block by inf (finite values become +-0); the finite values' codes must match
    special = _adversarial_blocks(signed)[:64].clone()
    special[:, 1:] = special[:, 1:] / special[:, :1] * torch.logspace(-30, 30, 255)  # any finite magnitudes
    special[:32, 0] = float("nan")
    special[32:, 0] = float("inf")
    want, _ = blockwise.quantize(special.reshape(1, -1), encoder_table(signed, "cpu"), signed)
    got, _ = e8.quantize_twin(special.unsqueeze(0), signed, fma=fma)
    finite = special.isfinite()
    results["nonfinite_blocks"] = special.shape[0]
    results["nonfinite_mismatches"] = int((got.view(special.shape) != want.view(special.shape))[finite].sum())
    # the settling fma's sign bit against the exact sign of norm * (mu + hu) - scaled, on a sample
    scale, norm, _ = e8.block_params(blocks.abs().amax(dim=1))
    scaled = blocks * scale[:, None]
    entries = e8.entry_table(signed)
    generator = torch.Generator().manual_seed(3)
    rows = torch.randint(0, blocks.shape[0], (20000,), generator=generator)
    cols = torch.randint(1, 256, (20000,), generator=generator)
    pairs = torch.randint(0, 255, (20000,), generator=generator)
    # half of the sample uses the pair that the value's own code needs: the near-boundary cases
    own = (expected[rows, cols].long() - 1).clamp(0, 254)
    pairs = torch.where(torch.arange(20000) % 2 == 0, own, pairs)
    n, s = norm[rows], scaled[rows, cols]
    mu, hu = entries[pairs, 0], entries[pairs, 1]
    below = fma(n, hu, fma(n, mu, -s))
    wrong = 0
    for i in range(len(pairs)):
        if float(mu[i]) == e8.NEVER_UP[0]:
            continue
        sign = _exact_sign(float(n[i]), float(mu[i]), float(hu[i]), float(s[i]))
        if sign == 0 or (sign < 0) != (int(below[i].view(torch.int32)) < 0):
            wrong += 1
    results["sign_checks"] = len(pairs)
    results["sign_wrong"] = wrong
    return results


def table_free(signed: bool, chunk_log2: int) -> dict:
    """Part 0 for one map: the table-free arithmetic of ``codebook8`` (decode and encode, the CPU path's and the
    kernels' main path). Decode: all 256 codes against the map. Midpoints: every pair the encoder can guess, its
    computed midpoint against the reference's ``(qmap[i] + qmap[i+1]) * 0.5``. Encode: every fp32 in [-1, 1]
    against the reference, running ``codebook8.encode_with`` with the midpoints just shown equal to its own (so
    every operation but the midpoint's is the encoder's own), and ``codebook8.encode`` itself on a sample of every
    chunk."""
    qmap = dynamic_map(signed)
    decoded = cb.decode(torch.arange(256), signed)
    stats = {"decode_mismatches": int((decoded.view(torch.int32) != qmap.view(torch.int32)).sum())}
    zero = ZERO_CODE_SIGNED if signed else 0
    mids = ((qmap[1:] + qmap[:-1]) * 0.5)[zero:]  # magnitude pairs (G, G + 1) of the positive side
    pairs = torch.arange(cb.TOP_PAIR[signed] + 1, dtype=torch.int32)
    computed = cb.midpoint(pairs, signed)
    stats["midpoint_mismatches"] = int((computed.view(torch.int32) != mids.view(torch.int32)).sum())
    stats["pairs"] = len(pairs)

    def lookup(pair: torch.Tensor, _signed: bool) -> torch.Tensor:
        return mids[pair.long()]

    chunk = 1 << chunk_log2
    generator = torch.Generator().manual_seed(5)
    stats.update(values=0, mismatches=0, sample_mismatches=0, examples=[])
    started = time.time()
    for sign in (0, 1):
        for start in range(0, ONE_BITS + 1, chunk):
            if start % (1 << 27) == 0:
                done = (sign * (ONE_BITS + 1) + start) / (2 * (ONE_BITS + 1))
                print(f"  {'-' if sign else '+'}{start >> 23:3d} binades ({done:4.0%}, {time.time() - started:.0f} s)",
                      flush=True)
            magnitude = torch.arange(start, min(start + chunk, ONE_BITS + 1), dtype=torch.int64)
            bits = magnitude - (sign << 31)
            x = bits.to(torch.int32).view(torch.float32)
            codes = cb.encode_with(x, signed, lookup)
            expected = reference(x, signed, qmap).int()
            bad = codes != expected
            stats["mismatches"] += int(bad.sum())
            if bad.any() and len(stats["examples"]) < 5:
                index = int(bad.nonzero()[0])
                stats["examples"].append((float(x[index]), int(codes[index]), int(expected[index])))
            sample = torch.randint(0, len(x), (1024,), generator=generator)
            stats["sample_mismatches"] += int((cb.encode(x[sample], signed) != codes[sample]).sum())
            stats["values"] += len(x)
    return stats


ARGUMENT = """\
Why the settling step is exact (part 3's theorem). Pair k holds the fp32 midpoint mu between codes k and k+1 and
hu = +-ulp(mu)/2 with mu's sign. The reference picks k+1 iff rn(x) > mu (rn(x) >= mu when mu < 0: ties toward
zero), i.e. iff x > mu + hu; and x never equals mu + hu, which has 25 significant bits with an odd last one, so
norm * (mu + hu) needs more than 24 bits and is no fp32 s'. The kernel computes t = fma(norm, mu, -s') and
b = fma(norm, hu, t), where s' = s * 2**k and norm = d * 2**k (d the divisor) are exact: a power-of-two scale, and
a value whose scaled form could round is below 2**-125 * norm, far under every midpoint, and keeps its sign. norm
is in [2**-23, 4): nothing overflows. Write norm = N 2**a, mu = M 2**m, s' = S 2**c with integers below 2**24, N
and M at least 2**23 (norm and every midpoint are normal), so ulp(mu) = 2**m and norm*|hu| < 2**(23+a+m).
T = norm*mu - s' is an integer multiple of 2**min(a+m, c), a multiple of 2**-149; so if |T| < 2**(24+min(a+m, c)),
T is an fp32, t = T, and b = rn(T + norm*hu) carries the sign of that exact, nonzero value (rounding to nearest
keeps the sign, and an underflow to zero its sign bit). Otherwise, if min = a+m, |T| >= 2**(24+a+m); if c < a+m,
|s'| < 2**(24+c) <= 2**(23+a+m) while norm*|mu| >= 2**(46+a+m); either way |T| and |t| = |rn(T)| exceed
2 norm |hu|, so T, T + norm*hu, t and b = rn(t + norm*hu) all have one sign. Hence b's sign bit is set exactly when
x > mu + hu. Pair 126 of the signed map is reached only by negative values and settles on 126 (the sign fix); pair
255 is reached by no finite value. An infinite absmax makes norm infinite and the reciprocal 0: every finite value
guesses +-0's pair and settles low (b = +inf), the reference's code of s / inf = +-0; a NaN absmax divides by 1, as
the reference does."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--maps", nargs="+", choices=["signed", "unsigned"], default=["signed", "unsigned"])
    parser.add_argument("--chunk-log2", type=int, default=22)
    parser.add_argument("--skip-exhaustive", action="store_true", help="parts 2 and 3 only (about a minute)")
    parser.add_argument("--parts", nargs="+", choices=["0", "1", "2"], default=["0", "1", "2"],
                        help="0: table-free codebook8; 1: the table encoder, exhaustively; 2: parts 2 and 3")
    args = parser.parse_args()
    fast = _c_fma()
    fma = fast or e8.fma32
    started = time.time()
    mismatched_exact, checked, naive_wrong = check_exact_fma(fma)
    print(f"{'the C fma' if fast else 'the twin fma32'} vs exact rational arithmetic on {checked} triples (128 of them "
          f"double-rounding ties): {mismatched_exact} mismatches (float64-then-fp32 rounding gets {naive_wrong} of "
          f"the ties wrong: they are real)")
    ok = mismatched_exact == 0 and naive_wrong > 0
    if fast is not None:
        mismatched_fma = check_fast_fma(fast)
        print(f"fast fma vs twin fma32 on 2**20 random triples and 128 double-rounding ties: {mismatched_fma} "
              "mismatches")
        ok &= mismatched_fma == 0
    else:
        print("this Triton has no interpreter fma_fp32 (a private function): the proof runs the twin's fma32, "
              "which makes part 1 slower")
    for name in args.maps:
        signed = name == "signed"
        print(f"\n== {name} map ==")
        if "0" in args.parts:
            t0 = time.time()
            free = table_free(signed, args.chunk_log2) if not args.skip_exhaustive else None
            if free is not None:
                print(f"part 0: codebook8 (table-free): decode of 256 codes: {free['decode_mismatches']} mismatches; "
                      f"midpoints of {free['pairs']} pairs: {free['midpoint_mismatches']} mismatches; encode on every "
                      f"fp32 in [-1, 1]: {free['values']:,} values, {free['mismatches']} mismatches "
                      f"{free['examples']}, full-encode sample mismatches {free['sample_mismatches']} "
                      f"({time.time() - t0:.0f} s)")
                ok &= free["decode_mismatches"] == 0 and free["midpoint_mismatches"] == 0
                ok &= free["mismatches"] == 0 and free["sample_mismatches"] == 0
        if "1" in args.parts and not args.skip_exhaustive:
            t0 = time.time()
            stats = exhaustive(signed, fma, args.chunk_log2)
            print(f"part 1: encode8 on every fp32 in [-1, 1]: {stats['values']:,} values, "
                  f"{stats['mismatches']} mismatches {stats['examples']}, "
                  f"guess monotone breaks {stats['monotone_breaks']}, "
                  f"twin-sample mismatches {stats['twin_sample_mismatches']}, pairs {stats['pair_range']} "
                  f"({time.time() - t0:.0f} s)")
            ok &= stats["mismatches"] == 0 and stats["monotone_breaks"] == 0 and stats["twin_sample_mismatches"] == 0
            # part 2 relies on these: positive values guess the pairs above the zero code, negative ones below
            zero = ZERO_CODE_SIGNED if signed else 0
            ok &= stats["pair_range"]["positive"][0] == zero and stats["pair_range"]["negative"][1] == (
                zero - 1 if signed else 0)
        if "2" not in args.parts:
            continue
        t0 = time.time()
        tolerance = guess_tolerance(signed, fma)
        print(f"part 2: quantize8 guess with delta = 2**-17 + 2**-23: {tolerance['boundaries']} boundaries, "
              f"{len(tolerance['failures'])} failures {tolerance['failures'][:3]}, "
              f"pairs past +-1: {tolerance['beyond_one']} ({time.time() - t0:.0f} s)")
        top_ok = tolerance["beyond_one"]["positive"] == [e8.TOP_PAIR] and (
            not signed or tolerance["beyond_one"]["negative"] == [0])
        ok &= not tolerance["failures"] and top_ok
        t0 = time.time()
        settle = settling(signed, fma)
        print(f"part 3: {settle['blocks']} adversarial blocks ({settle['values']:,} values), mismatches by "
              f"reciprocal error in ulps {settle['mismatches']}; settling sign vs exact rational sign: "
              f"{settle['sign_wrong']} wrong of {settle['sign_checks']}; {settle['nonfinite_blocks']} blocks with a "
              f"NaN or inf absmax: {settle['nonfinite_mismatches']} mismatches on their finite values "
              f"({time.time() - t0:.0f} s)")
        ok &= not any(settle["mismatches"].values()) and settle["sign_wrong"] == 0
        ok &= settle["nonfinite_mismatches"] == 0
    print()
    print(ARGUMENT)
    print(f"\n{'PROVED' if ok else 'FAILED'}: arithmetic encoder == reference ({time.time() - started:.0f} s)")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
