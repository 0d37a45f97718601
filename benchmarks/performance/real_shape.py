"""Recipes at their real shape with random weights (``hf-optim train RECIPE --random-weights``): measured memory by
component beside the planner's estimate, on CPU or CUDA, optionally under a memory cap that stands in for a
smaller card.

  # one run (its own process: a cap applies from the first CUDA allocation)
  python benchmarks/performance/real_shape.py run llama-3.2-1b-lora --out runs/rs/1b-lora --steps 3 --seq-len 256 \\
      --batch-size 1 training.gradient_accumulation_steps=1
  python benchmarks/performance/real_shape.py run llama-3.1-8b-full --cap 24GiB --plan \\
      --out runs/rs/8b-full-24g --steps 10
  # the table of finished runs (Markdown)
  python benchmarks/performance/real_shape.py table runs/rs/*

``--cap`` calls ``torch.cuda.set_per_process_memory_fraction(cap / total)``: torch's allocator refuses to hold more,
as on a card of that size (the CUDA context and CUDA managed memory, where paged optimizer state lives, are not
capped: on a large card paged state stays resident, so a cap checks the allocator's part, not paging speed).
``--plan`` (full fine-tunes, with ``--cap``) applies the setup ``hf-optim validate RECIPE --fit CAP`` ranks first:
its optimizer, gradient release, checkpointing and largest batch. Before a run whose optimizer state is paged, the
card's free memory is checked: a run never asks for more CUDA managed memory than the card has free.

Timing figures are only meaningful on an idle machine; the CPU's are not published from a loaded one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def plan_overrides(recipe_name: str, cap_bytes: int, overrides: list[str]) -> list[str]:
    """The overrides that turn ``recipe_name`` into the planner's first-ranked setup for a card of ``cap_bytes``."""
    from hf_optim.recipes.api import load_recipe
    from hf_optim.recipes.fit import plan

    recipe = load_recipe(recipe_name, overrides)
    result = plan(recipe, cap_bytes)
    if not result.fits:
        raise SystemExit(f"the planner finds no setup of {recipe_name} that fits {cap_bytes / 2**30:.1f} GiB")
    best = result.fits[0]
    setup = best.setup
    args = [f"training.optim={setup.optim}", f"training.gradient_checkpointing={str(setup.checkpointing).lower()}",
            f"training.per_device_train_batch_size={min(best.max_batch, result.recipe_batch)}"]
    if setup.release:
        kept = recipe.training.get("optim_args")
        args += [f"training.optim_args={kept + ',' if kept else ''}release_gradients=true", "training.max_grad_norm=0",
                 "training.gradient_accumulation_steps=1"]
    print(f"planner's setup for {cap_bytes / 2**30:.1f} GiB: {setup.label()}, batch "
          f"{min(best.max_batch, result.recipe_batch)} -> {' '.join(args)}", flush=True)
    return args


def paged_state_room(recipe_name: str, overrides: list[str], cap_bytes: int | None) -> str | None:
    """Why a run must not start (its paged state would ask for more CUDA managed memory than is free), else None."""
    import torch

    from hf_optim.integrations.names import OPTIMIZER_NAMES
    from hf_optim.recipes.api import load_recipe
    from hf_optim.recipes.estimate import estimate

    if not torch.cuda.is_available():
        return None
    recipe = load_recipe(recipe_name, overrides)
    entry = OPTIMIZER_NAMES.get(recipe.optim)
    if not (recipe.optim.startswith("paged_") or (entry is not None and entry.paged)):
        return None
    state = estimate(recipe).state_bytes or 0
    free, _ = torch.cuda.mem_get_info()
    need = state + (cap_bytes or 0)
    if need > free:
        return (f"paged state {state / 2**30:.1f} GiB + cap {(cap_bytes or 0) / 2**30:.1f} GiB > free "
                f"{free / 2**30:.1f} GiB: not started")
    return None


def cmd_run(args, overrides: list[str]) -> int:
    import torch

    from hf_optim.recipes.fit import parse_memory

    cap = parse_memory(args.cap) if args.cap else None
    if args.plan:
        if cap is None:
            raise SystemExit("--plan needs --cap (the card size the planner fits the recipe to)")
        overrides = [*overrides, *plan_overrides(args.recipe, cap, overrides)]
    if cap is not None:
        if not torch.cuda.is_available():
            print("--cap: no CUDA device; skipped", flush=True)
            return 0
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
        print(f"memory cap: {cap / 2**30:.2f} GiB of {total / 2**30:.2f} GiB", flush=True)
    problem = paged_state_room(args.recipe, overrides, cap)
    if problem:
        print(problem, flush=True)
        return 0
    from hf_optim.cli import main

    argv = ["train", args.recipe, "--random-weights", "--output-dir", args.out, "--overwrite"]
    for flag, value in (("--steps", args.steps), ("--seq-len", args.seq_len), ("--batch-size", args.batch_size)):
        if value is not None:
            argv += [flag, str(value)]
    status = main([*argv, *overrides])
    report = Path(args.out) / "memory_by_component.json"
    if report.is_file():
        data = json.loads(report.read_text())
        data["cap_bytes"] = cap
        data["takeover"] = os.environ.get("HF_OPTIM_TAKEOVER", "1")
        data["overrides"] = overrides
        report.write_text(json.dumps(data, indent=2) + "\n")
    return status


def _gib(value) -> str:
    return "-" if value is None else f"{value / 2**30:.2f}"


def table(run_dirs: list[Path]) -> str:
    """A Markdown table of the runs' memory by component (estimate / measured GiB) and speed."""
    head = ("| run | device | tokens | weights | adapters | grads | state | activations | peak | meas/est peak | "
            "NVML GiB | tok/s | opt. share | losses |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for run_dir in run_dirs:
        path = run_dir / "memory_by_component.json"
        if not path.is_file():
            lines.append(f"| {run_dir.name} | no memory_by_component.json (failed or skipped: see its log) |")
            continue
        data = json.loads(path.read_text())
        parts = data["components"]

        def cell(name, parts=parts):
            row = parts[name]
            return f"{_gib(row['estimate_bytes'])} / {_gib(row['measured_bytes'])}"

        ratio = parts["peak"]["measured_over_estimate"]
        tps = data.get("tokens_per_second_after_first")
        share = data.get("optimizer_step_share")
        losses = ", ".join(f"{x:.3f}" for x in data.get("losses", [])[:1] + data.get("losses", [])[-1:])
        status = "" if data.get("status", "ok") == "ok" else f" **{data['status']}**"
        lines.append(f"| {run_dir.name}{status} | {data['device_name']} | {data['seq_len']}x{data['batch_size']} | "
                     f"{cell('weights')} | {cell('adapters')} | {cell('gradients')} | {cell('optimizer_state')} | "
                     f"{cell('activations')} | {cell('peak')} | {'-' if ratio is None else f'{ratio:.3f}'} | "
                     f"{_gib(data.get('nvml_peak_process_bytes'))} | {'-' if tps is None else f'{tps:,.0f}'} | "
                     f"{'-' if share is None else f'{share:.1%}'} | {losses} |")
    lines.append("")
    lines.append("Cells: estimate / measured GiB. activations = peak - weights - adapters - state on the device - "
                 "gradients. losses: first, last. tok/s and the optimizer step's share: steps after the first.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = parser.add_subparsers(dest="verb", required=True)
    run = verbs.add_parser("run", help="one random-weights run of a recipe")
    run.add_argument("recipe")
    run.add_argument("--out", required=True, help="run directory")
    run.add_argument("--steps", type=int)
    run.add_argument("--seq-len", type=int)
    run.add_argument("--batch-size", type=int)
    run.add_argument("--cap", help="CUDA memory cap, e.g. 24GiB (torch.cuda.set_per_process_memory_fraction)")
    run.add_argument("--plan", action="store_true", help="with --cap: the planner's first-ranked setup for that size")
    tab = verbs.add_parser("table", help="Markdown table of finished runs")
    tab.add_argument("run_dirs", nargs="+", type=Path)
    args, extra = parser.parse_known_args(argv)
    if args.verb == "table":
        print(table(args.run_dirs))
        return 0
    return cmd_run(args, extra)


if __name__ == "__main__":
    sys.exit(main())
