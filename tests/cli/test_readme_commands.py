"""Commands and code the README (and the Trainer guide) give a new user, run as written: the test command is CI's, the
`SFTConfig` snippet prints what the README shows, and `hf-optim run -- trl sft` trains the bundled tiny model."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
TRAINER_GUIDE = (ROOT / "docs" / "guide" / "trainer.md").read_text()


def block_after(text: str, marker: str, language: str) -> str:
    """The first ```language block after the line holding ``marker``."""
    start = text.index(marker)
    match = re.compile(rf"```{language}\n(.*?)```", re.S).search(text, start)
    assert match, f"no {language} block after {marker!r}"
    return match.group(1)


def test_the_readme_test_command_is_what_ci_runs():
    """"Two commands for a new user": the second is .ci/run's command, character for character."""
    ci_command = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci_command.startswith("pip install torch==")
    assert block_after(README, "Run the tests", "bash").strip() == ci_command
    main_job = block_after(README, "Run the main job", "bash").strip()
    # the same torch pin first, then the train extra and the quickstart on the embedded default
    assert main_job == ci_command.split(" && ")[0] + ' && pip install -e ".[train]" && hf-optim train quickstart'


def test_sftconfig_snippet_prints_what_the_readme_shows(tmp_path):
    """The "Name it in the Trainer or TRL" snippet in a fresh process (import order matters there): its output,
    the hf_optim log line and the class name, is the README's text block after it."""
    code = block_after(README, "**2. Name it in the Trainer or TRL.**", "python")
    assert "bf16=False" in code  # what makes it run on a CPU-only machine (TRL defaults to bf16=True)
    after = README.index(code) + len(code) + len("```")
    shown = re.compile(r"```\n(.*?)```", re.S).search(README, after).group(1)  # the plain block after the snippet
    # a user's environment: conftest turns compilation off for the suite, which the log line would show
    environment = {key: value for key, value in os.environ.items()
                   if key not in ("HF_OPTIM_COMPILE", "HF_OPTIM_BACKEND", "TRITON_INTERPRET")}
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env={**environment, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-3000:]
    # Other packages' Python warnings depend on their versions (transformers 5.2x warns about TRL's
    # gradient_checkpointing default): each is a "path:line: XWarning: ..." line and its indented source line.
    # Anything else, hf_optim's own warnings included, must be what the README shows.
    printed, lines = [], result.stderr.splitlines()
    while lines:
        line = lines.pop(0)
        warning = re.match(r"(\S+\.py):\d+: \w*Warning: ", line)
        if warning and "hf_optim" not in Path(warning.group(1)).parts:
            if lines and lines[0].startswith("  "):
                lines.pop(0)
        elif line.strip():
            printed.append(line)
    printed += [line for line in result.stdout.splitlines() if line.strip()]
    assert printed == shown.strip().splitlines(), (printed, shown)


def test_trl_sft_command_on_the_tiny_model(tmp_path):
    """`hf-optim run -- trl sft` on `python -m hf_optim.tiny model` / `data`, as the Trainer guide writes it (2
    steps)."""
    command = block_after(TRAINER_GUIDE, "On the builtin tiny model and the bundled chat data", "bash")
    command = command.replace("\\\n", " ")
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
