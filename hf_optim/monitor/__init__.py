"""TEMPORARY stand-in for the monitor (issue 4, logging half), built in another branch.

It implements the agreed contract minimally so that the recipe/CLI branch runs end to end: the lead drops this
commit when merging the real ``hf_optim.monitor``. No memory accounting, no real plots.
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import TrainerCallback


class TrainingMonitor(TrainerCallback):
    """Stand-in: writes metrics.jsonl (the Trainer's logs) and summary.json (status, recipe, optimizer class)."""

    def __init__(self, output_dir, run_name=None, recipe=None):
        self.output_dir = Path(output_dir)
        self.run_name = run_name or self.output_dir.name
        self.recipe = recipe
        self.optimizer = None

    def _summary(self, status: str, **extra) -> None:
        self.output_dir.mkdir(parents=True, exist_ok=True)
        summary = {"run_name": self.run_name, "status": status, "optimizer": self.optimizer, "recipe": self.recipe}
        (self.output_dir / "summary.json").write_text(json.dumps({**summary, **extra}, default=str, indent=1))

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        inner = getattr(optimizer, "optimizer", optimizer)
        self.optimizer = None if inner is None else f"{type(inner).__module__}.{type(inner).__qualname__}"
        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self.output_dir / "metrics.jsonl").write_text("")

    def on_log(self, args, state, control, logs=None, **kwargs):
        with open(self.output_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": state.global_step, **(logs or {})}) + "\n")

    def on_train_end(self, args, state, control, **kwargs):
        self._summary("ok")
        plot_run(self.output_dir)

    def record_oom(self, exc: BaseException) -> None:
        self._summary("oom", error=str(exc))


def plot_run(run_dir) -> list[Path]:
    """Stand-in: loss.png, memory.png and dashboard.png all show the logged loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    points = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    paths = []
    for name in ("loss.png", "memory.png", "dashboard.png"):
        fig, ax = plt.subplots()
        ax.plot([p[0] for p in points], [p[1] for p in points])
        ax.set_title(f"{name} (temporary stand-in)")
        fig.savefig(run_dir / name)
        plt.close(fig)
        paths.append(run_dir / name)
    return paths


def compare_runs(run_dirs, out_dir, baseline=None) -> Path:
    """Stand-in: a compare.md table of status per run."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = ["| run | status |", "|---|---|"]
    for run_dir in run_dirs:
        summary_path = Path(run_dir) / "summary.json"
        status = json.loads(summary_path.read_text())["status"] if summary_path.exists() else "missing"
        lines.append(f"| {Path(run_dir).name} | {status} |")
    path = out_dir / "compare.md"
    path.write_text("\n".join(lines) + "\n")
    return path
