"""A folder named ``hf_optim`` in the way of ``import hf_optim`` never lets the Trainer build another library's
optimizer without a word (issue 43).

A new user cloned the repository as ``hf_optim/`` and ran an SFTTrainer script beside it: the checkout (no
``__init__.py`` at its top) imported as an empty namespace package, ``import hf_optim`` did nothing, and the Trainer
built bitsandbytes' AdamW for ``optim="adamw_8bit"``, silently. (Setuptools' editable install finds the package with
a finder that Python asks only after ``sys.path``, so a namespace folder on the path wins.) Each test lays out the
folders as the user had them and runs a real Python process with the editable install the suite runs under:

- a script beside a checkout named ``hf_optim`` (the repository itself, linked under that name): the top-level
  ``__init__.py`` of the repository imports the real package in its place;
- ``hf-optim run`` with a bare folder named ``hf_optim`` on ``PYTHONPATH``: it and its start-up hook (in the
  processes it starts) import the real package and say which folder shadowed it. (A plain ``python train.py`` with
  such a folder beside it or on ``PYTHONPATH`` still gets the namespace package: nothing of hf_optim runs there to
  see it; troubleshooting.md says how to tell.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # two processes that import transformers

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = textwrap.dedent("""
    import torch
    import hf_optim
    from transformers import Trainer, TrainingArguments

    print("hf_optim:", getattr(hf_optim, "__file__", None))
    args = TrainingArguments(output_dir="out", optim="adamw_8bit", use_cpu=True, report_to="none")
    optimizer = Trainer(model=torch.nn.Linear(64, 64), args=args).create_optimizer()
    print("optimizer:", type(optimizer).__module__, type(optimizer).__name__)
""")
EXPECTED = "optimizer: hf_optim.optim.adamw AdamW8bit"


def environment(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # as in a user's shell
    return {**env, "HF_HUB_OFFLINE": "1", **extra}


def package_file(output: str) -> Path:
    line = next(line for line in output.splitlines() if line.startswith("hf_optim: "))
    return Path(line.removeprefix("hf_optim: "))


def test_a_script_beside_a_checkout_named_hf_optim_gets_hf_optims_optimizer(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "hf_optim").symlink_to(ROOT, target_is_directory=True)  # `git clone ... hf_optim`
    (work / "train.py").write_text(SCRIPT)
    result = subprocess.run([sys.executable, "train.py"], cwd=work, env=environment(), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert EXPECTED in result.stdout, result.stdout + result.stderr[-3000:]
    assert "[hf_optim] optim='adamw_8bit' -> hf_optim.AdamW8bit" in result.stderr
    assert package_file(result.stdout).name == "__init__.py"  # a real package, not a namespace
    assert package_file(result.stdout).parent.name == "hf_optim"


def test_hf_optim_run_imports_the_package_past_a_folder_named_hf_optim_and_says_so(tmp_path):
    shadow = tmp_path / "elsewhere"
    (shadow / "hf_optim").mkdir(parents=True)  # a folder of the user's, no __init__.py
    (tmp_path / "train.py").write_text(SCRIPT)
    plain = subprocess.run([sys.executable, "-c", "import hf_optim; print(hf_optim.__file__)"], cwd=tmp_path,
                           env=environment(PYTHONPATH=str(shadow)), capture_output=True, text=True, timeout=60)
    # without hf-optim run, Python itself picks the namespace folder (the layout really shadows the package; that
    # case is answered in troubleshooting.md)
    assert plain.stdout.strip() == "None", plain.stdout + plain.stderr[-2000:]
    # `hf-optim run` imports hf_optim in its own process and, through its start-up hook, in the processes it starts:
    # here a `python -c` in-process that starts the training script as a child
    start_child = "import subprocess, sys; subprocess.run([sys.executable, 'train.py'], check=True)"
    result = subprocess.run([sys.executable, "-m", "hf_optim.run", "--", sys.executable, "-c", start_child],
                            cwd=tmp_path, env=environment(PYTHONPATH=str(shadow)), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert EXPECTED in result.stdout, result.stdout + result.stderr[-3000:]
    note = f"[hf_optim] note: {shadow / 'hf_optim'} (a folder named hf_optim without __init__.py) shadows"
    assert result.stderr.count(note) == 2, result.stderr[-3000:]  # hf-optim run's process, then the child's hook
