"""The run directory of ``hf-optim train``: does it hold a run, which checkpoint a resume starts from, what
``--overwrite`` clears.

A directory *holds a run* when it has a ``checkpoint-N`` folder, a logged training step in ``metrics.jsonl``, or a
final model the Trainer saved (its ``training_args.bin``). Such a directory is never written over silently: a new
run into it is refused until the user says ``--resume`` (continue it) or ``--overwrite`` (start again), the
Trainer's ``overwrite_output_dir`` idea. Anything less, such as the ``recipe.yaml`` and ``summary.json`` that an
attempt which failed before its first step leaves, is not a run, and the next attempt simply writes over it.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from hf_optim.checkpoints import checkpoint_problems, checkpoints, last_complete_checkpoint
from hf_optim.errors import UserValueError

AUTO = "auto"
FINAL_MODEL_MARKER = "training_args.bin"  # Trainer.save_model writes it next to every model it saves


def monitor_files() -> tuple[str, ...]:
    """The files hf_optim writes into a run directory (besides the Trainer's checkpoints and final model)."""
    from hf_optim.monitor import runfiles  # not at import: importing hf_optim.recipes stays free of transformers

    return (runfiles.METRICS, runfiles.METRICS + ".tmp", runfiles.SUMMARY, runfiles.SUMMARY + ".tmp",
            runfiles.RECIPE, runfiles.LOSS_PNG, runfiles.MEMORY_PNG, runfiles.DASHBOARD_PNG)


def smoke_dir(path: str | Path) -> Path:
    """The directory a smoke run (``--smoke``) of a recipe whose real run goes to ``path`` writes to: its own, so
    that a smoke run never occupies the real run's directory (``runs/quickstart`` -> ``runs/quickstart-smoke``)."""
    path = Path(path)
    return path.with_name(f"{path.name}-smoke")


class RunDirectoryError(UserValueError):
    """A run directory that cannot be used as asked (one line: what is there and the ways out)."""


@dataclass
class RunDirectory:
    """What a run directory holds.

    Attributes:
        path: the directory.
        checkpoints: its ``checkpoint-N`` folders, newest first (complete or not).
        logged_steps: the training records in ``metrics.jsonl``.
        final_model: the Trainer saved a model there (the end of a finished run).
        status: ``summary.json``'s status as a reader shows it (``running``, ``ok``, ``interrupted``, ``killed``,
            ``failed``, ``oom``; ``died`` for a summary left at ``running`` by a process that is gone:
            :func:`hf_optim.monitor.runfiles.effective_status`), None without one.
        process: ``summary.json``'s ``process`` entry (pid, host, start time of the process that wrote it).
    """

    path: Path
    checkpoints: list[Path] = field(default_factory=list)
    logged_steps: int = 0
    final_model: bool = False
    status: str | None = None
    process: dict | None = None

    @property
    def in_use(self) -> bool:
        """Another process on this machine is still training into this directory (this process's own earlier run,
        in a notebook whose ``train()`` raised, is not in use)."""
        import os

        from hf_optim.monitor import runfiles

        return (self.status == runfiles.RUNNING and runfiles.process_alive(self.process) is True
                and self.process.get("pid") != os.getpid())

    @property
    def holds_a_run(self) -> bool:
        return bool(self.checkpoints or self.logged_steps or self.final_model)

    def describe(self) -> str:
        """``"checkpoint-5 .. checkpoint-10, 10 logged steps, status interrupted"``."""
        parts = []
        if self.checkpoints:
            names = [p.name for p in self.checkpoints]
            parts.append(names[0] if len(names) == 1 else f"{names[-1]} .. {names[0]}")
        if self.logged_steps:
            parts.append(f"{self.logged_steps} logged step{'s' if self.logged_steps != 1 else ''}")
        if self.final_model and self.status != "ok":
            parts.append("a saved model")
        if self.status == "died":
            parts.append("its process ended without recording how (killed with SIGKILL, or crashed)")
        elif self.status:
            parts.append("finished" if self.status == "ok" else f"status {self.status}")
        return ", ".join(parts)


def inspect(path: str | Path) -> RunDirectory:
    """Read what ``path`` holds (an absent directory holds nothing)."""
    from hf_optim.monitor import runfiles

    path = Path(path)
    if not path.is_dir():
        return RunDirectory(path)
    try:
        records = runfiles.read_records(path)
    except ValueError:  # a damaged metrics.jsonl still means something was logged there
        records = [{"kind": "train"}]
    status = process = None
    summary = path / runfiles.SUMMARY
    if summary.is_file():
        try:
            data = json.loads(summary.read_text(encoding="utf-8"))
            status, process = runfiles.effective_status(data), data.get("process")
        except (ValueError, AttributeError):
            status = None
    return RunDirectory(path, checkpoints(path), sum(r.get("kind") == "train" for r in records),
                        (path / FINAL_MODEL_MARKER).is_file(), status, process)


def resolve_checkpoint(output_dir: Path, resume: str) -> str:
    """The checkpoint ``resume`` names for a run into ``output_dir``: ``"auto"``, the last complete checkpoint of
    ``output_dir``; a run directory, its last complete checkpoint; else a checkpoint folder, which must be
    complete. Raises :class:`RunDirectoryError` with one line when there is none."""
    if resume == AUTO:
        found = last_complete_checkpoint(output_dir)
        if found is None:
            raise RunDirectoryError(_nothing_to_resume(inspect(output_dir)))
        return found
    path = Path(resume)
    if not path.is_dir():
        raise RunDirectoryError(f"--resume {resume}: no such checkpoint directory (give a checkpoint-N folder, a run "
                                "directory, or auto for the last checkpoint of the output directory)")
    if not (path / "trainer_state.json").exists() and checkpoints(path):  # a run directory: its last checkpoint
        found = last_complete_checkpoint(path)
        if found is None:
            raise RunDirectoryError(_nothing_to_resume(inspect(path)))
        return found
    problems = checkpoint_problems(path)
    if problems:
        raise RunDirectoryError(f"--resume {resume}: not a complete Trainer checkpoint ({problems[0]})")
    return str(path)


def _nothing_to_resume(found: RunDirectory) -> str:
    where = f"--resume: {found.path} has no complete checkpoint to resume from"
    if found.checkpoints:
        where += f" ({', '.join(p.name for p in found.checkpoints)} incomplete)"
    if found.holds_a_run:
        return f"{where}; start it again with --overwrite, or choose another --output-dir"
    return f"{where}; start a new run without --resume"


def prepare(output_dir: str | Path, resume: str | None = None, overwrite: bool = False) -> str | None:
    """Check ``output_dir`` before a run and return the checkpoint to resume from (None: start at step 0). Changes
    nothing: with ``overwrite``, the caller clears the directory (:func:`clear`).

    Args:
        output_dir: the run directory.
        resume (default None): ``"auto"`` (the last complete checkpoint of ``output_dir``), a checkpoint folder or a
            run directory (its last complete checkpoint); None starts from step 0.
        overwrite (bool, default False): a directory that holds a run may be started again from step 0.

    Raises:
        RunDirectoryError: a process on this machine is still training into ``output_dir`` (whatever the flags
            say); ``output_dir`` holds a run and neither ``resume`` nor ``overwrite`` says what to do with it;
            ``resume`` finds no complete checkpoint; ``resume`` and ``overwrite`` are both given.
    """
    output_dir = Path(output_dir)
    if resume is not None and overwrite:
        raise RunDirectoryError("--resume continues the run in the output directory and --overwrite starts it again: "
                                "give one of them")
    found = inspect(output_dir)
    if found.in_use:
        raise RunDirectoryError(f"{output_dir} is in use: a run is training into it now (pid {found.process['pid']}, "
                                f"{found.describe() or 'no step logged yet'}); wait for it to end or stop it, or "
                                "choose another --output-dir")
    if resume is not None:
        checkpoint = resolve_checkpoint(output_dir, resume)
        if found.holds_a_run and Path(checkpoint).resolve().parent != output_dir.resolve():
            raise RunDirectoryError(f"{output_dir} holds another run ({found.describe()}) than the one {checkpoint} "
                                    "belongs to: resume into another --output-dir, or move that run away first")
        return checkpoint
    if found.holds_a_run and not overwrite:
        ways = "start it again with --overwrite, or choose another --output-dir"
        if any(not checkpoint_problems(path) for path in found.checkpoints):
            ways = f"continue it with --resume, {ways}"
        raise RunDirectoryError(f"{output_dir} already holds a run ({found.describe()}): {ways}")
    return None


def clear(output_dir: str | Path) -> None:
    """Delete what a run wrote into ``output_dir``: its ``checkpoint-N`` folders, hf_optim's files and the final
    model's ``training_args.bin``. Other files (the saved model's weights and tokenizer) are left for the new run to
    overwrite; nothing else in the directory is touched."""
    output_dir = Path(output_dir)
    for checkpoint in checkpoints(output_dir):
        shutil.rmtree(checkpoint)
    for name in (*monitor_files(), FINAL_MODEL_MARKER):
        (output_dir / name).unlink(missing_ok=True)


def remove_failed_attempt(output_dir: str | Path, created: bool) -> None:
    """After a run that failed before it logged anything: remove ``output_dir`` if this attempt created it and it
    holds only hf_optim's own files, so no folder with a lone ``recipe.yaml`` is left behind."""
    output_dir = Path(output_dir)
    if not created or not output_dir.is_dir() or inspect(output_dir).holds_a_run:
        return
    if all(entry.name in monitor_files() for entry in output_dir.iterdir()):
        shutil.rmtree(output_dir)


def remove_partial_checkpoint(output_dir: str | Path, step: int) -> bool:
    """Remove ``output_dir/checkpoint-<step>`` if it is incomplete (a save cut short); True when it was."""
    path = Path(output_dir) / f"checkpoint-{step}"
    if path.is_dir() and checkpoint_problems(path):
        shutil.rmtree(path)
        return True
    return False
