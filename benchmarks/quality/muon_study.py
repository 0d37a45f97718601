"""The evidence behind hf_optim's Muon defaults (issue 25), measured with torch.optim.Muon and torch.optim.AdamW only.

Three questions, answered side by side in one run on the quickstart recipe's builtin tiny Llama-3-shaped model
(``builtin:tiny-llama-3``, 2 layers, hidden 256, tied embeddings) and its bundled chat data (``builtin:tiny-chat``):

1. ``full``: a full fine-tune, hybrid Muon (the 2-D hidden matrices of the decoder blocks -> ``torch.optim.Muon``;
   the embedding / LM head, the norms and any bias -> ``torch.optim.AdamW``) against plain AdamW, for each
   ``adjust_lr_fn`` (``original``, ``match_rms_adamw``; torch's ``None`` is ``original``: the script checks that),
   at each learning rate of a small sweep, with ONE learning rate shared by both sides of the hybrid. Does
   ``match_rms_adamw`` let AdamW's learning rate drive both sides, and which rule is best at a shared rate?
   The ``--split-lrs`` rows (default 1e-2,3e-2,1e-1; ``none`` to skip) give ``original`` its own Muon rate, with
   the AdamW side held at AdamW's best shared rate: ``original`` tuned the way its users tune it.
2. ``lora``: LoRA with the recipe's config (r, alpha, target modules) on the same model, unquantized: every
   adapter (A: r x in, B: out x r) through Muon against through AdamW, the rest frozen, same sweep.
3. ``routing``: which parameters a hybrid rule must send to AdamW (names, shapes), with the recipe's tied
   embeddings and with them untied, found by the model's own ``get_input_embeddings`` / ``get_output_embeddings``.

Training follows the recipe where it matters: batch 4, ``max_length`` 128, linear schedule with 5 warmup steps,
weight decay 0.01 on both sides (Muon's decay is decoupled, ``p *= 1 - lr * wd``, as AdamW's), gradient clipping at
1.0 (the Trainer's default), loss on every token (TRL's default for ``messages`` data), fixed seeds (model init
seed 0 as the recipe; data order = ``--seeds``). It is a plain loop, not the Trainer, so each optimizer pair is
built by hand. Reported: train loss = mean of the last 10 steps; eval loss on the recipe's 5% held-out split at
the end; the curve as the mean train loss over windows of steps.

    python benchmarks/quality/muon_study.py                               # all three parts, defaults below
    python benchmarks/quality/muon_study.py --parts full --lrs 1e-3,3e-3,1e-2,3e-2 --steps 300 --seeds 0,1
    python benchmarks/quality/muon_study.py --parts routing                # seconds

Prints markdown; ``--json PATH`` also writes every run's loss curve. Quality does not depend on machine load.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch.optim import AdamW, Muon
from torch.optim._muon import _adjust_lr

from hf_optim.recipes.api import load_recipe
from hf_optim.recipes.build import build_datasets, build_lora_config, build_model, build_tokenizer
from hf_optim.recipes.schema import Recipe

PARTS = ("full", "lora", "routing")
ADJUST = ("original", "match_rms_adamw")
CURVE_WINDOWS = (10, 25, 50, 100, 150, 200, 300, 400)
FINAL_WINDOW = 10


# ---------------------------------------------------------------------------------------------------- data, model
def quickstart_recipe() -> Recipe:
    """The quickstart recipe with its 4-bit quantization removed (an fp32 base: the study is about the optimizer,
    and bitsandbytes' 4-bit CPU matmuls would only slow it down)."""
    return dataclasses.replace(load_recipe("quickstart"), quantization=None)


def tokenized_splits(recipe: Recipe) -> tuple[list[list[int]], list[list[int]]]:
    """Token ids of each train / eval conversation in Llama 3's chat layout (the bundled template), truncated to the
    recipe's ``max_length``."""
    tokenizer = build_tokenizer(recipe)
    max_length = int(recipe.training.get("max_length", 128))
    train, evaluation = build_datasets(recipe)

    def encode(dataset) -> list[list[int]]:
        texts = [tokenizer.apply_chat_template(row["messages"], tokenize=False) for row in dataset]
        return [ids[:max_length] for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]

    return encode(train), encode(evaluation)


def collate(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, labels) padded on the right; padding is masked out of the loss."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
        mask[i, :len(r)] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def batch_order(train: list[list[int]], steps: int, batch_size: int, seed: int) -> list[list[list[int]]]:
    """``steps`` batches, epochs of a seeded shuffle (the same batches for every optimizer of one seed)."""
    rng = random.Random(seed)
    order: list[int] = []
    while len(order) < steps * batch_size:
        epoch = list(range(len(train)))
        rng.shuffle(epoch)
        order += epoch
    return [[train[i] for i in order[s * batch_size:(s + 1) * batch_size]] for s in range(steps)]


# ---------------------------------------------------------------------------------------------------- routing
def embedding_tensors(model) -> set[int]:
    """ids of the input embedding's and the output embedding's (LM head's) weights, by the model's own modules."""
    out = {id(model.get_input_embeddings().weight)}
    head = model.get_output_embeddings()
    if head is not None:
        out.add(id(head.weight))
    return out


def route(model, named: list[tuple[str, torch.nn.Parameter]]) -> dict[str, str]:
    """The hybrid rule under study: a trainable 2-D tensor that is not the input or output embedding goes to Muon;
    everything else (embeddings / LM head, norms, biases, any non-2-D tensor) to AdamW."""
    embeddings = embedding_tensors(model)
    return {name: "muon" if p.ndim == 2 and id(p) not in embeddings else "adamw" for name, p in named}


def routing_table(tied: bool) -> tuple[str, list[str]]:
    """Markdown rows of every parameter tensor of the builtin model (tied or untied embeddings) and its route."""
    from transformers import AutoConfig, LlamaForCausalLM

    from hf_optim.recipes.build import model_location

    config = AutoConfig.from_pretrained(model_location(quickstart_recipe()))
    config.tie_word_embeddings = tied
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    named = list(model.named_parameters())  # a tied LM head is the embedding tensor: listed once
    routes = route(model, named)
    head, embed = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    rows = []
    for name, p in named:
        note = ""
        if p is embed:
            note = "input embedding" + (" = LM head (tied, one tensor)" if head is embed else "")
        elif p is head:
            note = "LM head (output embedding)"
        rows.append(f"| {name} | {tuple(p.shape)} | {routes[name]} | {note} |")
    counts = {side: (sum(1 for n, _ in named if routes[n] == side),
                     sum(p.numel() for n, p in named if routes[n] == side)) for side in ("muon", "adamw")}
    summary = (f"tie_word_embeddings={tied}: lm_head.weight is embed_tokens.weight: {head is embed}; "
               f"Muon {counts['muon'][0]} tensors / {counts['muon'][1]:,} elements, "
               f"AdamW {counts['adamw'][0]} tensors / {counts['adamw'][1]:,} elements")
    return summary, rows


def lora_routing_lines() -> list[str]:
    """Routing of the trainable tensors of the recipe's LoRA model, and with ``modules_to_save`` = embedding and LM
    head (peft's ``ModulesToSaveWrapper`` answers ``.weight`` with its trainable copy, which the rule must find)."""
    from peft import LoraConfig, get_peft_model

    recipe = quickstart_recipe()
    lines = []
    for extra in ({}, {"modules_to_save": ["embed_tokens", "lm_head"]}):
        config = LoraConfig(**{"task_type": "CAUSAL_LM", **recipe.peft, **extra})
        model = get_peft_model(build_model(recipe), config)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        routes = route(model, named)
        shapes = sorted({(tuple(p.shape), routes[n]) for n, p in named if "lora_" in n})
        adamw = [f"`{n}` {tuple(p.shape)}" for n, p in named if routes[n] == "adamw"]
        saved = f" + modules_to_save {extra['modules_to_save']}" if extra else ""
        lines.append(f"- LoRA r={recipe.peft['r']}{saved}: "
                     f"{sum(r == 'muon' for r in routes.values())} tensors to Muon (adapter shapes "
                     f"{', '.join(f'{s}' for s, _ in shapes)}), to AdamW: {', '.join(adamw) or 'none'}")
    return lines


# ---------------------------------------------------------------------------------------------------- training
@dataclasses.dataclass
class Setup:
    """One optimizer configuration: ``kind`` is ``adamw`` (every trainable tensor) or ``muon`` (hybrid)."""

    label: str
    kind: str
    adjust: str | None = None
    muon_lr: float | None = None  # None: the shared learning rate; else Muon's own (the AdamW side keeps the shared)


def build_optimizers(setup: Setup, model, lr: float, weight_decay: float) -> tuple[list[torch.optim.Optimizer],
                                                                                      dict[str, int]]:
    """The optimizer(s) of ``setup`` over ``model``'s trainable tensors, and how many tensors each side got."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if setup.kind == "adamw":
        return [AdamW([p for _, p in named], lr=lr, weight_decay=weight_decay)], {"adamw": len(named)}
    routes = route(model, named)
    muon = [p for n, p in named if routes[n] == "muon"]
    rest = [p for n, p in named if routes[n] == "adamw"]
    optimizers: list[torch.optim.Optimizer] = [
        Muon(muon, lr=setup.muon_lr or lr, weight_decay=weight_decay, adjust_lr_fn=setup.adjust)]
    if rest:
        optimizers.append(AdamW(rest, lr=lr, weight_decay=weight_decay))
    return optimizers, {"muon": len(muon), "adamw": len(rest)}


def schedule(step: int, steps: int, warmup: int) -> float:
    """Linear warmup to 1, then linear decay to 0 at ``steps``: transformers' linear schedule, except that warmup
    starts at ``1 / warmup`` (transformers' first step trains at lr 0, a step that would only move Muon's and
    AdamW's moments)."""
    if step < warmup:
        return (step + 1) / warmup
    return max(0.0, (steps - step) / max(1, steps - warmup))


def evaluate(model, rows: list[list[int]], pad_id: int, batch_size: int = 16) -> float:
    """Token-weighted mean loss over ``rows``."""
    model.eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(rows), batch_size):
            ids, mask, labels = collate(rows[i:i + batch_size], pad_id)
            n = int((labels[:, 1:] != -100).sum())
            total += model(input_ids=ids, attention_mask=mask, labels=labels).loss.item() * n
            tokens += n
    model.train()
    return total / tokens


def train_once(make_model: Callable[[], torch.nn.Module], setup: Setup, lr: float, batches, eval_rows,
               pad_id: int, weight_decay: float, warmup: int, clip: float) -> dict:
    """Train a fresh model with ``setup`` at ``lr``; returns the losses, the eval loss and the tensor counts."""
    model = make_model()
    model.train()
    optimizers, counts = build_optimizers(setup, model, lr, weight_decay)
    bases = [[g["lr"] for g in opt.param_groups] for opt in optimizers]
    trainable = [p for p in model.parameters() if p.requires_grad]
    losses = []
    for step, rows in enumerate(batches):
        factor = schedule(step, len(batches), warmup)
        for opt, base in zip(optimizers, bases):
            for group, lr0 in zip(opt.param_groups, base):
                group["lr"] = lr0 * factor
        ids, mask, labels = collate(rows, pad_id)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(trainable, clip)
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        value = loss.item()
        losses.append(value if math.isfinite(value) else float("nan"))
        if not math.isfinite(value):
            break  # diverged: the rest of the run says nothing more
    diverged = not all(math.isfinite(v) for v in losses)
    return {"losses": losses, "eval": float("nan") if diverged else evaluate(model, eval_rows, pad_id),
            "counts": counts}


# ---------------------------------------------------------------------------------------------------- the parts
def full_model_factory(recipe: Recipe) -> Callable[[], torch.nn.Module]:
    base = build_model(recipe)  # loaded once; every run starts from a copy of the same weights
    state = {k: v.clone() for k, v in base.state_dict().items()}

    def make():
        base.load_state_dict(state)
        for p in base.parameters():
            p.requires_grad_(True)
        return base

    return make


def lora_model_factory(recipe: Recipe) -> Callable[[], torch.nn.Module]:
    from peft import get_peft_model

    config = build_lora_config(recipe)

    def make():
        torch.manual_seed(0)  # the same adapter init (A random, B zero) for every run
        return get_peft_model(build_model(recipe), config)

    return make


def setups(part: str, split_lrs: list[float]) -> list[Setup]:
    out = [Setup("AdamW", "adamw")]
    for adjust in ADJUST:
        out.append(Setup(f"Muon ({adjust})" if part == "full" else f"Muon adapters ({adjust})", "muon", adjust))
    if part == "full":
        for muon_lr in split_lrs:
            out.append(Setup(f"Muon (original, Muon lr {muon_lr:g})", "muon", "original", muon_lr))
    return out


def curve_summary(losses: list[float]) -> str:
    """Mean train loss over the 10 steps ending at each window boundary, e.g. ``@50 3.21``."""
    cells = []
    for end in CURVE_WINDOWS:
        if end <= len(losses):
            cells.append(f"@{end} {statistics.fmean(losses[end - 10:end]):.3f}")
    return ", ".join(cells)


def final(losses: list[float], steps: int) -> float:
    if len(losses) < steps:
        return float("nan")
    return statistics.fmean(losses[-FINAL_WINDOW:])


def fmt(x: float) -> str:
    return "diverged" if math.isnan(x) else f"{x:.4f}"


def run_part(part: str, args, recipe: Recipe, train_rows, eval_rows, pad_id: int, record: dict) -> None:
    make_model = full_model_factory(recipe) if part == "full" else lora_model_factory(
        dataclasses.replace(recipe, peft=dict(recipe.peft)))
    results: dict[tuple[str, float, int], dict] = {}
    started = time.perf_counter()
    orders = {seed: batch_order(train_rows, args.steps, args.batch_size, seed) for seed in args.seeds}

    def sweep(cases: list[tuple[Setup, float]]) -> None:
        for seed in args.seeds:
            for setup, lr in cases:
                t0 = time.perf_counter()
                out = train_once(make_model, setup, lr, orders[seed], eval_rows, pad_id, args.weight_decay,
                                 args.warmup, args.clip)
                results[setup.label, lr, seed] = out
                print(f"[{part}] seed {seed} {setup.label} lr {lr:g}: train {fmt(final(out['losses'], args.steps))} "
                      f"eval {fmt(out['eval'])} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)

    cases = [(s, lr) for s in setups(part, []) for lr in args.lrs]
    sweep(cases)
    if part == "full" and args.split_lrs:
        # 'original' tuned on its own: Muon at each of --split-lrs, the AdamW side at AdamW's best shared lr
        adamw_lr = args.split_adamw_lr or min(args.lrs, key=lambda lr: statistics.fmean(
            results["AdamW", lr, seed]["eval"] for seed in args.seeds))
        split = [(s, adamw_lr) for s in setups(part, args.split_lrs) if s.muon_lr is not None]
        sweep(split)
        cases += split
    elapsed = time.perf_counter() - started

    labels = list(dict.fromkeys(s.label for s, _ in cases))
    title = {"full": "Full fine-tune: hybrid Muon vs AdamW, one shared lr",
             "lora": "LoRA: adapters through Muon vs AdamW (rest frozen)"}[part]
    counts = next(iter(results.values()))["counts"]
    hybrid = next((r["counts"] for (label, _, _), r in results.items() if label.startswith("Muon")), counts)
    print(f"\n### {title}\n")
    print(f"{args.steps} steps, batch {args.batch_size}, seeds {','.join(map(str, args.seeds))}, "
          f"weight decay {args.weight_decay}, warmup {args.warmup}, clip {args.clip}; "
          f"Muon side {hybrid.get('muon', 0)} tensors, AdamW side {hybrid.get('adamw', 0)} tensors; {elapsed:.0f} s.\n")
    # train loss (mean of last 10 steps) and eval loss, per setup x lr, averaged over seeds
    lr_cols = list(dict.fromkeys(lr for _, lr in cases))
    print("Final train loss (mean of the last 10 steps) / eval loss at the end, mean over seeds; **bold** = best "
          "lr of the row by eval loss. "
          "In the rows that name a Muon lr, the column is the AdamW side's lr.\n")
    print("| setup | " + " | ".join(f"lr {lr:g}" for lr in lr_cols) + " |")
    print("|---|" + "---|" * len(lr_cols))
    best: dict[str, tuple[float, float, float]] = {}
    for label in labels:
        cells = []
        for lr in lr_cols:
            runs = [results[label, lr, seed] for seed in args.seeds if (label, lr, seed) in results]
            if not runs:
                cells.append("")
                continue
            tr = statistics.fmean(final(r["losses"], args.steps) for r in runs)
            ev = statistics.fmean(r["eval"] for r in runs)
            if not math.isnan(ev) and (label not in best or ev < best[label][2]):
                best[label] = (lr, tr, ev)
            cells.append((lr, f"{fmt(tr)} / {fmt(ev)}"))
        print(f"| {label} | " + " | ".join(
            (f"**{c[1]}**" if label in best and c[0] == best[label][0] else c[1]) if c else "" for c in cells) + " |")
    print("\nBest lr of each setup, its curve (mean train loss of the 10 steps ending at each step; first seed):\n")
    print("| setup | best lr | train | eval | vs AdamW (eval) | curve |")
    print("|---|---|---|---|---|---|")
    reference = best.get("AdamW", (None, float("nan"), float("nan")))[2]
    for label in labels:
        if label not in best:
            print(f"| {label} | - | diverged at every lr | | | |")
            continue
        lr, tr, ev = best[label]
        curve = curve_summary(results[label, lr, args.seeds[0]]["losses"])
        print(f"| {label} | {lr:g} | {tr:.4f} | {ev:.4f} | {100 * (ev / reference - 1):+.2f}% | {curve} |")
    for (label, lr, seed), out in results.items():
        record.setdefault(part, []).append({"setup": label, "lr": lr, "seed": seed, "eval": out["eval"],
                                            "losses": out["losses"], "counts": out["counts"]})


def check_none_is_original() -> str:
    """torch's ``adjust_lr_fn=None`` takes the ``original`` branch: checked on the study's shapes."""
    shapes = [(256, 256), (128, 256), (768, 256), (256, 768), (32, 256), (768, 32)]
    same = all(_adjust_lr(1.0, None, torch.Size(s)) == _adjust_lr(1.0, "original", torch.Size(s)) for s in shapes)
    scales = ", ".join(f"{s[0]}x{s[1]}: original {_adjust_lr(1.0, 'original', torch.Size(s)):.2f} / match_rms "
                       f"{_adjust_lr(1.0, 'match_rms_adamw', torch.Size(s)):.2f}" for s in shapes)
    return (f"adjust_lr_fn=None equals 'original' on every shape: {same} (so None is not run separately). "
            f"Learning-rate multipliers (shape: original / match_rms_adamw): {scales}.")


def parse_floats(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers, e.g. 1e-3,3e-3") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more positive numbers, e.g. 1e-3,3e-3")
    return values


def parse_split(text: str) -> list[float]:
    return [] if text.strip().lower() == "none" else parse_floats(text)


def parse_parts(text: str) -> list[str]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad or not parts:
        raise argparse.ArgumentTypeError(f"{text!r}: parts are {', '.join(PARTS)} (comma-separated)")
    return parts


def parse_seeds(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()] or [0]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers, e.g. 0,1") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="See the module docstring for what each part measures.")
    parser.add_argument("--parts", type=parse_parts, default=list(PARTS),
                        help="comma-separated subset of full,lora,routing (default: all)")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per run (default 200)")
    parser.add_argument("--lrs", type=parse_floats, default=[1e-3, 3e-3, 1e-2, 3e-2],
                        help="shared learning rates swept (default 1e-3,3e-3,1e-2,3e-2; the recipe uses 5e-3)")
    parser.add_argument("--split-lrs", type=parse_split, default=[1e-2, 3e-2, 1e-1],
                        help="full part: also run 'original' with these Muon-side lrs, the AdamW side at "
                             "--split-adamw-lr; 'none' skips them (default 1e-2,3e-2,1e-1)")
    parser.add_argument("--split-adamw-lr", type=float, default=None,
                        help="the AdamW side's lr of the --split-lrs rows (default: AdamW's best lr of --lrs)")
    parser.add_argument("--seeds", type=parse_seeds, default=[0], help="data-order seeds (default 0)")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per step (default 4, the recipe's)")
    parser.add_argument("--weight-decay", type=float, default=0.01, help="both sides (default 0.01, the recipe's)")
    parser.add_argument("--warmup", type=int, default=5, help="linear warmup steps (default 5, the recipe's)")
    parser.add_argument("--clip", type=float, default=1.0, help="gradient-norm clip, 0 = off (default 1.0)")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (default 0: torch's choice)")
    parser.add_argument("--json", type=Path, default=None, help="also write every run's loss curve here")
    args = parser.parse_args(argv)
    if args.steps < FINAL_WINDOW or args.batch_size < 1:
        parser.error(f"--steps must be >= {FINAL_WINDOW} and --batch-size >= 1 (got {args.steps}, {args.batch_size})")
    if args.threads:
        torch.set_num_threads(args.threads)

    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads; "
          f"`{' '.join(['python', 'benchmarks/quality/muon_study.py', *(sys.argv[1:] if argv is None else argv)])}`\n")
    print(check_none_is_original())
    record: dict = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}

    if "routing" in args.parts:
        print("\n### Routing: which tensors go to AdamW (builtin tiny model)\n")
        for tied in (True, False):
            summary, rows = routing_table(tied)
            print(f"{summary}\n")
            print("| parameter | shape | rule | note |\n|---|---|---|---|")
            print("\n".join(rows) + "\n")
        print("\n".join(lora_routing_lines()))
    training_parts = [p for p in args.parts if p != "routing"]
    if training_parts:
        recipe = quickstart_recipe()
        pad_id = build_tokenizer(recipe).pad_token_id
        train_rows, eval_rows = tokenized_splits(recipe)
        for part in training_parts:
            run_part(part, args, recipe, train_rows, eval_rows, pad_id, record)
    if args.json:
        args.json.write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
