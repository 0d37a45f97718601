"""Commands and code the README gives, run as written (issue 23: the SFTConfig snippet failed on a CPU machine, and
no README command trained `trl sft` on the bundled tiny model and data)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def block_after(marker: str, language: str) -> str:
    """The first ```language block after the line holding ``marker``."""
    start = README.index(marker)
    match = re.compile(rf"```{language}\n(.*?)```", re.S).search(README, start)
    assert match, f"no {language} block after {marker!r}"
    return match.group(1)


def test_sftconfig_snippet_runs_on_this_machine(tmp_path):
    """The "With the Hugging Face Trainer and TRL" snippet, in a fresh process (import order matters there)."""
    code = block_after("## With the Hugging Face Trainer and TRL", "python")
    assert "bf16=False" in code  # what makes it run on a CPU-only machine (TRL defaults to bf16=True)
    check = code + "\nassert type(config).__name__ == 'SFTConfig' and str(config.optim.value) == 'lamb_8bit'\n"
    result = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-3000:]


def test_trl_sft_command_on_the_tiny_model(tmp_path):
    """`hf-optim run -- trl sft` on `python -m hf_optim.tiny model` / `data`, as the README writes it (2 steps)."""
    command = block_after("On the builtin tiny model and the bundled chat data", "bash").replace("\\\n", " ")
    assert command.count("hf-optim run -- trl sft") == 1 and "--max_steps 20" in command
    command = command.replace("--max_steps 20", "--max_steps 2")
    # this checkout's interpreter and package, wherever the console scripts point
    command = command.replace("hf-optim run", f"{shlex.quote(sys.executable)} -m hf_optim.cli run")
    command = command.replace("$(python -m", f"$({shlex.quote(sys.executable)} -m")
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT),
                   "HF_OPTIM_CACHE": str(tmp_path / "cache")}  # a fresh machine: the tiny model is written
    result = subprocess.run(["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True, timeout=900,
                            env=environment)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "[hf_optim] optim='lamb_8bit' -> hf_optim.LAMB8bit" in output  # the training process built hf_optim's
    assert "Model saved to runs/trl-tiny" in output
    assert (tmp_path / "runs" / "trl-tiny" / "model.safetensors").is_file()
