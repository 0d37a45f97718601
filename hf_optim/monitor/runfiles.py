"""The files of one run directory: names, writing (crash-safe) and reading them back."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from hf_optim.errors import UserFileNotFoundError, UserValueError

METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
RECIPE = "recipe.yaml"
LOSS_PNG = "loss.png"
MEMORY_PNG = "memory.png"
DASHBOARD_PNG = "dashboard.png"


def _jsonable(value):
    """JSON has no NaN/Inf: a diverged loss is written as null rather than producing an unreadable file."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # a 0-d tensor or numpy scalar
        return _jsonable(value.item())
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def append_record(run_dir: Path, record: dict) -> None:
    """Append one line to metrics.jsonl and flush it, so a crash keeps every step logged so far."""
    with open(run_dir / METRICS, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(_jsonable(record)) + "\n")


def rewrite_records(run_dir: Path, records: list[dict]) -> None:
    """Replace metrics.jsonl by ``records``, through a temporary file and a rename (a crash keeps the old file)."""
    path = Path(run_dir) / METRICS
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(_jsonable(record)) + "\n" for record in records), encoding="utf-8")
    os.replace(tmp, path)


def write_json(path: Path, data: dict) -> None:
    """Write through a temporary file and rename, so a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_jsonable(data), indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def write_recipe(run_dir: Path, recipe: dict) -> Path:
    """The resolved recipe as ``recipe.yaml`` (key order kept)."""
    import yaml

    path = run_dir / RECIPE
    path.write_text(yaml.safe_dump(_jsonable(recipe), sort_keys=False), encoding="utf-8")
    return path


def read_records(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / METRICS
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if number == len(lines):
                break  # the last line of a killed run may be cut short
            raise UserValueError(f"{path}:{number}: not a JSON line ({exc})") from exc
    return records


@dataclass
class RunData:
    """One run directory as read back: its records (train and eval) and its summary."""

    run_dir: Path
    records: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.summary.get("run_name") or self.run_dir.name

    @property
    def train(self) -> list[dict]:
        return [r for r in self.records if r.get("kind") == "train"]

    @property
    def evals(self) -> list[dict]:
        return [r for r in self.records if r.get("kind") == "eval"]

    @property
    def status(self) -> str:
        return self.summary.get("status", "unknown")

    @property
    def optimizer_label(self) -> str:
        info = self.summary.get("optimizer") or {}
        return info.get("name") or "?"


def load_run(run_dir) -> RunData:
    """Read a run directory written by :class:`~hf_optim.monitor.TrainingMonitor`."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserFileNotFoundError(f"run directory {str(run_dir)!r} does not exist")
    summary_path = run_dir / SUMMARY
    if not summary_path.exists() and not (run_dir / METRICS).exists():
        raise UserFileNotFoundError(
            f"{str(run_dir)!r} is not a run directory: it has neither {SUMMARY} nor {METRICS} "
            "(train with hf_optim.monitor.TrainingMonitor in the Trainer's callbacks)"
        )
    summary = json.loads(summary_path.read_text(encoding="utf-8")) if summary_path.exists() else {}
    return RunData(run_dir, read_records(run_dir), summary)
