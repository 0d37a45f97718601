"""Does bf16 stochastic rounding bring a pure-bf16 full fine-tune's loss curve back to the fp32 one?

Runs ``benchmarks/quality/bf16_full_tiny.yaml`` (the builtin tiny Llama-3-shaped model, full fine-tune, the full
recipes' paged_adamw_8bit at lr 2e-5 with a cosine schedule) three times with ``hf-optim train``, same seed and data
order:

- ``fp32``: fp32 weights (the reference);
- ``bf16``: pure bf16 weights, the optimizer's fp32 result rounded to nearest (what the full recipes ran);
- ``bf16+sr``: pure bf16 weights with ``training.optim_args=bf16_stochastic_round=true``.

Then writes ``docs/figures/bf16_stochastic_rounding.png`` (loss curves, smoothed, and their gap to fp32) and
``docs/figures/bf16_stochastic_rounding.json`` (final and mean loss gaps to fp32). Usage::

    PYTHONPATH=. HF_HUB_OFFLINE=1 python benchmarks/quality/bf16_stochastic_rounding.py [--steps 200] \\
        [--runs runs/bf16-sr]

``--plot-only`` redraws from existing run directories.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "benchmarks" / "quality" / "bf16_full_tiny.yaml"
VARIANTS = {
    "fp32": ["model.dtype=float32"],
    "bf16": ["model.dtype=bfloat16"],
    "bf16+sr": ["model.dtype=bfloat16", "training.optim_args=bf16_stochastic_round=true"],
}


def train(name: str, overrides: list[str], steps: int, runs: Path) -> None:
    out = runs / name.replace("+", "-")
    command = [sys.executable, "-m", "hf_optim.cli", "train", str(RECIPE), f"training.max_steps={steps}",
               *overrides, "--output-dir", str(out)]
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def losses(run: Path) -> np.ndarray:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return np.array([row["loss"] for row in rows if row.get("kind") == "train" and row.get("loss") is not None])


def smooth(values: np.ndarray, window: int) -> np.ndarray:
    kernel = np.ones(window) / window
    return np.convolve(values, kernel, mode="valid")


def summarize(runs: Path, figure: Path) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = {name: losses(runs / name.replace("+", "-")) for name in VARIANTS}
    steps = min(len(curve) for curve in curves.values())
    curves = {name: curve[:steps] for name, curve in curves.items()}
    reference = curves["fp32"]
    tail = max(steps // 10, 1)  # "final": the mean of the last tenth of the steps (single steps are noisy)
    numbers = {"steps": steps, "final_window_steps": tail}
    for name, curve in curves.items():
        numbers[name] = {
            "final_loss": float(curve[-tail:].mean()),
            "mean_loss": float(curve.mean()),
            "final_gap_to_fp32": float(curve[-tail:].mean() - reference[-tail:].mean()),
            "mean_gap_to_fp32": float((curve - reference).mean()),
            "mean_abs_gap_to_fp32": float(np.abs(curve - reference).mean()),
        }
    window = max(steps // 30, 1)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    x = np.arange(window, steps + 1)
    styles = {"fp32": dict(color="black", linestyle="--", zorder=3), "bf16": dict(color="tab:orange"),
              "bf16+sr": dict(color="tab:green", linewidth=2.5)}  # fp32 dashed on top: the SR curve lies under it
    for name, curve in curves.items():
        top.plot(x, smooth(curve, window), label=name, **styles[name])
        if name != "fp32":
            bottom.plot(x, smooth(curve - reference, window), label=f"{name} - fp32", **styles[name])
    top.set_ylabel(f"train loss (mean of {window} steps)")
    top.set_title("Tiny Llama-3-shaped model, full fine-tune, paged_adamw_8bit, lr 2e-5 cosine")
    top.legend()
    bottom.axhline(0.0, color="grey", linewidth=0.8)
    bottom.set_ylabel("loss gap to fp32 weights")
    bottom.set_xlabel("step")
    bottom.legend()
    fig.tight_layout()
    figure.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(figure, dpi=120)
    figure.with_suffix(".json").write_text(json.dumps(numbers, indent=2) + "\n")
    return numbers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--runs", type=Path, default=Path("runs/bf16-sr"))
    parser.add_argument("--figure", type=Path, default=ROOT / "docs" / "figures" / "bf16_stochastic_rounding.png")
    parser.add_argument("--plot-only", action="store_true")
    args = parser.parse_args()
    if not args.plot_only:
        for name, overrides in VARIANTS.items():
            train(name, overrides, args.steps, args.runs)
    print(json.dumps(summarize(args.runs, args.figure), indent=2))


if __name__ == "__main__":
    main()
