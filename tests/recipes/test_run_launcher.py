"""``hf-optim run`` / ``python -m hf_optim.run``: TRL's real ``trl sft`` command line and any launcher use hf_optim
with no code edit (issue 16).

``trl sft`` parses its arguments in the launcher's process, then ``accelerate launch`` runs TRL's training script as
a new Python process: the tests look into that process with a probe (a ``sitecustomize`` that hf_optim's start-up
hook must run, as it runs any ``sitecustomize`` it shadows) that records the optimizer and its state dtypes through
torch's global optimizer step hook.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hf_optim import cli
from hf_optim import run as launcher
from hf_optim.integrations.names import OPTIMIZER_NAMES
from hf_optim.tiny import CHAT_FILE, bundled_tokenizer, save_builtin_model

pytestmark = pytest.mark.slow  # subprocesses that import TRL: several seconds each

ROOT = Path(__file__).resolve().parents[2]

PROBE = '''\
"""Test probe: after every optimizer step, record the optimizer's class and each parameter's state dtypes."""
import json
import os

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook


def _record(optimizer, args, kwargs):
    params = {}
    for param, state in optimizer.state.items():
        per_element = sorted({str(v.dtype).removeprefix("torch.") for v in state.values()
                              if isinstance(v, torch.Tensor) and v.numel() >= param.numel() > 1})
        params[str(len(params))] = {"numel": param.numel(), "dtypes": per_element}
    cls = type(optimizer)
    with open(os.environ["HF_OPTIM_TEST_PROBE"], "w") as f:
        json.dump({"class": f"{cls.__module__}.{cls.__qualname__}", "params": params}, f)


register_optimizer_step_post_hook(_record)
'''


@pytest.fixture(scope="module")
def tiny_job(tmp_path_factory):
    """The builtin tiny model with its tokenizer (a directory ``trl sft`` loads by path) and the bundled chat data."""
    root = tmp_path_factory.mktemp("trl_cli")
    model = save_builtin_model(root / "model")
    bundled_tokenizer().save_pretrained(model)
    data = root / "data"
    data.mkdir()
    (data / CHAT_FILE.name).write_bytes(CHAT_FILE.read_bytes())
    probe = root / "probe"
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(PROBE)
    return root, model, data, probe


def _trl_sft_args(model: Path, data: Path, output_dir: Path, optim: str) -> list[str]:
    return ["sft", "--model_name_or_path", str(model), "--dataset_name", str(data), "--optim", optim,
            "--output_dir", str(output_dir), "--max_steps", "2", "--per_device_train_batch_size", "2",
            "--max_length", "64", "--learning_rate", "1e-3", "--weight_decay", "0.01", "--logging_steps", "1",
            "--save_strategy", "no", "--report_to", "none", "--use_cpu", "--bf16", "false",
            "--gradient_checkpointing", "false", "--dtype", "float32",
            # accelerate launch's own settings (trl sft passes them on), so it does not guess them
            "--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]


def _environment(probe: Path, record: Path) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_OPTIM_TEST_PROBE": str(record)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(probe), env.get("PYTHONPATH", "")) if p)
    return env


# The launcher's two spellings, and the plain console script as the control: without hf_optim, transformers'
# bitsandbytes names run bitsandbytes' classes and hf_optim's own names are refused.
CASES = {
    "hf-optim run -- trl": [sys.executable, "-m", "hf_optim.cli", "run", "--", "trl"],
    "python -m hf_optim.run trl": [sys.executable, "-m", "hf_optim.run", "trl"],
}


@pytest.mark.parametrize(("spelling", "optim"), [("hf-optim run -- trl", "lamb_8bit"),
                                                 ("python -m hf_optim.run trl", "paged_adamw_8bit")])
def test_trl_sft_command_line_trains_with_hf_optim_class_and_8bit_state(tiny_job, tmp_path, spelling, optim):
    _, model, data, probe = tiny_job
    record = tmp_path / "probe.json"
    result = subprocess.run([*CASES[spelling], *_trl_sft_args(model, data, tmp_path / "out", optim)], cwd=tmp_path,
                            env=_environment(probe, record), capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    cls = OPTIMIZER_NAMES[optim].cls
    assert f"[hf_optim] optim='{optim}' -> hf_optim.{cls.__name__}" in output
    seen = json.loads(record.read_text())  # written by the training process after its last step
    assert seen["class"] == f"{cls.__module__}.{cls.__qualname__}"
    params = list(seen["params"].values())
    big = [p for p in params if p["numel"] >= 4096]
    embedding_rows = [p for p in big if p["dtypes"] == ["float32"]]  # the Trainer keeps embeddings in 32-bit state
    assert len(embedding_rows) == 1, params
    assert len(big) > 10 and all(p["dtypes"] == ["uint8"] for p in big if p not in embedding_rows), params
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_plain_trl_sft_runs_bitsandbytes_without_the_launcher(tiny_job, tmp_path):
    """The control: the same command without the launcher trains bitsandbytes' class, so the probe tells them apart."""
    _, model, data, probe = tiny_job
    record = tmp_path / "probe.json"
    command = [sys.executable, "-c", "import sys; from trl.cli import main; sys.exit(main())"]
    result = subprocess.run([*command, *_trl_sft_args(model, data, tmp_path / "out", "paged_adamw_8bit")],
                            cwd=tmp_path, env=_environment(probe, record), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert json.loads(record.read_text())["class"].startswith("bitsandbytes.")


def test_trl_sft_help_lists_hf_optim_names(tmp_path):
    result = subprocess.run([sys.executable, "-m", "hf_optim.run", "trl", "sft", "--help"], cwd=tmp_path,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    choices = result.stdout.split("--optim", 1)[1].split("}", 1)[0]  # --optim {adamw_torch,...}
    for name in ("lamb_8bit", "paged_lamb_8bit", "adafactor_8bit", "paged_adamw_8bit", "adamw_torch"):
        assert name in choices.replace("\n", "").replace(" ", "").split("{", 1)[1].split(","), choices


def test_child_python_processes_import_hf_optim_and_run_the_shadowed_sitecustomize(tmp_path):
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "sitecustomize.py").write_text("import os\nos.environ['SHADOWED_SITECUSTOMIZE_RAN'] = '1'\n")
    script = tmp_path / "spawn.py"
    child = "import os, sys; print('hf_optim' in sys.modules, os.environ.get('SHADOWED_SITECUSTOMIZE_RAN'))"
    script.write_text(f"import subprocess, sys\nprint('parent', 'hf_optim' in sys.modules, flush=True)\n"
                      f"subprocess.run([sys.executable, '-c', {child!r}], check=True)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(probe), os.environ.get("PYTHONPATH")) if p)}
    result = subprocess.run([sys.executable, "-m", "hf_optim.run", "python", str(script)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["parent", "True", "True", "1"]


def test_help_and_errors(capsys):
    assert launcher.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "usage: hf-optim run" in out and "lamb_8bit" in out and "paged_adamw_8bit" in out
    assert cli.main(["run", "--help"]) == 0
    assert capsys.readouterr().out == out
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert re.search(r"^ +run +run a command \(trl sft, accelerate launch", capsys.readouterr().out, re.M)
    assert launcher.main([]) == 2
    assert launcher.main(["--", "trll", "sft"]) == 2
    assert "'trll' is not an installed console script, a Python file or -m MODULE; did you mean 'trl'" in \
        capsys.readouterr().err
    assert launcher.main(["python", "-u", "x.py"]) == 2
    assert "takes a Python file, -m MODULE or -c CODE" in capsys.readouterr().err


def test_resolve_forms(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    assert launcher.resolve([str(script), "--x"])[::2] == ("file", [str(script), "--x"])
    assert launcher.resolve(["python3", "-m", "trl.scripts.sft", "--optim", "lamb_8bit"]) == \
        ("module", "trl.scripts.sft", ["trl.scripts.sft", "--optim", "lamb_8bit"])
    assert launcher.resolve(["python", "-c", "print(1)", "a"]) == ("code", "print(1)", ["-c", "a"])
    kind, entry, argv = launcher.resolve(["trl", "sft"])
    assert kind == "entry_point" and entry.value == "trl.cli:main" and argv == ["trl", "sft"]
    env = {"PYTHONPATH": os.pathsep.join(["/a", str(launcher.HOOK_DIR), "/b"])}
    launcher.export_to_child_processes(env)
    assert env["PYTHONPATH"].split(os.pathsep) == [str(launcher.HOOK_DIR), "/a", "/b"]  # first, and once
