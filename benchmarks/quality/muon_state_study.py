"""Which momentum storage keeps 32-bit Muon's quality? A study for issue 25's 4-bit target.

Runs the quickstart recipe (builtin tiny Llama-3-shaped model, bundled chat data, CPU) as a full fine-tune with
32-bit ``muon``, and after every step replaces each Muon matrix's momentum with its round trip through a candidate
storage scheme (``store(m) -> m'``), which is exactly what a state format does between two steps: the step reads the
stored momentum, updates it in fp32, orthogonalizes the fp32 update, and stores the new momentum. So a scheme is
judged by training with it, before anyone writes it as a format. ``none`` leaves the momentum as it is (it must
reproduce ``muon``'s losses to the last digit: the check that the harness changes nothing else).

    python benchmarks/quality/muon_state_study.py --schemes none,b4-128,b4-16,fp8-256 --seeds 0,1,2 --out
    runs/muon_state

Scheme names: ``stochastic4`` is the registered ``stochastic4`` format's round trip (``Muon4bit``'s storage
since issue 45); ``KIND-BLOCK`` quantizes blocks of BLOCK consecutive elements scaled by their absmax, with KIND one of
``b4`` (hf_optim's 4-bit signed map, blockwise4's), ``lin4`` (15 evenly spaced levels), ``fp4`` (e2m1 values),
``fp8`` (e4m3, scale absmax/448) or ``b8`` (bitsandbytes' 8-bit signed map); ``grid4-S`` scales each element of an
SxS tile by the smaller of its row's and column's absmax in the tile; prefixes: ``sr+`` rounds stochastically to
one of the two neighbouring levels, ``ef+`` adds the previous step's storage error back before storing (error
feedback, with an fp32 error buffer), ``topK+`` stores the K leading singular components exactly (fp32 SVD) and
the residual with the rest of the name. Prints EMA loss, final loss and the mean of the last 20 steps per run, and
each scheme's gap to ``none`` on the same seed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

Store = Callable[[torch.Tensor], torch.Tensor]
TAIL = 20


def nearest(values: torch.Tensor, levels: torch.Tensor, stochastic: bool) -> torch.Tensor:
    """Each value (within [min, max] of ``levels``, sorted) as its nearest level, or, ``stochastic``, as the level
    below or above with the probabilities that keep its expectation."""
    values = values.clamp(levels[0], levels[-1])
    upper = torch.searchsorted(levels, values.contiguous()).clamp(1, len(levels) - 1)
    low, high = levels[upper - 1], levels[upper]
    fraction = (values - low) / (high - low)
    up = torch.rand_like(fraction) < fraction if stochastic else fraction >= 0.5
    return torch.where(up, high, low)


def blockwise(levels: torch.Tensor, block: int, stochastic: bool, scale_max: float = 1.0) -> Store:
    def store(m: torch.Tensor) -> torch.Tensor:
        flat = m.reshape(-1)
        pad = (-flat.numel()) % block
        blocks = torch.nn.functional.pad(flat, (0, pad)).view(-1, block)
        scale = blocks.abs().amax(-1, keepdim=True).clamp_min(1e-30) / scale_max
        return (nearest(blocks / scale, levels, stochastic) * scale).reshape(-1)[: flat.numel()].view_as(m)
    return store


def grid(levels: torch.Tensor, tile: int, stochastic: bool) -> Store:
    def store(m: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(m)
        for i in range(0, m.shape[0], tile):
            for j in range(0, m.shape[1], tile):
                t = m[i:i + tile, j:j + tile]
                scale = torch.minimum(t.abs().amax(1, keepdim=True), t.abs().amax(0, keepdim=True)).clamp_min(1e-30)
                out[i:i + tile, j:j + tile] = nearest(t / scale, levels, stochastic) * scale
        return out
    return store


def e4m3_levels() -> torch.Tensor:
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return torch.unique(codes[codes.isfinite()])


def levels_of(kind: str) -> tuple[torch.Tensor, float]:
    """(sorted levels, the value a block's absmax maps to)."""
    from hf_optim.formats import dynamic_map, quant4

    if kind == "b4":
        return torch.sort(quant4.qmap4(True)).values, 1.0
    if kind == "lin4":
        return torch.linspace(-1, 1, 15), 1.0
    if kind == "fp4":
        half = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
        return torch.cat([-half.flip(0)[:-1], half]), 6.0
    if kind == "fp8":
        return e4m3_levels(), 448.0
    if kind == "b8":
        return torch.unique(dynamic_map.dynamic_map(True)), 1.0
    raise SystemExit(f"unknown scheme kind {kind!r}; valid: b4, lin4, fp4, fp8, b8, grid4")


def scheme(name: str) -> Store:
    head, _, rest = name.partition("+")
    if name == "none":
        return lambda m: m
    if name == "stochastic4":  # the registered format's own round trip (hf_optim.formats.quant4_sr): Muon4bit's
        from hf_optim.formats import quant4_sr

        def store(m: torch.Tensor) -> torch.Tensor:
            codes, scale = quant4_sr.quantize(m.reshape(1, -1).float(), True)
            return quant4_sr.dequantize(codes, scale, True, m.numel()).view_as(m)
        return store
    if head == "ef":
        inner, errors = scheme(rest), {}

        def store(m: torch.Tensor) -> torch.Tensor:
            key = (m.data_ptr(), tuple(m.shape))
            target = m + errors[key] if key in errors else m
            stored = inner(target)
            errors[key] = target - stored
            return stored
        return store
    if head.startswith("top") and rest:
        k, inner = int(head[3:]), scheme(rest)

        def store(m: torch.Tensor) -> torch.Tensor:
            u, s, vh = torch.linalg.svd(m, full_matrices=False)
            top = (u[:, :k] * s[:k]) @ vh[:k]
            return top + inner(m - top)
        return store
    stochastic = head == "sr" and bool(rest)
    kind, _, size = (rest if stochastic else name).partition("-")
    if kind == "grid4":
        return grid(levels_of("b4")[0], int(size), stochastic)
    levels, scale_max = levels_of(kind)
    return blockwise(levels, int(size), stochastic, scale_max)


FINAL_MOMENTA: dict[int, torch.Tensor] = {}
"""The last momentum of each Muon matrix of the latest run (fp32, by parameter id), for ``--ns-error``."""


def run(name: str, seed: int, lr: str, steps: int, out: Path) -> dict:
    """One quickstart full fine-tune with 32-bit Muon whose momentum goes through scheme ``name``."""
    from hf_optim.cli import main
    from hf_optim.optim import muon as muon_module

    store, original = scheme(name), muon_module._muon_batch
    FINAL_MOMENTA.clear()

    def batch(ctx, group, shape, items):
        original(ctx, group, shape, items)
        for param, _, state, _ in items:
            momentum = state["state1"]
            momentum.copy_(store(momentum.view(param.shape)).view_as(momentum))
            FINAL_MOMENTA[id(param)] = momentum.view(param.shape).clone()

    torch.manual_seed(seed)  # stochastic rounding's draws
    muon_module._muon_batch = batch
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            status = main(["train", "quickstart", "quantization=null", "peft=null", f"training.max_steps={steps}",
                           f"training.learning_rate={lr}", "training.optim=muon", f"training.seed={seed}",
                           "--output-dir", str(out)])
    finally:
        muon_module._muon_batch = original
    if status:
        raise SystemExit(f"{name} seed {seed}: hf-optim train exited with {status} (log above)")
    return losses(out)


def ns_errors(names: list[str]) -> None:
    """For each scheme, on the momenta of the last run: the relative error of one store (Frobenius norm), and of
    the orthogonalized update Newton-Schulz makes of it; then the same for i.i.d. Gaussian noise of a given size."""
    from hf_optim.optim.muon.newton_schulz import NS_COEFFICIENTS, NS_EPS, NS_STEPS, newton_schulz

    momenta = list(FINAL_MOMENTA.values())

    def orthogonal(m: torch.Tensor) -> torch.Tensor:
        return newton_schulz(m.unsqueeze(0), NS_COEFFICIENTS, NS_STEPS, NS_EPS)[0].float()

    def mean_errors(perturb: Store) -> tuple[float, float]:
        stored = [(m, perturb(m)) for m in momenta]
        relative = [((q - m).norm() / m.norm()).item() for m, q in stored]
        after = [((orthogonal(q) - orthogonal(m)).norm() / orthogonal(m).norm()).item() for m, q in stored]
        return sum(relative) / len(relative), sum(after) / len(after)

    print(f"\nOne store of the {len(momenta)} momenta at the last step: relative error of the momentum and of "
          "NS(momentum)")
    print("\n| perturbation | momentum | Newton-Schulz output |\n|---|---|---|")
    for name in names:
        if name != "none" and not name.startswith("ef+"):  # error feedback needs a history
            print("| {} | {:.4f} | {:.4f} |".format(name, *mean_errors(scheme(name))))
    for size in (0.01, 0.025, 0.05, 0.1):
        def noise(m: torch.Tensor, size=size) -> torch.Tensor:
            return m + torch.randn_like(m) * size * m.norm() / m.numel() ** 0.5
        print("| i.i.d. noise, {:.1%} of the momentum | {:.4f} | {:.4f} |".format(size, *mean_errors(noise)))


def losses(out: Path) -> dict:
    summary = json.loads((out / "summary.json").read_text())
    train = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if '"kind": "train"' in line]
    return {"ema": summary["ema_loss"], "final": summary["final_loss"], "tail": sum(train[-TAIL:]) / len(train[-TAIL:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schemes", default="none,b4-128,fp8-256", help="comma-separated scheme names")
    parser.add_argument("--seeds", default="0", help="comma-separated recipe seeds")
    parser.add_argument("--lr", default="3e-3", help="learning rate (32-bit Muon's best on this model: 3e-3)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("runs/muon_state"))
    parser.add_argument("--ns-error", action="store_true",
                        help="also measure how one store perturbs Newton-Schulz's output (reruns 'none', last seed)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    names = [n for n in args.schemes.split(",") if n]
    for name in names:
        scheme(name)  # a typo fails before the first run
    seeds = [int(s) for s in args.seeds.split(",")]
    if "none" not in names:
        names.insert(0, "none")
    results = {}
    for seed in seeds:
        for name in names:
            out = args.out / f"{name}_s{seed}"
            results[name, seed] = losses(out) if (out / "summary.json").exists() and _finished(out) else run(
                name, seed, args.lr, args.steps, out)
            print(f"{name:>16} seed {seed}: " + "  ".join(f"{k} {v:.4f}" for k, v in results[name, seed].items()),
                  file=sys.stderr)
    columns = " | ".join(f"EMA loss seed {s} (gap)" for s in seeds)
    print(f"\n| scheme | {columns} | mean gap, EMA | mean gap, last {TAIL} |")
    print("|---|" + "---|" * (len(seeds) + 2))
    for name in names:
        gaps = [100 * (results[name, s]["ema"] / results["none", s]["ema"] - 1) for s in seeds]
        tails = [100 * (results[name, s]["tail"] / results["none", s]["tail"] - 1) for s in seeds]
        cells = " | ".join(f"{results[name, s]['ema']:.4f} ({g:+.1f}%)" for s, g in zip(seeds, gaps))
        print(f"| {name} | {cells} | {sum(gaps) / len(gaps):+.1f}% | {sum(tails) / len(tails):+.1f}% |")
    if args.ns_error:
        run("none", seeds[-1], args.lr, args.steps, args.out / "ns_error_momenta")
        ns_errors(names)


def _finished(out: Path) -> bool:
    return json.loads((out / "summary.json").read_text()).get("status") == "ok"


if __name__ == "__main__":
    main()
