"""4-bit optimizer state quality, side by side (issue 24 item 7): final loss of AdamW with each state format, as a
percentage above (or below) torch's 32-bit AdamW, on two small problems, in one run with fixed seeds.

Problems:

- ``mlp``: regression of a smooth random target (``y = sum_k sin(1.5 * x . w_k)``, 64 features ``w_k``, normalized)
  of 8192 points in 32 dimensions by a 3-layer tanh MLP 32-256-256-1 (the two hidden weights, 8192 and 65536
  elements, get quantized state; the rest stays fp32 under ``min_8bit_size`` 4096, as in torchao), minibatches of
  256, lr 1e-3, weight decay 0.01, 400 steps; final loss = MSE on all 8192 points after the last step.
- ``llama``: :func:`hf_optim.tiny.train_tiny` (a 2-layer Llama-3-shaped model, hidden 64, vocab 512, on a random
  Markov chain; what ``tests/recipes/test_finetune_quality.py`` runs), 120 steps of 8 x 32 tokens, lr 3e-3; final loss
  = mean training loss of the last 10 steps.
- ``quickstart`` (only with ``--problems``): ``hf-optim train quickstart training.optim=NAME`` in this process (QLoRA
  r=32 on the builtin tiny Llama, 60 steps, lr 5e-3); final loss = mean training loss of the last 10 steps; only the
  optimizers the Trainer can name (n/a for the others).

Optimizers (``--algorithm adamw``, the default): torch AdamW (the reference), hf_optim AdamW32bit / AdamW8bit /
AdamW4bit (the default 4-bit, ``stochastic4``) / AdamW4bitBlockwise (the torchao-compatible ``blockwise4`` format,
the default before issue 45), AdamWFp8 (the ``fp8`` format) and the fp8 choices it was picked from
(:data:`FP8_VARIANTS`), torchao AdamW4bit (when importable; ``--torchao-site`` adds a side install), hf_optim
AdamW4bitRank1 (the ``rank1_4bit`` format; Trainer name ``adamw_4bit_rank1``), and candidate formats simulated by
:class:`SimulatedAdamW`
(torch AdamW's math, each moment quantized and dequantized after every step, exactly what storing it does):
``sim:`` names below.

``--algorithm ademamix`` / ``lion``: hf_optim's 32-bit class (the reference), 8-bit, 4-bit (``stochastic4``),
4bitBlockwise and Fp8 classes of that algorithm (Lion at lr 1e-4 on the MLP and 1e-3 on the tiny fine-tune).

Run: ``HF_OPTIM_COMPILE=0 python benchmarks/quality/quality4.py --markdown quality4.md`` (eager steps: the rank-1
format has no compiled form, and compiled and eager steps compute the same values).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import hf_optim  # noqa: E402
from hf_optim.formats import FORMATS, rank1_quant4  # noqa: E402
from hf_optim.formats import fp8 as fp8_format  # noqa: E402
from hf_optim.formats import quant4 as blockwise4  # noqa: E402

LR = {"mlp": 1e-3, "llama": 3e-3}
LION_LR = {"mlp": 1e-4, "llama": 1e-3}
"""Lion's learning rates (a tenth of AdamW's on the MLP, as Lion's authors advise; 1e-3 on the tiny fine-tune, what
``tests/recipes/test_finetune_quality.py`` runs)."""
WEIGHT_DECAY = 1e-2
RANK1_NAME = "hf AdamW4bitRank1 (rank1_4bit)"
FP8_VARIANTS = {  # name: (second moment storage, block size) of an unregistered fp8 variant (formats/fp8.py)
    "hf AdamWFp8 v=sqrt-e4m3": ("sqrt_e4m3", 256),
    "hf AdamWFp8 v=e5m2": ("e5m2", 256),
    "hf AdamWFp8 B128": (fp8_format.SECOND_MOMENT, 128),
    "hf AdamWFp8 v=e4m3-nearest": ("e4m3", 256),
}
"""The choices the registered ``fp8`` format ("hf AdamWFp8": m and v in e4m3, blocks of 256, v rounded
stochastically) was picked from: v rounded to nearest (torchao's ``AdamWFp8``, the format as first merged), sqrt(v)
in e4m3, v in e5m2, blocks of 128."""
MIN_SIZE = 4096  # hf_optim's min_8bit_size default and torchao's smallest quantized tensor

# -- simulated formats: quantize-dequantize functions of one moment ---------------------------------------------
TREE, LINEAR = blockwise4.qmap4(True), blockwise4.qmap4(False)
DE0 = blockwise4.tree_map(False, exponent_bits=3, total_bits=4)[1:]  # the unsigned dynamic map without its zero
THRESHOLDS = {id(q): blockwise4._build_thresholds(q) for q in (TREE, LINEAR, DE0)}
DITHER = torch.Generator().manual_seed(1234)


def _round(normalized: torch.Tensor, qmap: torch.Tensor, dither: bool) -> torch.Tensor:
    """Map values of ``normalized`` (in [-1, 1]): nearest, or stochastically between the two neighbours
    (unbiased dithering)."""
    if not dither:
        return qmap[torch.bucketize(normalized, THRESHOLDS[id(qmap)], right=True)]
    upper = torch.bucketize(normalized, qmap, right=True).clamp(1, len(qmap) - 1)
    low, high = qmap[upper - 1], qmap[upper]
    up = torch.rand(normalized.shape, generator=DITHER) < ((normalized - low) / (high - low)).clamp(0, 1)
    return torch.where(up, high, low).clamp(qmap[0], qmap[-1])


def blockwise(qmap: torch.Tensor, block: int = 128, dither: bool = False) -> Callable:
    def qdq(x: torch.Tensor) -> torch.Tensor:
        flat = F.pad(x.reshape(-1), (0, -x.numel() % block)).view(-1, block)
        scale = flat.abs().amax(1, keepdim=True)
        normalized = flat / torch.where(scale > 0, scale, torch.ones_like(scale))
        return (_round(normalized, qmap, dither) * scale).reshape(-1)[: x.numel()].view_as(x)
    return qdq


def rank1(qmap: torch.Tensor, root: bool = False) -> Callable:
    """Rank-1 normalization (:mod:`hf_optim.formats.rank1_quant4`'s math); ``root``: store ``sqrt(v)``."""
    def qdq(x: torch.Tensor) -> torch.Tensor:
        rows, cols = rank1_quant4.matrix_shape(x.shape)
        values = (x.sqrt() if root else x).reshape(1, -1)
        codes, row, col = rank1_quant4.quantize(values, rows, cols, THRESHOLDS[id(qmap)])
        out = rank1_quant4.dequantize(codes, row, col, qmap, x.numel()).view_as(x)
        return out.square() if root else out
    return qdq


def fp8(signed: bool) -> Callable:
    """The registered ``fp8`` format's round trip (e4m3, blocks of 256) of one moment."""
    def qdq(x: torch.Tensor) -> torch.Tensor:
        codes = torch.zeros(1, x.numel(), dtype=torch.float8_e4m3fn)
        absmax = torch.zeros(1, fp8_format.FP8.num_blocks(x.numel()))
        fp8_format.FP8.store(x.reshape(1, -1), [codes, absmax], signed)
        return fp8_format.FP8.dequantize([codes, absmax], signed, x.numel()).view_as(x)
    return qdq


SIMULATED: dict[str, tuple[Callable | None, Callable | None, str]] = {
    # name: (first moment, second moment, what it is)
    "sim:blockwise4": (blockwise(TREE), blockwise(LINEAR), "torchao's setting (B128 tree m, B128 linear v)"),
    "sim:rank1-v": (blockwise(TREE), rank1(LINEAR), "B128 tree m, rank-1 linear v (Li et al.'s best)"),
    "sim:rank1-sqrt-v": (blockwise(TREE), rank1(LINEAR, root=True), "B128 tree m, rank-1 linear sqrt(v)"),
    "sim:rank1-v-dither-m": (blockwise(TREE, dither=True), rank1(LINEAR), "dithered B128 m, rank-1 v"),
    "sim:dither-v": (blockwise(TREE), blockwise(LINEAR, dither=True), "B128 m, dithered B128 v"),
    "sim:b32-v": (blockwise(TREE), blockwise(LINEAR, 32), "B128 m, B32 linear v (4x the v scales)"),
    "sim:de0-v": (blockwise(TREE), blockwise(DE0), "B128 m, B128 dynamic-without-zero v"),
    "sim:fp32-m": (None, blockwise(LINEAR), "ablation: fp32 m, B128 linear v"),
    "sim:fp32-v": (blockwise(TREE), None, "ablation: B128 tree m, fp32 v"),
    "sim:fp32-m-rank1-v": (None, rank1(LINEAR), "ablation: fp32 m, rank-1 linear v"),
    "sim:fp8-m": (fp8(True), None, "ablation: fp8 (e4m3, B256) m, fp32 v"),
    "sim:fp8-v": (None, fp8(False), "ablation: fp32 m, fp8 (e4m3, B256) v"),
}


class SimulatedAdamW(torch.optim.Optimizer):
    """torch AdamW's update with each moment of a tensor of at least ``MIN_SIZE`` elements replaced by
    ``quantize_m(m)`` / ``quantize_v(v)`` after every step (None: kept in fp32)."""

    def __init__(self, params, quantize_m: Callable | None, quantize_v: Callable | None, lr: float,
                 betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = WEIGHT_DECAY):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.quantize_m, self.quantize_v = quantize_m, quantize_v

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(step=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
                state["step"] += 1
                t = state["step"]
                m = state["m"].mul(beta1).add_(p.grad, alpha=1 - beta1)
                v = state["v"].mul(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                denominator = (v / (1 - beta2**t)).sqrt_().add_(group["eps"])
                p.addcdiv_(m, denominator, value=-group["lr"] / (1 - beta1**t))
                quantized = p.numel() >= MIN_SIZE
                state["m"] = self.quantize_m(m) if self.quantize_m and quantized else m
                state["v"] = self.quantize_v(v) if self.quantize_v and quantized else v


ALGORITHMS = ("adamw", "ademamix", "lion")


def family_optimizers(algorithm: str) -> dict[str, Callable]:
    """AdEMAMix's or Lion's rows: hf_optim's 32-bit class is the reference (torch has neither), then 8-bit, the
    default 4-bit (``stochastic4``), ``blockwise4`` and fp8."""
    prefix = {"ademamix": "AdEMAMix", "lion": "Lion"}[algorithm]
    kw = dict(weight_decay=WEIGHT_DECAY)
    classes = {suffix: getattr(hf_optim, f"{prefix}{suffix}") for suffix in ("32bit", "8bit", "4bit", "4bitBlockwise",
                                                                           "Fp8")}
    return {f"hf {prefix}{suffix}": (lambda p, lr, cls=cls: cls(p, lr=lr, **kw)) for suffix, cls in classes.items()}


def optimizers(torchao_available: bool) -> dict[str, Callable]:
    """name -> factory(params, lr)."""
    kw = dict(weight_decay=WEIGHT_DECAY)
    table = {
        "torch AdamW": lambda p, lr: torch.optim.AdamW(p, lr=lr, **kw),
        "hf AdamW32bit": lambda p, lr: hf_optim.AdamW32bit(p, lr=lr, **kw),
        "hf AdamW8bit": lambda p, lr: hf_optim.AdamW8bit(p, lr=lr, **kw),
        "hf AdamW4bit (stochastic4)": lambda p, lr: hf_optim.AdamW4bit(p, lr=lr, **kw),
        "hf AdamW4bitBlockwise (blockwise4)": lambda p, lr: hf_optim.AdamW4bitBlockwise(p, lr=lr, **kw),
        "hf AdamWFp8": lambda p, lr: hf_optim.AdamWFp8(p, lr=lr, **kw),
        **{name: lambda p, lr: hf_optim.AdamWFp8(p, lr=lr, **kw) for name in FP8_VARIANTS},
    }
    if torchao_available:
        def torchao4(p, lr):
            from torchao.optim import AdamW4bit
            return AdamW4bit(p, lr=lr, **kw)
        table["torchao AdamW4bit"] = torchao4
    table[RANK1_NAME] = lambda p, lr: hf_optim.AdamW4bitRank1(p, lr=lr, **kw)
    for name, (qm, qv, _) in SIMULATED.items():
        table[name] = lambda p, lr, qm=qm, qv=qv: SimulatedAdamW(p, qm, qv, lr=lr)
    return table


# -- problems -----------------------------------------------------------------------------------------------------
def mlp_loss(name: str, factory: Callable, seed: int, steps: int = 400) -> float:
    torch.manual_seed(seed)
    x = torch.randn(8192, 32)
    features = torch.randn(32, 64) / 32**0.5
    y = torch.sin(1.5 * x @ features).sum(1, keepdim=True)
    y = (y - y.mean()) / y.std()
    torch.manual_seed(seed + 100)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256), torch.nn.Tanh(),
                                torch.nn.Linear(256, 1))
    optimizer = factory(model.parameters(), LR["mlp"])
    batches = torch.Generator().manual_seed(seed + 200)
    for _ in range(steps):
        index = torch.randint(0, x.shape[0], (256,), generator=batches)
        loss = F.mse_loss(model(x[index]), y[index])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        return F.mse_loss(model(x), y).item()


def llama_loss(name: str, factory: Callable, seed: int, steps: int = 120) -> float:
    from hf_optim.tiny import train_tiny

    losses = train_tiny(lambda params: factory(params, LR["llama"]), steps=steps, seq_len=32, seed=seed)
    return sum(losses[-10:]) / 10


TRAINER_NAMES = {"torch AdamW": "adamw_torch", "hf AdamW32bit": "adamw_32bit", "hf AdamW8bit": "adamw_8bit",
                 "hf AdamW4bit (stochastic4)": "adamw_4bit", "hf AdamW4bitBlockwise (blockwise4)": "adamw_torch_4bit",
                 RANK1_NAME: "adamw_4bit_rank1", "hf AdamWFp8": "adamw_fp8",
                 **{f"hf {prefix}{suffix}": f"{name}_{optim}" for prefix, name in (("AdEMAMix", "ademamix"),
                                                                                   ("Lion", "lion"))
                    for suffix, optim in (("32bit", "32bit"), ("8bit", "8bit"), ("4bit", "4bit"),
                                          ("4bitBlockwise", "4bit_blockwise"), ("Fp8", "fp8"))}}
"""The optimizers the quickstart can name (torchao's ``adamw_torch_4bit`` is taken over by hf_optim: blockwise4)."""


def quickstart_loss(name: str, factory: Callable, seed: int) -> float | None:
    """``hf-optim train quickstart training.optim=NAME`` in this process (QLoRA on the builtin tiny Llama, 60
    steps): mean training loss of the last 10 steps, None for an optimizer without a Trainer name."""
    import json
    import tempfile

    from hf_optim.recipes.api import train

    if name not in TRAINER_NAMES:
        return None
    with tempfile.TemporaryDirectory() as out:
        result = train("quickstart", [f"training.optim={TRAINER_NAMES[name]}", f"training.seed={seed}"],
                       output_dir=out, quiet=True, overwrite=True)
        records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    if result.status != "ok":
        raise RuntimeError(f"the quickstart with {name} ended {result.status}")
    losses = [record["loss"] for record in records if record.get("kind") == "train" and record.get("loss") is not None]
    return sum(losses[-10:]) / len(losses[-10:])


PROBLEMS = {"mlp": mlp_loss, "llama": llama_loss, "quickstart": quickstart_loss}


@contextlib.contextmanager
def fp8_variant(name: str):
    """Within the block, ``state_format="fp8"`` means the variant ``name`` of :data:`FP8_VARIANTS` (the registry's
    entry is swapped and restored after)."""
    registered = FORMATS["fp8"]
    FORMATS["fp8"] = fp8_format.variant(*FP8_VARIANTS[name])
    try:
        yield
    finally:
        FORMATS["fp8"] = registered


def torchao_importable(site: str | None) -> bool:
    if site:
        sys.path.append(site)
    return importlib.util.find_spec("torchao") is not None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problems", default="mlp,llama",
                        help="comma-separated: mlp, llama, quickstart (default mlp,llama; the quickstart takes "
                             "about 20 s a run on an idle 2-core CPU, minutes under load)")
    parser.add_argument("--seeds", default="0,1", help="comma-separated seeds (default 0,1)")
    parser.add_argument("--only", default="", help="comma-separated optimizer names to run besides torch AdamW")
    parser.add_argument("--torchao-site", default=os.environ.get("HF_OPTIM_TORCHAO_SITE", ""),
                        help="a side install of torchao (pip install --no-deps --target DIR torchao)")
    parser.add_argument("--markdown", default="", help="write the table as markdown to this path")
    parser.add_argument("--algorithm", default="adamw", choices=ALGORITHMS,
                        help="adamw (reference: torch AdamW; every row above), ademamix or lion (reference: "
                             "hf_optim's 32-bit class; its 8-bit, 4-bit, blockwise4 and fp8 classes)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # fixed, machine-independent arithmetic order; these problems are tiny
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.algorithm == "adamw":
        table = optimizers(torchao_importable(args.torchao_site))
    else:
        table = family_optimizers(args.algorithm)
        LR.update(LION_LR if args.algorithm == "lion" else {})
    reference_name = next(iter(table))
    problems = [name.strip() for name in args.problems.split(",") if name.strip()]
    for name in problems:
        if name not in PROBLEMS:
            parser.error(f"unknown problem {name!r}; known: {sorted(PROBLEMS)}")
    names = list(table)
    if args.only:
        wanted = [name.strip() for name in args.only.split(",") if name.strip()]
        unknown = [name for name in wanted if name not in table]
        if unknown:
            parser.error(f"unknown optimizer(s) {unknown}; known: {names}")
        names = [reference_name, *[name for name in wanted if name != reference_name]]
    seeds = [int(s) for s in args.seeds.split(",")]
    columns = [(problem, seed) for problem in problems for seed in seeds]
    results: dict[str, dict[tuple, float]] = {name: {} for name in names}
    start = time.perf_counter()
    for problem, seed in columns:
        for name in names:
            with fp8_variant(name) if name in FP8_VARIANTS else contextlib.nullcontext():
                results[name][problem, seed] = PROBLEMS[problem](name, table[name], seed)
            reference = results[reference_name][problem, seed]
            loss = results[name][problem, seed]
            if loss is not None:
                print(f"{problem} seed {seed}  {name:28s} {loss:.5f}  {100 * (loss / reference - 1):+6.2f}%",
                      flush=True)
    elapsed = time.perf_counter() - start

    header = ["optimizer", *[f"{p} s{s}" for p, s in columns], "max abs %"]
    rows = []
    for name in names:
        cells, worst = [], 0.0
        for column in columns:
            loss, reference = results[name][column], results[reference_name][column]
            if loss is None:
                cells.append("n/a")
                continue
            percent = 100 * (loss / reference - 1)
            worst = max(worst, abs(percent))
            cells.append(f"{loss:.4f} ({percent:+.2f}%)")
        rows.append([name, *cells, f"{worst:.2f}"])
    notes = {name: description for name, (_, _, description) in SIMULATED.items()}
    torchao_version = "not installed"
    if "torchao AdamW4bit" in table:
        import torchao
        torchao_version = torchao.__version__
    lines = [
        f"torch {torch.__version__}, torchao {torchao_version}, python {platform.python_version()}, "
        f"load average {os.getloadavg()[0]:.1f}, {elapsed:.0f} s",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join(["---"] * len(header)) + "|",
        *["| " + " | ".join(row) + " |" for row in rows],
        "",
        f"Final loss (percent above {reference_name}'s). Simulated candidates:",
        "",
        *[f"- `{name}`: {notes[name]}" for name in names if name in notes],
    ]
    print("\n".join(lines))
    if args.markdown:
        Path(args.markdown).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
