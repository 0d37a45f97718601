"""Which 4-bit state reaches 8-bit quality (issue 45): candidate ways of storing each moment in about 4 bits,
simulated and trained side by side for AdamW, AdEMAMix and Lion, as percentages above the same algorithm with fp32
state, over several seeds.

Each candidate is a quantize-dequantize round trip applied to a state after every step (what storing it does), for
tensors of at least 4096 elements (hf_optim's ``min_8bit_size``); the optimizers' math is the spec's, in fp32
(``SimOptimizer``). The reference is the same optimizer with no round trip; ``8bit`` (bitsandbytes' blockwise
format, hf_optim's own quantizer) is the quality to reach, and ``jitter`` (every state times ``1 + 2**-9 * N(0, 1)``,
about bf16's rounding) measures how far a run moves from a perturbation that stores nothing: the noise floor.

A scheme is ``m=<codec>,v=<codec>`` (``read:`` before it, Lion only: a diagnostic where the update reads the round
trip of ``m`` but the EMA keeps fp32; ``m`` for signed states: Adam's and AdEMAMix's first moments and Lion's
momentum; ``v`` for second moments; a missing one stays fp32). A codec is ``<map>:<scaling>``:

- maps: ``tree`` (torchao's signed dynamic map, 3 exponent bits; it has +1 but not -1), ``tree15`` (its
  positive values mirrored, without the smallest pair: symmetric, 15 codes), ``lin`` (the unsigned linear map
  ``k/16`` without zero; signed: 15 evenly spaced levels), ``sqrt`` (unsigned: ``((k + 1) / 16)**2``, i.e. ``sqrt(v)``
  on the linear map; signed: ``sign * (k / 7)**2``, ``k = 0..7``), ``sq<L>`` (signed ``(k / L)**2``, ``L`` levels a
  sign), ``pow3`` (``(k / 7)**3`` signed, ``((k + 1) / 16)**3`` unsigned), ``log<d>`` (unsigned ``2**(-d * (15 -
  k))``), ``e2m1`` (fp4: ``0, 0.5, 1, 1.5, 2, 3, 4, 6`` over 6, both signs), ``seg2`` / ``seg3`` / ``fp4``
  (:data:`SEGMENTED`: linear by segments, 7 magnitudes; ``seg2`` is ``stochastic4``'s signed map), ``nf4`` (QLoRA's
  NormalFloat levels), ``8bit`` (bitsandbytes' 256-value dynamic maps);
- scalings: ``b<N>`` (absmax per block of N elements), ``r1`` (``min(row max, column max)`` of the tensor as a
  matrix, Li et al.'s rank-1 normalization), ``r1b<N>`` (``min(row max, column max, block max)``);
- rounding is to the nearest code in the companded domain (what an arithmetic encoder computes: ``round(7 *
  sqrt(|y|))`` for ``sqrt``), and to the nearest value for the table maps (``tree``, ``lin``, ``e2m1``, ``nf4``,
  ``8bit``);
  a suffix picks another: ``+nv`` nearest value, ``+sr`` stochastic between the two neighbouring values (unbiased in
  the value), ``+ld`` the same with a low-discrepancy dither over steps (:func:`stochastic`), ``+src`` stochastic in
  the companded domain (unbiased in ``|y| ** (1 / power)``).

Run: ``python benchmarks/quality/fourbit_study.py --algos adamw,lion,ademamix --seeds 0,1,2 --schemes
"m=tree:b128,v=lin:b128;m=tree:b128,v=lin:r1" --markdown out.md`` (one process; several can split the schemes).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hf_optim.formats import dynamic_map, quant4, rank1_quant4  # noqa: E402

MIN_SIZE = 4096
LR = {("adamw", "mlp"): 1e-3, ("adamw", "llama"): 3e-3, ("ademamix", "mlp"): 1e-3, ("ademamix", "llama"): 3e-3,
      ("lion", "mlp"): 1e-4, ("lion", "llama"): 1e-3}
WEIGHT_DECAY = 1e-2

# -- maps -----------------------------------------------------------------------------------------------------------
NF4 = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                    0.7229568362236023, 1.0])
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]) / 6.0
SEGMENTED = {  # magnitudes of maps linear by segments (a float-like encoder: cheap), 7 nonzero ones
    "seg2": [1 / 16, 1 / 8, 3 / 16, 1 / 4, 1 / 2, 3 / 4, 1.0],
    "seg3": [1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 3 / 4, 1.0],
    "fp4": [1 / 12, 1 / 6, 1 / 4, 1 / 3, 1 / 2, 2 / 3, 1.0],
}


def table_map(name: str, signed: bool) -> torch.Tensor | None:
    """The sorted values of a table map (None for the companded maps, which round in their own domain)."""
    if name == "tree":
        return quant4.qmap4(True) if signed else quant4.tree_map(False, 3, 4)[1:]
    if name == "tree15":  # the tree map made symmetric: +-1 both, without its smallest pair
        positive = quant4.qmap4(True)[9:]
        return torch.cat([-positive.flip(0), torch.zeros(1), positive])
    if name == "lin":
        return quant4.qmap4(False) if not signed else torch.linspace(-1, 1, 15)
    if name in SEGMENTED:  # signed: the magnitudes mirrored around 0 (15 values)
        magnitudes = torch.tensor(SEGMENTED[name])
        return torch.cat([-magnitudes.flip(0), torch.zeros(1), magnitudes]) if signed else magnitudes
    if name == "nf4":
        return NF4 if signed else (NF4[7:] + 0)  # unsigned: the positive half (9 values)
    if name == "e2m1":
        return torch.cat([-E2M1.flip(0)[:-1], E2M1]) if signed else E2M1
    if name == "8bit":
        return dynamic_map.create_dynamic_map(signed)
    return None


def nearest(y: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    mids = (values[:-1] + values[1:]) / 2
    return values[torch.bucketize(y, mids, right=True)]


def companded(name: str, y: torch.Tensor, signed: bool) -> torch.Tensor:
    """Round ``y`` (in [-1, 1] or [0, 1]) on a companded grid; returns the decoded value."""
    a = y.abs()
    if name.startswith("log"):  # unsigned only: 2**(-d * (15 - k)), k = 0..15, nearest in log2
        d = float(name[3:])
        k = torch.clamp(torch.round(15 + torch.log2(a.clamp_min(1e-30)) / d), 0, 15)
        return torch.exp2(-d * (15 - k))
    power = {"sqrt": 2.0, "pow3": 3.0, "pow1.5": 1.5, "pow2.5": 2.5}[name]
    root = a ** (1 / power)
    if signed:  # 15 levels: sign * (k / 7)**power, k = 0..7
        k = torch.round(root * 7)
        return torch.sign(y) * (k / 7) ** power
    k = torch.clamp(torch.round(root * 16) - 1, 0, 15)  # no zero: ((k + 1) / 16)**power
    return ((k + 1) / 16) ** power


def all_values(name: str, signed: bool) -> torch.Tensor:
    """The sorted values of any map (a companded map's grid)."""
    values = table_map(name, signed)
    if values is not None:
        return values
    if name.startswith("log"):
        return torch.exp2(-float(name[3:]) * (15 - torch.arange(16.0)))
    if name.startswith("sq") and name[2:].isdigit():  # sq<L>: L levels a sign (sqrt is sq7; sq15 is 5 bits)
        k = torch.arange(-int(name[2:]), int(name[2:]) + 1.0)
        return torch.sign(k) * (k.abs() / int(name[2:])) ** 2
    power = {"sqrt": 2.0, "pow3": 3.0, "pow1.5": 1.5, "pow2.5": 2.5}[name]
    if signed:
        k = torch.arange(-7.0, 8.0)
        return torch.sign(k) * (k.abs() / 7) ** power
    return ((torch.arange(16.0) + 1) / 16) ** power


SR = torch.Generator().manual_seed(1234)


STEP = [0]
"""The optimizer's step, for the low-discrepancy dither (``+ld``)."""
GOLDEN = (5**0.5 - 1) / 2


def stochastic(y: torch.Tensor, values: torch.Tensor, low_discrepancy: bool = False) -> torch.Tensor:
    """Round ``y`` to one of its two neighbouring map values, up with probability equal to its distance from the
    lower one over their gap (unbiased within the map's range; outside it, the nearest end). ``low_discrepancy``:
    the dither of element ``i`` at step ``t`` is ``frac(t * golden + r_i)`` with a fixed random ``r_i``, so an element
    that stays between the same two values rounds up a fraction of the steps that tracks its position closely."""
    upper = torch.bucketize(y, values, right=True).clamp(1, len(values) - 1)
    low, high = values[upper - 1], values[upper]
    if low_discrepancy:
        offsets = torch.rand(y.shape, generator=torch.Generator().manual_seed(99))
        dither = torch.frac(STEP[0] * GOLDEN + offsets)
    else:
        dither = torch.rand(y.shape, generator=SR)
    up = dither < ((y - low) / (high - low)).clamp(0, 1)
    return torch.where(up, high, low)


def codec(spec: str, signed: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """The quantize-dequantize function of ``<map>:<scaling>[+sr]`` for a tensor (``+sr``: stochastic rounding)."""
    map_name, scaling = spec.split(":")
    scaling, _, mode = scaling.partition("+")
    values = table_map(map_name, signed)
    grid = all_values(map_name, signed)
    power = {"sqrt": 2.0, "pow3": 3.0, "pow1.5": 1.5, "pow2.5": 2.5}.get(map_name, 2.0)

    def round_trip(y: torch.Tensor) -> torch.Tensor:
        if mode in ("sr", "ld"):
            return stochastic(y, grid, low_discrepancy=mode == "ld")
        if mode == "nv":
            return nearest(y, grid)
        if mode == "src":  # stochastic in the companded domain: unbiased in |y| ** (1 / power)
            root = torch.sign(y) * y.abs() ** (1 / power)
            cgrid = torch.sign(grid) * grid.abs() ** (1 / power)
            r = stochastic(root, cgrid)
            return torch.sign(r) * r.abs() ** power
        return nearest(y, values) if values is not None else companded(map_name, y, signed)

    def qdq(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1)
        scale = element_scale(x, flat.abs(), scaling)
        y = flat / torch.where(scale > 0, scale, torch.ones_like(scale))
        return (round_trip(y) * scale).view_as(x)

    return qdq


def element_scale(x: torch.Tensor, magnitude: torch.Tensor, scaling: str) -> torch.Tensor:
    """Per-element scale of a flat magnitude under ``scaling`` (see the module docstring)."""
    n = magnitude.numel()
    result = None
    if scaling.startswith("r1"):
        rows, cols = rank1_quant4.matrix_shape(x.shape)
        matrix = F.pad(magnitude, (0, rows * cols - n)).view(rows, cols)
        result = torch.minimum(matrix.amax(1, keepdim=True), matrix.amax(0, keepdim=True)).reshape(-1)[:n]
        scaling = scaling[2:]
    if scaling.startswith("b"):
        block = int(scaling[1:])
        blocks = F.pad(magnitude, (0, -n % block)).view(-1, block).amax(1, keepdim=True)
        per_block = blocks.expand(-1, block).reshape(-1)[:n]
        result = per_block if result is None else torch.minimum(result, per_block)
    return result


def scheme(text: str) -> tuple[Callable | None, Callable | None]:
    """``m=<codec>,v=<codec>`` (or ``fp32``, ``8bit``, ``jitter``) as (signed round trip, unsigned round trip)."""
    if text == "fp32":
        return None, None
    if text == "8bit":
        return codec("8bit:b256", True), codec("8bit:b256", False)
    if text == "jitter":
        generator = torch.Generator().manual_seed(4321)

        def jitter(x):
            return x * (1 + 2**-9 * torch.randn(x.shape, generator=generator))
        return jitter, jitter
    parts = dict(part.split("=", 1) for part in text.split(","))
    signed = codec(parts["m"], True) if "m" in parts else None
    unsigned = codec(parts["v"], False) if "v" in parts else None
    return signed, unsigned


# -- the optimizers -------------------------------------------------------------------------------------------------
class SimOptimizer(torch.optim.Optimizer):
    """AdamW, AdEMAMix (betas 0.9/0.999/0.9999, alpha 5) or Lion (betas 0.9/0.99) in fp32 (the spec's rules), each
    state of a tensor of at least :data:`MIN_SIZE` elements replaced by its round trip after every step."""

    def __init__(self, params, algo: str, signed: Callable | None, unsigned: Callable | None, lr: float):
        super().__init__(params, dict(lr=lr, weight_decay=WEIGHT_DECAY))
        self.algo, self.signed, self.unsigned = algo, signed, unsigned
        self.read_only = False

    def _store(self, value, fn, numel):
        return fn(value) if fn is not None and numel >= MIN_SIZE else value

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g, state, n = p.grad, self.state[p], p.numel()
                if not state:
                    state.update(step=0, m=torch.zeros_like(p), v=torch.zeros_like(p), m2=torch.zeros_like(p))
                state["step"] += 1
                t = STEP[0] = state["step"]
                p.mul_(1 - lr * wd)
                if self.algo == "lion":
                    m = state["m"]
                    if self.read_only:  # diagnostic: the sign sees the round trip, the EMA keeps fp32
                        p.add_(torch.sign(0.9 * self._store(m, self.signed, n) + 0.1 * g), alpha=-lr)
                        state["m"] = 0.99 * m + 0.01 * g
                        continue
                    p.add_(torch.sign(0.9 * m + 0.1 * g), alpha=-lr)
                    state["m"] = self._store(0.99 * m + 0.01 * g, self.signed, n)
                    continue
                m = 0.9 * state["m"] + 0.1 * g
                v = 0.999 * state["v"] + 0.001 * g * g
                denom = v.sqrt() / math.sqrt(1 - 0.999**t) + 1e-8
                if self.algo == "adamw":
                    p.add_(-lr * (m / (1 - 0.9**t)) / denom)
                else:
                    m2 = 0.9999 * state["m2"] + 0.0001 * g
                    p.add_(-lr * (m / (1 - 0.9**t) + 5.0 * m2) / denom)
                    state["m2"] = self._store(m2, self.signed, n)
                state["m"] = self._store(m, self.signed, n)
                state["v"] = self._store(v, self.unsigned, n)


# -- problems (quality4.py's) ---------------------------------------------------------------------------------------
def mlp_loss(factory: Callable, seed: int, steps: int = 400) -> float:
    """quality4.py's MLP problem (the same data, model, batches and steps), with the optimizer ``factory`` builds."""
    from quality4 import mlp_loss as quality4_mlp

    return quality4_mlp("", lambda params, _lr: factory(params), seed, steps)


def llama_loss(factory: Callable, seed: int, steps: int = 120) -> float:
    from hf_optim.tiny import train_tiny

    losses = train_tiny(factory, steps=steps, seq_len=32, seed=seed)
    return sum(losses[-10:]) / 10


PROBLEMS = {"mlp": mlp_loss, "llama": llama_loss}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--algos", default="adamw,lion,ademamix")
    parser.add_argument("--problems", default="mlp,llama")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--schemes", default="8bit;jitter;m=tree:b128,v=lin:b128;m=tree:b128,v=lin:r1",
                        help="semicolon-separated schemes (see the module docstring); fp32 is always run")
    parser.add_argument("--markdown", default="")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    algos = args.algos.split(",")
    problems = args.problems.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    schemes = [s.strip() for s in args.schemes.split(";") if s.strip() and s.strip() != "fp32"]
    start = time.perf_counter()
    gaps: dict[tuple, float] = {}
    for algo in algos:
        for problem in problems:
            for seed in seeds:
                losses = {}
                for name in ["fp32", *schemes]:
                    signed, unsigned = scheme(name.removeprefix("read:"))
                    read_only = name.startswith("read:")

                    def factory(params, s=signed, u=unsigned, algo=algo, lr=LR[algo, problem], read_only=read_only):
                        optimizer = SimOptimizer(params, algo, s, u, lr)
                        optimizer.read_only = read_only
                        return optimizer

                    losses[name] = PROBLEMS[problem](factory, seed)
                    gap = 100 * (losses[name] / losses["fp32"] - 1)
                    gaps[algo, problem, seed, name] = gap
                    print(f"{algo:8s} {problem:5s} s{seed} {name:40s} {losses[name]:.5f} {gap:+7.2f}%", flush=True)
    elapsed = time.perf_counter() - start
    header = ["scheme", *[f"{a} {p}" for a in algos for p in problems], "worst |mean|", "worst |seed|"]
    lines = [f"torch {torch.__version__}, python {platform.python_version()}, seeds {args.seeds}, "
             f"load average {os.getloadavg()[0]:.1f}, {elapsed:.0f} s", "",
             "| " + " | ".join(header) + " |", "|" + "|".join(["---"] * len(header)) + "|"]
    for name in schemes:
        cells, worst_mean, worst_seed = [], 0.0, 0.0
        for algo in algos:
            for problem in problems:
                values = [gaps[algo, problem, seed, name] for seed in seeds]
                mean = sum(values) / len(values)
                worst_mean, worst_seed = max(worst_mean, abs(mean)), max(worst_seed, *map(abs, values))
                cells.append(f"{mean:+.2f} ({' / '.join(f'{v:+.1f}' for v in values)})")
        lines.append(f"| `{name}` | " + " | ".join(cells) + f" | {worst_mean:.2f} | {worst_seed:.2f} |")
    lines += ["", "Mean gap to fp32 state in percent (per seed in brackets)."]
    print("\n".join(lines))
    if args.markdown:
        Path(args.markdown).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
