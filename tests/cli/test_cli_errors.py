"""User errors in the ``hf-optim`` command (issue 23): one line on stderr, exit status 2, no traceback, on every
verb; ``validate`` rejects what ``train`` would reject before its first step, with the same line naming the key;
no run directory is written for a recipe ``train`` refuses; without network, one line with what to do.

Runs go through ``hf_optim.cli.main`` in-process (every case fails before a model is loaded); two cases run as
real processes, as a user meets them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_optim import cli
from hf_optim.recipes import RecipeError, load_recipe
from hf_optim.recipes.preflight import check_model_source, preflight

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def recipes(tmp_path, monkeypatch):
    """Recipe files with one mistake each, in a working directory of their own."""
    monkeypatch.chdir(tmp_path)
    files = {
        "target_string.yaml": "extends: quickstart\npeft:\n  target_modules: q_proj\n",
        "no_data.yaml": "extends: quickstart\ndata:\n  path: missing/chat.jsonl\n",
        "typo_extends.yaml": "extends: quickstrat\ntraining:\n  max_steps: 2\n",
        "offline_model.yaml": "extends: quickstart\nmodel:\n  id: someone/model-that-is-not-cached\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "not_a_run").mkdir()
    (tmp_path / "a_file").write_text("")
    return tmp_path


def run_cli(argv: list[str], capsys) -> tuple[int, list[str], str]:
    """(exit status, stderr lines, stdout) of ``hf-optim ARGV``; argparse's errors exit through SystemExit."""
    try:
        code = cli.main(argv)
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return code, [line for line in captured.err.splitlines() if line.strip()], captured.out


# (arguments, environment, text the one error line must hold). Every verb that can meet a user error is here.
CASES = {
    "bad recipe name": (["validate", "quickstrat"], {}, "quickstrat: no such file or bundled recipe; did you mean "
                                                        "'quickstart'?"),
    "bad override key": (["validate", "quickstart", "training.learning_rat=1e-3"], {},
                         "command line: training.learning_rat: unknown SFTConfig field; did you mean 'learning_rate'?"),
    "bad override section": (["validate", "quickstart", "trainig.max_steps=3"], {},
                             "command line: trainig: unknown section; did you mean 'training'?"),
    "override without =": (["validate", "quickstart", "training.max_steps"], {},
                           "command line: training.max_steps: an override is KEY.PATH=VALUE"),
    "bad value type": (["validate", "quickstart", "training.learning_rate=fast"], {},
                       "command line: training.learning_rate: expected float, got str 'fast'"),
    "a YAML boolean word for a number": (["validate", "quickstart", "training.max_steps=no"], {},
                                         "command line: training.max_steps: expected int, got 'no'"),
    "bad save_strategy": (["train", "quickstart", "training.save_strategy=sometimes"], {},
                          "command line: training.save_strategy: SFTConfig rejected this value: sometimes is not a "
                          "valid SaveStrategy, please select one of ['no', 'steps', 'epoch', 'best']"),
    "negative learning rate": (["validate", "quickstart", "training.learning_rate=-1"], {},
                               "command line: training.learning_rate: hf_optim.PagedAdamW8bit refuses "
                               "learning_rate=-1: Invalid learning rate: -1 (lr); expected a value in [0.0, inf)"),
    "optimizer beta out of range": (["validate", "quickstart", "training.adam_beta1=1.5"], {},
                                    "command line: training.adam_beta1: hf_optim.PagedAdamW8bit refuses "
                                    "adam_beta1=1.5: Invalid beta parameter at index 0: 1.5 (beta1); "
                                    "expected a value in [0.0, 1.0)"),
    "unknown optimizer name": (["validate", "quickstart", "training.optim=lamb8bit"], {},
                               "command line: training.optim: unknown optimizer 'lamb8bit'; did you mean 'lamb_8bit'"),
    "target_modules as a string": (["validate", "target_string.yaml"], {},
                                   "target_string.yaml: peft.target_modules: peft rejected this value: Target modules "
                                   "q_proj not found in the base model"),
    "lora rank 0 on the command line": (["validate", "quickstart", "peft.r=0"], {},
                                        "command line: peft.r: peft rejected this value: `r` should be a positive "
                                        "integer"),
    "missing data.path": (["validate", "no_data.yaml"], {},
                          "no_data.yaml: data.path: no such file or directory: 'missing/chat.jsonl'"),
    "typo in extends": (["validate", "typo_extends.yaml"], {},
                        "typo_extends.yaml: extends: 'quickstrat' is neither a file (quickstrat) nor a bundled recipe; "
                        "did you mean 'quickstart'?"),
    "bad HF_OPTIM_BACKEND": (["validate", "quickstart", "--no-estimate"], {"HF_OPTIM_BACKEND": "cuda"},
                             "environment: HF_OPTIM_BACKEND='cuda' is not a valid backend; valid values are 'torch', "
                             "'triton'"),
    "bad HF_OPTIM_COMPILE": (["validate", "quickstart", "--no-estimate"], {"HF_OPTIM_COMPILE": "bogus"},
                             "environment: HF_OPTIM_COMPILE='bogus' is not valid; valid values are 'auto'"),
    "--fit without unit": (["validate", "quickstart", "--fit", "24"], {}, "--fit '24': no unit; write a positive size"),
    "empty --sweep": (["train", "quickstart", "--sweep", "training.optim"], {},
                      "command line: --sweep: takes KEY=V1,V2,..."),
    "train refuses a negative learning rate": (["train", "quickstart", "training.learning_rate=-1"], {},
                                               "command line: training.learning_rate: hf_optim.PagedAdamW8bit refuses"),
    "model neither cached nor reachable": (["train", "offline_model.yaml"], {"HF_HUB_OFFLINE": "1"},
                                           "offline_model.yaml: model.id: 'someone/model-that-is-not-cached': not in "
                                           "the local Hugging Face cache"),
    "cp of an unknown recipe": (["cp", "quickstrat", "copy.yaml"], {}, "did you mean 'quickstart'?"),
    "cp into a file": (["cp", "quickstart", "a_file/copy.yaml"], {}, "cannot copy quickstart.yaml to a_file/copy.yaml"),
    "plot of a missing directory": (["plot", "no_such_run"], {}, "run directory 'no_such_run' does not exist"),
    "plot of a directory that is not a run": (["plot", "not_a_run"], {},
                                              "'not_a_run' is not a run directory: it has neither summary.json nor "
                                              "metrics.jsonl"),
    "compare of a missing directory": (["compare", "no_such_run", "not_a_run"], {},
                                       "run directory 'no_such_run' does not exist"),
    "unknown verb": (["trian", "quickstart"], {}, "hf-optim: error: argument VERB: invalid choice: 'trian'"),
    "unknown option": (["validate", "quickstart", "--smoek"], {},
                       "hf-optim validate: error: unrecognized arguments: --smoek (see hf-optim validate --help)"),
    "run without a command": (["run"], {}, "hf-optim run: error: give the command to run"),
    "run of an unknown command": (["run", "--", "trll", "sft"], {}, "'trll' is not an installed console script"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_user_error_is_one_line_with_status_2(case, recipes, capsys, monkeypatch):
    argv, environment, expected = CASES[case]
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    if environment.get("HF_HUB_OFFLINE"):
        import huggingface_hub.constants

        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    code, err, _ = run_cli(argv, capsys)
    assert code == 2, err
    assert len(err) == 1, err
    assert "Traceback" not in err[0]
    assert expected in err[0], err[0]
    if argv[0] == "train":  # refused before anything is written
        assert not (recipes / "runs").exists()
    if case == "unknown verb":
        assert err[0].endswith("; did you mean 'train'? (see hf-optim --help)")


def test_the_value_transformers_documents_for_no_saving_is_accepted(capsys):
    """`training.save_strategy=no`: YAML reads `no` as False, the field takes the word (issue 43)."""
    code, err, out = run_cli(["validate", "llama-3.2-1b-full", "training.save_strategy=no", "--no-estimate"], capsys)
    assert code == 0 and not err, err
    assert out.startswith("ok ")


def test_several_problems_are_a_header_and_one_line_each(capsys):
    code, err, _ = run_cli(["validate", "quickstart", "training.optim=lamb8bit", "training.learning_rat=1"], capsys)
    assert code == 2
    assert err[0] == "invalid recipe (2 problems):" and len(err) == 3
    assert all(line.startswith("command line: training.") for line in err[1:])


@pytest.mark.parametrize("case", ["negative learning rate", "target_modules as a string", "missing data.path",
                                  "bad HF_OPTIM_BACKEND", "bad HF_OPTIM_COMPILE"])
def test_train_refuses_what_validate_refuses_with_the_same_line(case, recipes, capsys, monkeypatch):
    """The issue's cases: validate said ok, then train failed with a traceback. Both now share one preflight."""
    argv, environment, _ = CASES[case]
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    _, validate_err, _ = run_cli(argv, capsys)
    _, train_err, _ = run_cli(["train", *[a for a in argv[1:] if a != "--no-estimate"]], capsys)
    assert validate_err == train_err and len(train_err) == 1
    assert not (recipes / "runs").exists()


def test_a_bug_keeps_its_traceback(monkeypatch):
    def broken(args, console):
        raise RuntimeError("a bug in hf_optim")

    monkeypatch.setitem(cli.COMMANDS, "ls", broken)
    with pytest.raises(RuntimeError, match="a bug in hf_optim"):
        cli.main(["ls"])


def test_a_hub_error_from_anywhere_gets_the_offline_hint(monkeypatch, capsys):
    """Past the preflight (a dataset on the Hub, say), a failed Hub download wrapped by transformers or datasets
    still ends as one line with what to do."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    def offline(args, console):
        try:
            raise LocalEntryNotFoundError("An error happened while trying to locate the file on the Hub and we "
                                          "cannot find the requested files in the local cache.")
        except LocalEntryNotFoundError as exc:
            raise OSError("We couldn't connect to 'https://huggingface.co' to load the files") from exc

    monkeypatch.setitem(cli.COMMANDS, "ls", offline)
    code, err, _ = run_cli(["ls"], capsys)
    assert code == 2 and len(err) == 1
    assert err[0].startswith("error: the Hugging Face Hub cannot be reached and the files are not cached (An error")
    assert "`--smoke` runs any recipe on the builtin tiny model" in err[0] and "HF_HUB_OFFLINE=1" in err[0]


def test_unreachable_hub_is_one_line_without_retries(recipes, monkeypatch):
    """No HF_HUB_OFFLINE, and the Hub refuses connections (a closed local port stands for it): one request, no
    retries, the hint; the same model in the cache loads from it instead."""
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", "http://127.0.0.1:9/{repo_id}/resolve/{revision}/"
                                                                  "{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(recipes / "hub-cache"))
    recipe = load_recipe("offline_model.yaml")
    with pytest.raises(RecipeError) as info:
        check_model_source(recipe)
    (line,) = str(info.value).splitlines()
    assert "model.id: 'someone/model-that-is-not-cached': not in the local Hugging Face cache, and the Hub cannot be " \
           "reached (" in line and "`--smoke`" in line
    # cached: a snapshot with its config, as huggingface_hub lays it out
    repo = recipes / "hub-cache" / "models--someone--model-that-is-not-cached"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "snapshots" / "abc123" / "config.json").write_text("{}")
    ready = check_model_source(recipe)
    assert ready.model["local_files_only"] is True and "local_files_only" not in recipe.model
    assert any("cannot be reached" in note for note in ready.notes)


def test_preflight_warns_about_what_only_this_machine_cannot_do():
    """validate checks a GPU recipe on a laptop: bf16 on a CPU is a warning there, an error for train."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine supports bf16: nothing to warn about")
    recipe = load_recipe("llama-3.2-1b-lora", ["training.bf16=true"])
    (warning,) = preflight(recipe, this_machine=False)
    assert warning.startswith("training.bf16: this machine cannot train it as is (Your setup doesn't support bf16")
    with pytest.raises(RecipeError, match=r"command line: training.bf16: SFTConfig rejected this value: .*set it to "
                                          r"auto"):
        preflight(recipe)


def test_preflight_passes_on_optimizer_warnings():
    recipe = load_recipe("quickstart", ["training.optim=lamb_8bit", "training.weight_decay=0"])
    (warning,) = preflight(recipe, this_machine=False)
    assert warning.startswith("LAMB8bit: every parameter group has weight_decay=0")


def test_fit_table_keeps_optimizer_names_whole_at_100_columns(monkeypatch, capsys):
    from rich.console import Console

    monkeypatch.setattr(cli, "_console", lambda: Console(soft_wrap=True, width=100))
    assert cli.main(["validate", "llama-3.2-1b-full", "--fit", "24GiB"]) == 0
    out = capsys.readouterr().out
    names = [line.split("│")[2].strip() for line in out.splitlines() if line.startswith("│ ") and line.count("│") > 5]
    assert {"paged_adamw_4bit", "paged_adamw_8bit", "paged_adamw_32bit", "adamw_torch"} <= set(names)
    assert not any("…" in name for name in names)
    assert max(len(line) for line in out.splitlines() if line.startswith(("│", "┃"))) <= 100


def test_available_optimizers_prints_as_a_table():
    import hf_optim

    names = hf_optim.available_optimizers()
    lines = str(names).splitlines()
    assert lines[0].split() == ["name", "class", "state", "paged", "origin"]
    assert len(lines) == len(names) + 1 and isinstance(names, list)
    row = next(line for line in lines if line.startswith("paged_lamb_8bit "))
    assert row.split()[:5] == ["paged_lamb_8bit", "hf_optim.PagedLAMB8bit", "8-bit", "blockwise", "yes"]
    assert repr(names[0]).startswith("<OptimizerName 'adafactor' -> hf_optim.Adafactor")


def test_no_doubled_prefix_in_the_embedding_line(hf_optim_records):
    import torch
    from transformers import TrainingArguments

    from hf_optim.integrations.transformers import optimizer_cls_and_kwargs

    model = torch.nn.Sequential(torch.nn.Embedding(64, 8), torch.nn.Linear(8, 8))
    args = TrainingArguments(output_dir="unused", optim="adamw_8bit", use_cpu=True, report_to="none")
    optimizer_cls_and_kwargs(args, model)
    messages = [r.getMessage() for r in hf_optim_records]
    assert "512 embedding parameters keep 32-bit state" in messages
    assert not any(m.startswith("hf_optim") for m in messages)


def _env(**extra) -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), **extra}


def test_real_processes_print_no_traceback_and_no_library_notice(tmp_path):
    """As a user meets them: `plot` on a missing directory, and `import hf_optim.monitor` (bitsandbytes, imported
    by peft there, logs its optional-kernel notice at import on CPUs with AVX512-BF16, as this CI machine's)."""
    result = subprocess.run([sys.executable, "-m", "hf_optim.cli", "plot", str(tmp_path / "missing")], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300, env=_env())
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"error: run directory '{tmp_path / 'missing'}' does not exist"]
    result = subprocess.run([sys.executable, "-c", "import hf_optim.monitor"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300, env=_env())
    assert result.returncode == 0 and result.stderr == "" and result.stdout == ""


def test_hf_optim_warnings_are_one_line_under_hf_optim_run(tmp_path):
    """The paged optimizer's notice on a CPU, in a command `hf-optim run` starts: one line, not Python's two."""
    code = ("import torch, hf_optim\n"
            "p = torch.nn.Parameter(torch.zeros(64))\n"
            "opt = hf_optim.PagedAdamW32bit([p])\n"
            "p.grad = torch.ones(64)\n"
            "opt.step()\n")
    result = subprocess.run([sys.executable, "-m", "hf_optim.run", "python", "-c", code], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300, env=_env(HF_OPTIM_COMPILE="0"))
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("[hf_optim] warning: paged optimizers page CUDA state to host memory, but "
                               "PagedAdamW32bit has state on cpu")
