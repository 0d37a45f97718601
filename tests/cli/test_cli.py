"""The hf-optim CLI: every verb, every bundled recipe in smoke mode, the quickstart, a sweep with an OOM run.

Runs go through ``hf_optim.cli.main`` in-process (a fresh process spends ~15 s importing); one test starts a real
process.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import torch
import yaml

from hf_optim import cli
from hf_optim.recipes import api, bundled_names, load_recipe

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("verb", [None, "train", "validate", "ls", "cp", "plot", "compare", "optimizers"])
def test_help_on_every_verb(verb, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main([verb, "--help"] if verb else ["--help"])
    assert info.value.code == 0
    assert "usage: hf-optim" in capsys.readouterr().out


def test_entry_point_declared():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, function = scripts["hf-optim"].partition(":")
    assert (module, function) == ("hf_optim.cli", "main")


def test_real_process_validates_and_fails_on_a_bad_recipe(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {id: builtin:tiny-llama-3}\ndata: {path: builtin:tiny-chat}\npeft: {lora_rr: 8}\n")
    result = subprocess.run([sys.executable, "-m", "hf_optim.cli", "validate", str(bad)], cwd=ROOT,
                            capture_output=True, text=True, timeout=300,
                            env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 2, result.stderr
    assert f"{bad}: peft.lora_rr: unknown LoraConfig field; did you mean 'r'?" in result.stderr


def test_validate_prints_estimate(capsys):
    assert cli.main(["validate", "llama-3.1-8b-full", "training.optim=adamw_torch"]) == 0
    out = capsys.readouterr().out
    assert "ok recipes/llama-3.1-8b-full.yaml" in out or "llama-3.1-8b-full.yaml: keys, types" in out
    assert "16,060,522,496" in out and "32,121,044,992" in out  # bf16 weights; torch AdamW's bf16 state
    assert "8,030,261,248 trainable" in out and "bundled Llama 3.x architecture values" in out


def test_validate_reports_every_error(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {id: builtin:tiny-llama-3}\ndata: {path: builtin:tiny-chat}\n"
                   "training: {optim: lamb8bit, learning_rat: 1}\n")
    assert cli.main(["validate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "invalid recipe (2 problems)" in err
    assert f"{bad}: training.optim: unknown optimizer 'lamb8bit'; did you mean 'lamb_8bit'" in err
    assert f"{bad}: training.learning_rat: unknown SFTConfig field; did you mean 'learning_rate'?" in err


def test_ls_cp_optimizers(tmp_path, capsys, monkeypatch):
    assert cli.main(["ls"]) == 0
    out = capsys.readouterr().out
    for name in bundled_names():
        assert name in out
    assert cli.main(["cp", "llama-3.1-8b-qlora", str(tmp_path)]) == 0
    copied = tmp_path / "llama-3.1-8b-qlora.yaml"
    monkeypatch.chdir(tmp_path)  # the copy extends the bundled LoRA recipe by name, from anywhere
    assert load_recipe(copied).method == "qlora"
    capsys.readouterr()
    assert cli.main(["cp", "llama-3.1-8b-qlora", str(tmp_path)]) == 2  # never overwrites: one error line
    assert capsys.readouterr().err.splitlines() == [f"error: {copied} exists; not overwritten (give another "
                                                    "destination, or remove it first)"]
    assert cli.main(["cp", "llama-3.1-8b-qlroa", str(tmp_path)]) == 2
    capsys.readouterr()
    assert cli.main(["optimizers"]) == 0
    out = capsys.readouterr().out
    for name in ("paged_adamw_8bit", "lamb_8bit", "adafactor_8bit", "hf_optim.PagedLAMB8bit"):
        assert name in out


@pytest.mark.parametrize("name", bundled_names())
def test_every_bundled_recipe_runs_in_smoke_mode(name, tmp_path):
    out = tmp_path / "run"
    assert cli.main(["train", name, "--smoke", f"training.output_dir={out}"]) == 0
    written = yaml.safe_load((out / "recipe.yaml").read_text())
    original = load_recipe(name)
    assert (written["quantization"] is None) == (original.quantization is None)  # the method is kept
    assert written["peft"] == original.peft and written["training"]["optim"] == original.optim
    assert written["training"]["use_cpu"] is True
    assert json.loads((out / "summary.json").read_text())["status"] == "ok"
    assert (out / "metrics.jsonl").stat().st_size > 0
    # the resolved recipe reruns the same job
    assert load_recipe(out / "recipe.yaml").to_dict() == written


def test_quickstart_keeps_real_8bit_state_and_writes_its_files(tmp_path):
    result = api.train("quickstart", ["training.max_steps=4", f"training.output_dir={tmp_path}"])
    assert result.status == "ok" and result.optimizer == "hf_optim.PagedAdamW8bit"
    assert result.train_loss is not None and result.train_loss == result.train_loss  # finite
    # every trainable tensor is a LoRA matrix of >= 4096 elements: all of them keep uint8 state
    assert len(result.state_dtypes) == 2 * 7 * 2  # 2 layers x 7 modules x (A, B)
    assert all(numel >= 4096 and dtype == "uint8" for numel, dtype in result.state_dtypes), result.state_dtypes
    assert result.state.by_dtype["uint8"] == 2 * sum(numel for numel, _ in result.state_dtypes)
    written = yaml.safe_load((tmp_path / "recipe.yaml").read_text())
    assert written["training"]["bf16"] is False  # auto resolved for the CPU
    for name in ("recipe.yaml", "metrics.jsonl", "summary.json", "loss.png", "memory.png", "dashboard.png",
                 "adapter_model.safetensors"):
        assert (tmp_path / name).stat().st_size > 0, name


def test_sweep_runs_each_value_and_keeps_going_after_oom(tmp_path, monkeypatch, capsys):
    from trl import SFTTrainer

    real_train = SFTTrainer.train

    def train_or_oom(self, *args, **kwargs):
        if self.args.optim == "adamw_8bit":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return real_train(self, *args, **kwargs)

    monkeypatch.setattr(SFTTrainer, "train", train_or_oom)
    code = cli.main(["train", "quickstart", "--smoke", "--sweep", "training.optim=adamw_torch,adamw_8bit,lion_8bit",
                     f"training.output_dir={tmp_path}", "training.max_steps=2"])
    assert code == 3  # one run ran out of memory
    statuses = {d: json.loads((tmp_path / d / "summary.json").read_text())["status"]
                for d in ("adamw_torch", "adamw_8bit", "lion_8bit")}
    assert statuses == {"adamw_torch": "ok", "adamw_8bit": "oom", "lion_8bit": "ok"}
    report = (tmp_path / "compare.md").read_text()
    oom_rows = [line for line in report.splitlines() if "adamw_8bit" in line]
    assert oom_rows and "oom" in oom_rows[0].lower()
    assert str(tmp_path / "compare.md") in capsys.readouterr().out
    # each run is named by its swept value (the recipe's logging.run_name is "quickstart"), in the table, in the
    # list of runs and in every run's summary
    assert report.splitlines()[0] == "# quickstart: sweep of training.optim (3 runs, baseline: adamw_torch)"
    labels = [line.split("|")[1].strip() for line in report.splitlines() if line.startswith("| ")][1:]
    assert labels == ["adamw_torch (baseline)", "adamw_8bit", "lion_8bit"]
    assert [line for line in report.splitlines() if line.startswith("- ") and ": `" in line] == \
        [f"- {value}: `{tmp_path / value}`" for value in ("adamw_torch", "adamw_8bit", "lion_8bit")]
    for value in ("adamw_torch", "adamw_8bit", "lion_8bit"):
        assert json.loads((tmp_path / value / "summary.json").read_text())["run_name"] == value


def test_plot_and_compare_verbs(tmp_path, capsys):
    runs = []
    for optim in ("adamw_torch", "paged_adamw_8bit"):
        run_dir = tmp_path / optim
        assert cli.main(["train", "quickstart", "--smoke", f"training.optim={optim}", "training.max_steps=2",
                         f"training.output_dir={run_dir}"]) == 0
        runs.append(str(run_dir))
    assert cli.main(["plot", runs[0]]) == 0
    assert cli.main(["compare", *runs, "--out", str(tmp_path / "cmp")]) == 0
    assert (tmp_path / "cmp" / "compare.md").is_file()


def test_validate_unknown_architecture_offline_still_checks_keys(tmp_path, capsys):
    recipe = tmp_path / "other.yaml"
    recipe.write_text("model: {id: someone/unknown-model}\ndata: {path: builtin:tiny-chat}\n"
                      "training: {optim: adamw_8bit}\n")
    assert cli.main(["validate", str(recipe)]) == 0
    out = capsys.readouterr().out
    assert "keys, types and optimizer 'adamw_8bit' are valid" in out
    assert "no memory estimate: no config for 'someone/unknown-model'" in out


def _extra(name: str, extras: dict) -> set[str]:
    """Distribution names an extra installs, its self-references (hf_optim[a,b]) followed."""
    out = set()
    for requirement in extras[name]:
        dist = re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")
        if dist == "hf-optim":
            for other in requirement.split("[", 1)[1].split("]", 1)[0].split(","):
                out |= _extra(other.strip(), extras)
        else:
            out.add(dist)
    return out


def test_train_extra_holds_what_the_train_verb_imports_and_no_test_tools():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    train = _extra("train", extras)
    assert set(cli.TRAIN_EXTRA.values()) <= train, set(cli.TRAIN_EXTRA.values()) - train
    assert not train & {"pytest", "ruff", "ipykernel", "nbclient", "nbformat"}
    assert train <= _extra("test", extras)  # the test command installs everything the main job needs
    monitor = {cli.TRAIN_EXTRA[module] for module in cli.MONITOR_MODULES}  # what plot and compare import
    assert monitor <= _extra("monitor", extras), monitor - _extra("monitor", extras)


def test_missing_extra_is_one_line_naming_it(monkeypatch, capsys):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("trl", "rich") else real_find_spec(name, *a))
    assert cli.main(["train", "quickstart"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        'hf-optim train needs hf_optim\'s "train" extra, which is not installed (missing: trl, rich): '
        'pip install "hf_optim[train]" (from a source checkout: pip install -e ".[train]")']
    assert cli.main(["optimizers"]) == 0  # needs no extra: plain columns without rich
    assert "lamb_8bit" in capsys.readouterr().out
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a))
    assert cli.main(["plot", "runs/x"]) == 1
    assert capsys.readouterr().err.startswith('hf-optim plot needs hf_optim\'s "monitor" extra, which is not installed '
                                              '(missing: matplotlib): pip install "hf_optim[monitor]"')


def narrow_console(monkeypatch, width: int = 80):
    """The console an 80-column terminal gives (rich wraps and cuts at the terminal's width)."""
    from rich.console import Console

    monkeypatch.setattr(cli, "_console", lambda: Console(width=width, soft_wrap=True))


def test_ls_and_optimizers_never_cut_a_name_at_80_columns(capsys, monkeypatch):
    """The columns a user reads to type a command (recipe names, optimizer names, class names) are whole on an
    80-column terminal; the long ones fold or, below that, are left out with a line saying so."""
    from hf_optim import available_optimizers

    narrow_console(monkeypatch)
    assert cli.main(["ls"]) == 0
    out = capsys.readouterr().out
    assert "…" not in out and max(len(line) for line in out.splitlines()) <= 80
    cells = [cell.strip() for line in out.splitlines() for cell in line.split("│")]
    assert set(bundled_names()) <= set(cells)
    assert "left out" not in out  # 80 columns hold every column (folded)
    assert cli.main(["optimizers"]) == 0
    out = capsys.readouterr().out
    assert "…" not in out and max(len(line) for line in out.splitlines() if "│" in line) <= 80
    cells = {cell.strip() for line in out.splitlines() for cell in line.split("│")}
    rows = available_optimizers().rows()
    assert {row[0] for row in rows} <= cells and {row[1] for row in rows} <= cells
    narrow_console(monkeypatch, 60)
    assert cli.main(["ls"]) == 0
    out = capsys.readouterr().out
    assert "…" not in out and set(bundled_names()) <= {c.strip() for line in out.splitlines() for c in line.split("│")}
    assert "(model and hardware left out at 60 columns: a wider terminal shows them)" in out


def test_fit_table_keeps_its_figures_whole_at_80_columns():
    """The --fit table's GiB figures and optimizer names are never cut (``19.…``): headers wrap, and the columns
    the optimizer's name already says (state, paged) are left out when 80 columns cannot hold them all."""
    from rich.console import Console

    columns = [("#", "right"), ("optimizer", "left"), ("state", "left"), ("paged", "left"), ("grads", "left"),
               ("ckpt", "left"), ("B/param", "right"), ("GiB at batch 8 (est.)", "right"),
               ("largest batch (est.)", "right")]
    rows = [(str(i), name, state, "yes", "released", "on", "10.26", "123.91 (over)", "1")
            for i, (name, state) in enumerate([("paged_adamw_4bit_rank1", "4-bit rank-1"),
                                               ("paged_adamw_fp8", "8-bit float (fp8)")], 1)]
    # 9 columns of cells (1+22+17+3+8+2+5+13+1 = 72) + padding and borders (3 each + 1 = 28) = 100; without state
    # 55 + 25 = 80; without paged either 52 + 22 = 74
    for width, left_out in ((200, []), (100, []), (80, ["state"]), (79, ["state", "paged"])):
        table, dropped = cli._uncut_table("fit", columns, rows, width, optional=("state", "paged"))
        console = Console(width=width, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
        console.print(table)
        text = console.export_text()
        assert dropped == left_out and "…" not in text
        assert max(len(line) for line in text.splitlines()) <= width
        cells = {c.strip() for line in text.splitlines() for c in line.split("│")}
        assert {"paged_adamw_4bit_rank1", "paged_adamw_fp8", "123.91 (over)", "10.26"} <= cells
