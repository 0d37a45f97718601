"""A run's ``summary.json`` says how it ended, and the readers tell a running run from one whose process is gone.

Issue 43: a run killed mid-way left ``"status": "running"`` for ever. Each way of ending is driven for real:

- SIGTERM to an ``hf-optim train`` process: ``"killed"``, the signal's name, exit status 143, one line that says how
  to go on (the monitor's ``record_signal``);
- SIGKILL, which no process can catch, to a training script: the summary still says ``running``, and every reader
  (``load_run``, ``hf-optim plot``, ``compare``, a rerun of ``hf-optim train``) sees that its process is gone and
  says ``died``; while the process runs, a rerun into its directory is refused even with ``--overwrite``;
- an uncaught exception in a training script: ``"failed"`` with the error's first line (recorded at exit);
- an exception inside ``hf-optim train``: ``"failed"`` too, recorded before the error propagates.

Ctrl-C (``"interrupted"``) is covered by ``test_resume_cli.py``. The subprocesses run the eager CPU path (conftest's
``HF_OPTIM_COMPILE=0``); the ``hf-optim train`` ones the quickstart in smoke mode on 64-token rows.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hf_optim import cli
from hf_optim.monitor.runfiles import load_run
from hf_optim.recipes import rundir

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["quickstart", "--smoke", "training.max_steps=500", "training.save_strategy=steps", "training.save_steps=2",
        "training.max_length=64"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "COLUMNS": "200"}

# A training script as a user writes one: the Trainer with hf_optim's monitor, on the builtin tiny model. MODE
# "endless" trains until it is killed; "raise" raises from a callback at step 2 and lets the exception end it.
SCRIPT = textwrap.dedent("""
    import sys
    from datasets import Dataset
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainerCallback, TrainingArguments
    from hf_optim.monitor import TrainingMonitor
    from hf_optim.tiny import tiny_llama, tiny_texts, tiny_tokenizer

    run_dir, mode = sys.argv[1], sys.argv[2]

    class Boom(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if mode == "raise" and state.global_step == 2:
                raise RuntimeError("boom at step 2\\nsecond line")

    tokenizer = tiny_tokenizer()
    data = Dataset.from_dict({"input_ids": tokenizer(tiny_texts(16), truncation=True, max_length=32)["input_ids"]})
    args = TrainingArguments(output_dir=run_dir, max_steps=100000, per_device_train_batch_size=2, logging_steps=1,
                             report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
                             dataloader_num_workers=0)
    Trainer(model=tiny_llama(layers=1), args=args, train_dataset=data,
            data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
            callbacks=[TrainingMonitor(run_dir, plots=False), Boom()]).train()
""")


def default_signals() -> None:
    """``preexec_fn``: SIGINT and SIGTERM at their default disposition, as a shell starts a command (a pytest worker
    may have inherited either ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def logged_steps(run_dir: Path) -> list[int]:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return []
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.endswith("}")]


def wait_for_step(process: subprocess.Popen, run_dir: Path, step: int, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while max(logged_steps(run_dir), default=0) < step:
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"no step {step} logged in {timeout} s"
        time.sleep(0.05)


def start(command: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(command, cwd=cwd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=default_signals)


@pytest.mark.slow
def test_sigterm_records_killed_says_how_to_go_on_and_a_live_run_is_not_written_over(tmp_path, capsys):
    run_dir = tmp_path / "run"
    process = start([sys.executable, "-m", "hf_optim.cli", "train", *ARGS, "--output-dir", str(run_dir)], tmp_path)
    try:
        wait_for_step(process, run_dir, 3)  # checkpoint-2 is complete by then
        # while it trains, nothing may start again in its directory, whatever the flags say
        with pytest.raises(rundir.RunDirectoryError, match=f"{run_dir} is in use: a run is training into it now "
                                                           f"\\(pid {process.pid}, "):
            rundir.prepare(run_dir, None, overwrite=True)
        assert cli.main(["train", *ARGS, "--output-dir", str(run_dir), "--overwrite"]) == 2
        assert "is in use" in capsys.readouterr().err
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "Traceback" not in err
    ended = summary(run_dir)
    step = ended["global_step"]
    assert (ended["status"], ended["signal"]) == ("killed", "SIGTERM")
    assert step == logged_steps(run_dir)[-1] >= 3 and ended["process"]["pid"] == process.pid
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"killed by SIGTERM at step {step}; resume with: hf-optim train "), last
    assert load_run(run_dir).status == "killed"
    assert cli.main(["plot", str(run_dir)]) == 0
    assert f"note: {run_dir}: killed by SIGTERM at step {step}" in capsys.readouterr().out
    assert cli.main(["train", *ARGS, "--output-dir", str(run_dir)]) == 2  # a rerun names how it ended
    assert "status killed" in capsys.readouterr().err


@pytest.mark.slow
def test_sigkill_leaves_running_and_every_reader_says_the_process_is_gone(tmp_path, capsys):
    run_dir = tmp_path / "run"
    process = start([sys.executable, "-c", SCRIPT, str(run_dir), "endless"], tmp_path)
    try:
        wait_for_step(process, run_dir, 2)
        assert load_run(run_dir).status == "running" and rundir.inspect(run_dir).in_use
        process.kill()  # SIGKILL: nothing in the process runs after it
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    written = summary(run_dir)
    assert written["status"] == "running" and written["process"]["pid"] == process.pid  # as the process left it
    assert load_run(run_dir).status == "died" and not rundir.inspect(run_dir).in_use

    assert cli.main(["plot", str(run_dir)]) == 0
    assert (f"note: {run_dir}: its process (pid {process.pid} on this host) is gone: it ended after step "
            f"{logged_steps(run_dir)[-1]} without recording how") in capsys.readouterr().out
    assert cli.main(["compare", str(run_dir), "--out", str(tmp_path / "cmp")]) == 0
    assert "| died |" in (tmp_path / "cmp" / "compare.md").read_text()
    capsys.readouterr()
    assert cli.main(["train", "quickstart", "--output-dir", str(run_dir)]) == 2
    assert "its process ended without recording how" in capsys.readouterr().err


def test_a_recorded_pid_that_now_belongs_to_another_process_is_not_the_run():
    from hf_optim.monitor.runfiles import effective_status, this_process

    mine = this_process()
    assert effective_status({"status": "running", "process": mine}) == "running"
    reused = dict(mine, started=mine["started"] - 3600)  # same pid, a process that started an hour earlier
    assert effective_status({"status": "running", "process": reused}) == "died"
    elsewhere = dict(mine, host=mine["host"] + "-other")
    assert effective_status({"status": "running", "process": elsewhere}) == "running"  # cannot check: as written


@pytest.mark.slow
def test_an_uncaught_exception_in_a_training_script_is_recorded_as_failed(tmp_path):
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(run_dir), "raise"], cwd=tmp_path, env=ENV,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1 and "RuntimeError: boom at step 2" in result.stderr
    ended = summary(run_dir)
    assert ended["status"] == "failed" and ended["global_step"] == 2
    assert ended["error"] == {"type": "RuntimeError", "message": "boom at step 2"}


@pytest.mark.slow
def test_an_exception_inside_hf_optim_train_is_recorded_as_failed(tmp_path, monkeypatch):
    from hf_optim.monitor.callback import TrainingMonitor

    step_end = TrainingMonitor.on_step_end

    def failing(self, args, state, control, **kwargs):
        step_end(self, args, state, control, **kwargs)
        if state.global_step == 2:
            raise ValueError("broken at step 2")

    monkeypatch.setattr(TrainingMonitor, "on_step_end", failing)
    run_dir = tmp_path / "run"
    with pytest.raises(ValueError, match="broken at step 2"):  # a bug keeps its traceback
        cli.main(["train", "quickstart", "--smoke", "training.max_steps=4", "training.max_length=64",
                  "--output-dir", str(run_dir)])
    ended = summary(run_dir)
    assert (ended["status"], ended["global_step"]) == ("failed", 2)
    assert ended["error"] == {"type": "ValueError", "message": "broken at step 2"}
    assert (run_dir / "loss.png").stat().st_size > 0  # drawn from the steps logged before the failure
