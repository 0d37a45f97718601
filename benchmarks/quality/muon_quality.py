"""The lr grid of `hf-optim train --sweep` runs, one table per setup, and the issue 25 acceptance check.

`hf-optim train ... --sweep training.optim=...` sweeps one key, so the lr grid is one sweep per lr, each in
``<root>/<setup>_lr<lr>/<optim>/``. This script reads those run directories back and prints, per setup, every
(optimizer, lr) cell: the EMA loss that compare.md reports (the best lr of each optimizer, by it, in bold), the final
loss (the last logged training loss: one batch, the same batch for every run of a setup, as the data order is the
recipe's seed) and the mean of the last 20 training losses; then 8-bit and 4-bit Muon against 32-bit Muon, each at its
best lr, and the run directories to pass to `hf-optim compare`. Commands:
docs/lab/2026-measurements.md#muon-quality-issue-25.

    python benchmarks/quality/muon_quality.py runs/muon_quality full lora loramuon
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hf_optim.monitor.runfiles import RunData, load_run

OPTIMIZERS = ("adamw_torch", "adamw_8bit", "muon", "muon_8bit", "muon_4bit")
TAIL = 20  # steps averaged for the "last 20" figure
LIMITS = {"muon_8bit": 1.0, "muon_4bit": 2.0}  # issue 25: % above 32-bit Muon's final loss


def losses(run: RunData) -> tuple[float, float, float]:
    """(EMA loss, final loss, mean of the last TAIL training losses) of a finished run."""
    train = [r["loss"] for r in run.train if r.get("loss") is not None]
    return run.summary["ema_loss"], run.summary["final_loss"], sum(train[-TAIL:]) / len(train[-TAIL:])


def grid(root: Path, setup: str, steps: int) -> dict[tuple[str, str], tuple[RunData, tuple[float, float, float]]]:
    """{(optimizer, lr): (run, losses)} for every finished run of ``<root>/<setup>_lr*/``."""
    cells = {}
    for sweep in root.glob(f"{setup}_lr*"):
        lr = sweep.name.rsplit("_lr", 1)[1]
        for run_dir in sweep.iterdir():
            if run_dir.name in OPTIMIZERS and (run_dir / "summary.json").is_file():
                run = load_run(run_dir)
                if run.status == "ok" and run.summary.get("global_step") == steps:
                    cells[(run_dir.name, lr)] = (run, losses(run))
    return cells


def report(root: Path, setup: str, steps: int) -> None:
    """Print the setup's table, the acceptance lines and the best runs' directories."""
    cells = grid(root, setup, steps)
    lrs = sorted({lr for _, lr in cells}, key=float)
    names = [o for o in OPTIMIZERS if any((o, lr) in cells for lr in lrs)]
    best = {o: min((lr for lr in lrs if (o, lr) in cells), key=lambda lr: cells[(o, lr)][1][0]) for o in names}
    print(f"\n### {setup}: EMA loss (final loss) [mean of the last {TAIL} steps]; bold: the optimizer's best lr\n")
    print("| optimizer | " + " | ".join(f"lr {lr}" for lr in lrs) + " |")
    print("|---|" + "---|" * len(lrs))
    for o in names:
        row = []
        for lr in lrs:
            if (o, lr) not in cells:
                row.append("-")
                continue
            ema, final, tail = cells[(o, lr)][1]
            text = f"{ema:.4f} ({final:.4f}) [{tail:.4f}]"
            row.append(f"**{text}**" if lr == best[o] else text)
        print(f"| {o} | " + " | ".join(row) + " |")
    if "muon" in best:
        reference = cells[("muon", best["muon"])][1]
        for o, limit in LIMITS.items():
            if o in best:
                mine = cells[(o, best[o])][1]
                gaps = [100 * (m / r - 1) for m, r in zip(mine, reference)]
                verdict = "within" if gaps[1] <= limit else "NOT within"
                print(f"\n{o} (lr {best[o]}) vs muon (lr {best['muon']}): final {gaps[1]:+.2f}% "
                      f"({verdict} {limit:g}%), EMA {gaps[0]:+.2f}%, last {TAIL} {gaps[2]:+.2f}%")
    print("\nbest runs:", " ".join(str(cells[(o, best[o])][0].run_dir) for o in names))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="the directory holding <setup>_lr<lr>/ sweeps")
    parser.add_argument("setups", nargs="+", help="sweep name prefixes, e.g. full lora loramuon")
    parser.add_argument("--steps", type=int, default=200, help="only runs that reached this step (default 200)")
    args = parser.parse_args()
    for setup in args.setups:
        report(args.root, setup, args.steps)


if __name__ == "__main__":
    main()
