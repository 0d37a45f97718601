"""``hf-optim train`` never loses a run: Ctrl-C stops with a checkpoint and says how to go on, ``--resume`` continues
bit for bit, and a directory that holds a run is not written over without ``--resume`` or ``--overwrite``.

The interrupted run is a real ``hf-optim train`` process sent SIGINT once ``metrics.jsonl`` shows step
``INTERRUPT_AT``; the uninterrupted run it is compared with trains in this process meanwhile (the two overlap, so the
file stays within a minute on two cores). Both use the eager CPU path (conftest's ``HF_OPTIM_COMPILE=0``).
"""

from __future__ import annotations

import importlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml
from helpers import sigint_as_in_a_terminal
from safetensors.torch import load_file

from hf_optim import cli
from hf_optim.recipes import api, rundir
from hf_optim.recipes.interrupt import EXIT_STATUS, GracefulStop

ROOT = Path(__file__).resolve().parents[2]
STEPS, SAVE_STEPS, INTERRUPT_AT = 6, 2, 2
# The quickstart (QLoRA, paged_adamw_8bit: 8-bit state for every LoRA tensor) in smoke mode, short sequences.
ARGS = ["quickstart", "--smoke", f"training.max_steps={STEPS}", "training.save_strategy=steps",
        f"training.save_steps={SAVE_STEPS}", "training.max_length=64"]
PLOTS = ("loss.png", "memory.png", "dashboard.png")


def train_records(run_dir: Path) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def checkpoint_names(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.glob("checkpoint-*"))


def interrupt_when_logged(process: subprocess.Popen, run_dir: Path, step: int, timeout: float = 400.0) -> None:
    """Send SIGINT to ``process`` once ``run_dir/metrics.jsonl`` holds a record of ``step`` (no callback inside it)."""
    deadline = time.monotonic() + timeout
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline and process.poll() is None:
        if metrics.exists() and any(json.loads(line)["step"] >= step for line in metrics.read_text().splitlines()
                                    if line.endswith("}")):
            process.send_signal(signal.SIGINT)
            return
        time.sleep(0.05)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted run and an interrupted one (what it printed and left before it was resumed)."""
    root = tmp_path_factory.mktemp("runs")
    interrupted, straight = root / "interrupted", root / "straight"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    process = subprocess.Popen([sys.executable, "-m", "hf_optim.cli", "train", *ARGS, "--output-dir",
                                str(interrupted)], cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, preexec_fn=sigint_as_in_a_terminal)
    watcher = threading.Thread(target=interrupt_when_logged, args=(process, interrupted, INTERRUPT_AT))
    watcher.start()
    try:
        assert cli.main(["train", *ARGS, "--output-dir", str(straight)]) == 0
        watcher.join()
        out, err = process.communicate(timeout=400)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    after_interrupt = {"returncode": process.returncode, "stdout": out, "stderr": err,
                       "summary": summary(interrupted), "records": train_records(interrupted),
                       "checkpoints": checkpoint_names(interrupted),
                       "plots": {name: (interrupted / name).stat().st_size for name in PLOTS
                                 if (interrupted / name).exists()}}
    return {"straight": straight, "interrupted": interrupted, "after_interrupt": after_interrupt}


@pytest.mark.slow
def test_ctrl_c_prints_one_line_exits_130_and_records_the_real_step(runs):
    seen = runs["after_interrupt"]
    assert seen["returncode"] == EXIT_STATUS, seen["stderr"][-3000:]
    assert "Traceback" not in seen["stderr"] and "KeyboardInterrupt" not in seen["stderr"]
    final = [line for line in seen["stderr"].splitlines() if line.startswith("interrupted")]
    logged = [r["step"] for r in seen["records"]]
    stopped = logged[-1]
    assert INTERRUPT_AT <= stopped < STEPS and logged == list(range(1, stopped + 1))
    assert final == [f"interrupted at step {stopped}; resume with: hf-optim train "
                     f"{shlex.join(ARGS)} --output-dir {runs['interrupted']} --resume"]
    # the first Ctrl-C finishes the step under way and saves it: a checkpoint of the very step it stopped at
    assert f"checkpoint-{stopped}" in seen["checkpoints"]
    assert seen["summary"]["status"] == "interrupted" and seen["summary"]["global_step"] == stopped
    assert seen["summary"]["final_loss"] == seen["records"][-1]["loss"]
    assert "interrupted" in seen["summary"]["phases"]
    assert set(seen["plots"]) == set(PLOTS) and all(size > 0 for size in seen["plots"].values())


@pytest.mark.slow
def test_resume_with_the_printed_command_ends_bit_for_bit_as_the_uninterrupted_run(runs, capsys):
    line = next(line for line in runs["after_interrupt"]["stderr"].splitlines() if line.startswith("interrupted"))
    command = shlex.split(line.split("resume with: ", 1)[1])
    assert command[:2] == ["hf-optim", "train"] and command[-1] == "--resume"
    assert cli.main(command[1:]) == 0
    straight, resumed = runs["straight"], runs["interrupted"]
    stopped = runs["after_interrupt"]["records"][-1]["step"]
    # the loss printed is the mean of the whole run's 60 logged steps, those before the resume included: the
    # uninterrupted run's mean (the Trainer's own covers only the steps after the resume)
    from hf_optim.monitor.compare import logged_loss_mean

    whole = logged_loss_mean(runs["straight"])
    assert f"mean of all logged steps, those before checkpoint-{stopped} included) {whole:.4f}" in \
        capsys.readouterr().out

    # the same losses, grad norms and learning rates, every step logged once, in one metrics.jsonl
    expected = [(r["step"], r["loss"], r["grad_norm"], r["learning_rate"]) for r in train_records(straight)]
    records = train_records(resumed)
    assert [(r["step"], r["loss"], r["grad_norm"], r["learning_rate"]) for r in records] == expected
    assert records[:stopped] == runs["after_interrupt"]["records"]  # appended to, not replaced
    # time and tokens go on from where the interrupted process left them
    assert all(a["time_s"] <= b["time_s"] and a["tokens_seen"] < b["tokens_seen"] for a, b in zip(records, records[1:]))
    assert summary(resumed)["tokens_seen"] == records[-1]["tokens_seen"] == train_records(straight)[-1]["tokens_seen"]
    state = summary(resumed)
    assert state["status"] == "ok" and state["global_step"] == STEPS and state["resumed_at_step"] == stopped
    assert state["final_loss"] == summary(straight)["final_loss"]
    assert logged_loss_mean(resumed) == logged_loss_mean(straight)  # what the sweep table shows for each

    # the final checkpoint: adapter weights, 8-bit optimizer state, scheduler, bit for bit
    final = f"checkpoint-{STEPS}"
    weights_a = load_file(straight / final / "adapter_model.safetensors")
    weights_b = load_file(resumed / final / "adapter_model.safetensors")
    assert weights_a.keys() == weights_b.keys()
    for key, value in weights_a.items():
        assert value.dtype == weights_b[key].dtype == torch.bfloat16 and torch.equal(value, weights_b[key]), key
    for name in ("optimizer.pt", "scheduler.pt"):
        a = torch.load(straight / final / name, weights_only=True)
        b = torch.load(resumed / final / name, weights_only=True)
        assert_same(a, b, name)
    optimizer = torch.load(resumed / final / "optimizer.pt", weights_only=True)
    dtypes = {v.dtype for s in optimizer["state"].values() for q in s.values() if isinstance(q, dict)
              for v in q.values() if isinstance(v, torch.Tensor) and v.numel() > 1}
    assert torch.uint8 in dtypes  # real 8-bit state was saved and resumed
    assert (resumed / "adapter_model.safetensors").is_file() and set(PLOTS) <= {p.name for p in resumed.iterdir()}


def assert_same(a, b, where: str) -> None:
    """Nested state dicts equal: tensors bit for bit with their dtypes, everything else by value."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}/{i}")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert a == b, where


@pytest.mark.slow
def test_resume_from_checkpoint_override_continues_an_earlier_checkpoint(runs, tmp_path):
    straight = tmp_path / "straight"
    shutil.copytree(runs["straight"], straight)
    expected = train_records(runs["straight"])
    checkpoint = straight / "checkpoint-4"
    assert cli.main(["train", *ARGS, "--output-dir", str(straight),
                     f"training.resume_from_checkpoint={checkpoint}"]) == 0
    records = train_records(straight)
    assert [(r["step"], r["loss"]) for r in records] == [(r["step"], r["loss"]) for r in expected]  # 5, 6 redone
    assert "resume_from_checkpoint" not in yaml.safe_load((straight / "recipe.yaml").read_text())["training"]
    phases = summary(straight)["phases"]
    assert phases["resumed"]["step"] == 4 and phases["train_begin"]["step"] == 0 and "end_at_6" not in phases


@pytest.mark.slow
def test_a_directory_that_holds_a_run_is_refused_in_one_line_and_overwrite_starts_again(runs, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(runs["straight"], run_dir)
    assert cli.main(["train", *ARGS, "--output-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"error: {run_dir} already holds a run (checkpoint-2 .. checkpoint-{STEPS}, {STEPS} logged steps, finished): "
        "continue it with --resume, start it again with --overwrite, or choose another --output-dir"]
    assert checkpoint_names(run_dir) == checkpoint_names(runs["straight"])  # untouched
    assert cli.main(["train", *ARGS, "--output-dir", str(run_dir), "--overwrite", "--resume"]) == 2
    assert "give one of them" in capsys.readouterr().err

    assert cli.main(["train", "quickstart", "--smoke", "training.max_steps=1", "--output-dir", str(run_dir),
                     "--overwrite"]) == 0
    assert checkpoint_names(run_dir) == []  # the old run's checkpoints are gone: --resume cannot pick them up
    assert [r["step"] for r in train_records(run_dir)] == [1] and summary(run_dir)["status"] == "ok"


def test_resume_without_a_checkpoint_and_a_sweep_resume_path_are_one_line_errors(tmp_path, capsys):
    assert cli.main(["train", *ARGS, "--output-dir", str(tmp_path / "new"), "--resume"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: --resume: {tmp_path / 'new'} has no complete checkpoint to resume from; start a new run without "
        "--resume"]
    assert not (tmp_path / "new").exists()
    assert cli.main(["train", *ARGS, "--output-dir", str(tmp_path / "new"), "--resume", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.startswith(f"error: --resume {tmp_path / 'nope'}: no such checkpoint directory")
    assert cli.main(["train", *ARGS, "--sweep", "training.optim=adamw_torch,lion_8bit", "--resume",
                     str(tmp_path)]) == 2
    assert "a sweep resumes each of its runs from its own directory" in capsys.readouterr().err


def fake_checkpoint(run_dir: Path, step: int) -> None:
    """A checkpoint folder complete as far as :func:`hf_optim.checkpoints.checkpoint_problems` can tell."""
    folder = run_dir / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))


def test_what_counts_as_a_run(tmp_path):
    leftover = tmp_path / "leftover"  # what an attempt that failed before its first step left
    leftover.mkdir()
    (leftover / "recipe.yaml").write_text("model: {}\n")
    (leftover / "summary.json").write_text(json.dumps({"status": "running", "global_step": 0}))
    (leftover / "metrics.jsonl").write_text("")
    assert not rundir.inspect(leftover).holds_a_run and rundir.prepare(leftover) is None

    logged = tmp_path / "logged"  # interrupted before its first checkpoint: its logs are a run
    logged.mkdir()
    (logged / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 1, "loss": 1.0}) + "\n")
    with pytest.raises(rundir.RunDirectoryError, match="1 logged step\\): start it again with --overwrite, or"):
        rundir.prepare(logged)
    with pytest.raises(rundir.RunDirectoryError, match="has no complete checkpoint.*start it again with --overwrite"):
        rundir.prepare(logged, resume="auto")

    checkpointed = tmp_path / "checkpointed"
    fake_checkpoint(checkpointed, 3)
    (checkpointed / "checkpoint-5").mkdir()  # cut short: no trainer_state.json
    assert rundir.prepare(checkpointed, resume="auto") == str(checkpointed / "checkpoint-3")
    assert rundir.prepare(tmp_path / "elsewhere", resume=str(checkpointed)) == str(checkpointed / "checkpoint-3")
    with pytest.raises(rundir.RunDirectoryError, match="holds another run"):
        rundir.prepare(logged, resume=str(checkpointed / "checkpoint-3"))


def test_a_run_that_fails_before_training_leaves_no_folder(tmp_path, monkeypatch):
    train_module = importlib.import_module("hf_optim.recipes.train")  # the package's `train` is the function

    def broken(recipe):
        raise RuntimeError("simulated failure while loading the model")

    monkeypatch.setattr(train_module, "build_model", broken)
    with pytest.raises(RuntimeError, match="simulated failure"):
        api.train("quickstart", ["training.max_steps=1"], smoke=True, output_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()
    (tmp_path / "mine").mkdir()  # a directory the user made is left alone
    with pytest.raises(RuntimeError, match="simulated failure"):
        api.train("quickstart", ["training.max_steps=1"], smoke=True, output_dir=tmp_path / "mine")
    assert (tmp_path / "mine").is_dir()


def test_a_resumed_sweep_keeps_finished_runs_resumes_checkpointed_ones_and_starts_the_rest(tmp_path):
    finished, checkpointed, logged, empty = (tmp_path / name for name in ("a", "b", "c", "d"))
    finished.mkdir()
    (finished / "summary.json").write_text(json.dumps({
        "status": "ok", "global_step": 6, "train_loss_run_mean": 4.5,
        "optimizer": {"module": "hf_optim.optim.adamw", "name": "AdamW8bit", "wrapper": None}}))
    fake_checkpoint(checkpointed, 2)
    logged.mkdir()
    (logged / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 1, "loss": 1.0}) + "\n")
    plans = {out.name: api._sweep_member(out, resume=True, overwrite=False)
             for out in (finished, checkpointed, logged, empty)}
    kept = plans["a"][1]
    assert (kept.status, kept.optimizer, kept.train_loss) == ("ok", "hf_optim.AdamW8bit", 4.5)
    assert plans["b"][1:] == (None, "auto", False)
    assert plans["c"][1:] == (None, None, True)  # nothing to resume from: it starts again
    assert plans["d"][1:] == (None, None, True)
    with pytest.raises(rundir.RunDirectoryError, match="already holds a run"):
        api._sweep_member(logged, resume=False, overwrite=False)


class _State:
    def __init__(self, step: int, max_steps: int = 10):
        self.global_step, self.max_steps = step, max_steps


class _Control:
    should_training_stop = should_save = False


def test_first_ctrl_c_stops_after_the_step_with_a_checkpoint_second_stops_now():
    stop = GracefulStop()
    previous = signal.getsignal(signal.SIGINT)
    with stop.handling_sigint():
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested and not stop.forced
        control = _Control()
        stop.on_step_end(None, _State(3), control)
        assert control.should_training_stop and control.should_save and stop.stopped_at == 3
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs between bytecodes of the main thread
        assert stop.forced
    assert signal.getsignal(signal.SIGINT) is previous
    late = GracefulStop()  # a stop asked for at the last step changes nothing: the run finishes
    late.requested = True
    control = _Control()
    late.on_step_end(None, _State(10), control)
    assert late.stopped_at is None and not control.should_save


@pytest.mark.slow
def test_third_ctrl_c_exits_at_once_with_status_130(tmp_path):
    script = textwrap.dedent("""
        import os, signal, time
        from hf_optim.recipes.interrupt import GracefulStop
        stop = GracefulStop()
        with stop.handling_sigint():
            os.kill(os.getpid(), signal.SIGINT)
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)
            except KeyboardInterrupt:
                print("forced", flush=True)
            os.kill(os.getpid(), signal.SIGINT)  # while the files are written
            time.sleep(5)
            print("still running")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == EXIT_STATUS, result.stderr[-2000:]
    assert result.stdout.splitlines() == ["forced"]
    assert result.stderr.splitlines()[-1] == "interrupted at step 0" and "Traceback" not in result.stderr
