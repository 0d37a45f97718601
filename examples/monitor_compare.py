"""Log and compare optimizers with hf_optim.monitor: SFTTrainer on the tiny model, on CPU, offline.

    python examples/monitor_compare.py                                   # adamw_torch vs paged_adamw_8bit
    python examples/monitor_compare.py --optims adamw_torch lamb_8bit lion_8bit --steps 60 --out runs/sweep

Each optimizer gets a run directory (metrics.jsonl, summary.json, loss.png, memory.png, dashboard.png); the
comparison (compare.md and its plots) goes to OUT/compare, with the first optimizer as the baseline.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from datasets import Dataset
from trl import SFTConfig, SFTTrainer

import hf_optim  # noqa: F401  (imported before any SFTConfig is built: hf_optim's optim= names)
from hf_optim.monitor import TrainingMonitor, compare_runs
from hf_optim.tiny import tiny_llama, tiny_texts, tiny_tokenizer


def train(name: str, run_dir: Path, steps: int, lr: float) -> None:
    config = SFTConfig(
        output_dir=str(run_dir), optim=name, max_steps=steps, learning_rate=lr, per_device_train_batch_size=8,
        logging_steps=1, eval_strategy="steps", eval_steps=max(1, steps // 4), save_strategy="no", report_to=[],
        use_cpu=True, bf16=False, gradient_checkpointing=False, max_length=64, seed=0, disable_tqdm=True,
    )
    trainer = SFTTrainer(
        model=tiny_llama(), args=config, processing_class=tiny_tokenizer(),
        train_dataset=Dataset.from_dict({"text": tiny_texts(512)}),
        eval_dataset=Dataset.from_dict({"text": tiny_texts(32, seed=1)}),
        callbacks=[TrainingMonitor(run_dir, run_name=name)],
    )
    trainer.train()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--optims", nargs="+", default=["adamw_torch", "paged_adamw_8bit"])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--out", type=Path, default=Path("runs/monitor_compare"))
    args = parser.parse_args()

    run_dirs = [args.out / name for name in args.optims]
    for name, run_dir in zip(args.optims, run_dirs):
        train(name, run_dir, args.steps, args.lr)
    report = compare_runs(run_dirs, args.out / "compare")
    print(report.read_text())
    print(f"plots: {', '.join(str(d) for d in run_dirs)} (loss.png, memory.png, dashboard.png); {report.parent}")


if __name__ == "__main__":
    main()
