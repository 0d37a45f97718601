"""The files of one run directory: names, writing (crash-safe) and reading them back."""

from __future__ import annotations

import json
import math
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from hf_optim.errors import UserFileNotFoundError, UserValueError

METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
RECIPE = "recipe.yaml"
LOSS_PNG = "loss.png"
MEMORY_PNG = "memory.png"
DASHBOARD_PNG = "dashboard.png"

RUNNING = "running"
DIED = "died"
"""The status a reader gives a run whose summary still says ``running`` but whose process is gone: it ended without
writing how (SIGKILL, the kernel's out-of-memory killer, a power cut, or a crash that Python could not catch)."""


# ---- which process writes a run ----------------------------------------------------------------------------------

def process_start_time(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch, psutil's ``create_time``), None when there is no such
    process or psutil cannot tell."""
    try:
        import psutil
    except ImportError:
        return None
    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.Error, OSError, ValueError):
        return None


def this_process() -> dict:
    """The ``process`` entry of summary.json: what a reader needs to tell a running run from one whose process is
    gone (a pid alone could be reused by another process: its start time tells them apart)."""
    pid = os.getpid()
    return {"pid": pid, "host": socket.gethostname(), "started": process_start_time(pid)}


def process_alive(process: dict | None) -> bool | None:
    """Whether the process a summary's ``process`` entry names still runs: True, False, or None when this machine
    cannot tell (another host, or no pid recorded)."""
    if not isinstance(process, dict) or not isinstance(process.get("pid"), int):
        return None
    if process.get("host") != socket.gethostname():
        return None
    pid = process["pid"]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        pass
    except OSError:
        return None
    started, now = process.get("started"), process_start_time(pid)
    if isinstance(started, (int, float)) and now is not None and abs(now - started) > 1.0:
        return False  # the pid now belongs to a process that started later: the run's own process is gone
    return True


def effective_status(summary: dict) -> str:
    """A summary's status as a reader should show it: ``running`` only while the process that wrote it is still
    there (or on another host, where this machine cannot check), :data:`DIED` once it is gone; any other status
    as written (``ok``, ``interrupted``, ``killed``, ``failed``, ``oom``)."""
    status = summary.get("status", "unknown")
    if status == RUNNING and process_alive(summary.get("process")) is False:
        return DIED
    return status


def status_note(run: RunData) -> str | None:
    """One line about a run that has not finished normally, for ``plot`` and ``compare``; None for a finished
    run."""
    run_dir, summary, status, step = run.run_dir, run.summary, run.status, run.last_step
    at = f" at step {step}" if step is not None else ""
    process = summary.get("process") or {}
    if status == DIED:
        after = f" after step {step}" if step is not None else ""
        return (f"{run_dir}: its process (pid {process.get('pid')} on this host) is gone: it ended{after} without "
                "recording how (killed with SIGKILL, stopped by the out-of-memory killer, or crashed; summary.json "
                "says running)")
    if status == RUNNING and process_alive(process) is None and process.get("host"):
        return f"{run_dir}: summary.json says running{at}, on host {process['host']} (this machine cannot check it)"
    if status == RUNNING:
        return f"{run_dir}: still running{at} (pid {process.get('pid', '?')})"
    if status == "failed":
        error = summary.get("error") or {}
        return f"{run_dir}: failed{at}: {error.get('type', 'error')}: {error.get('message', '')}".rstrip(": ")
    if status == "killed":
        return f"{run_dir}: killed by {summary.get('signal') or 'a signal'}{at}"
    if status == "interrupted":
        return f"{run_dir}: interrupted{at}"
    return None


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
        """How the run ended (:func:`effective_status`): a summary left at ``running`` by a process that is gone
        reads :data:`DIED`."""
        return effective_status(self.summary)

    @property
    def last_step(self) -> int | None:
        """The last step that ended: the summary's, or, while the summary is the one written when training began
        (running, or a process that died), the last step logged in ``metrics.jsonl``."""
        step = self.summary.get("global_step")
        if self.summary.get("status") == RUNNING:
            step = max([step or 0] + [r["step"] for r in self.train if isinstance(r.get("step"), int)])
        return step

    @property
    def logged_loss_mean(self) -> float | None:
        """The mean of every training loss logged in ``metrics.jsonl``: for a resumed run, the steps before the
        checkpoint it resumed from included (the Trainer's ``train_loss`` covers only the steps after it)."""
        losses = [r["loss"] for r in self.train if r.get("loss") is not None]
        return math.fsum(losses) / len(losses) if losses else None

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
