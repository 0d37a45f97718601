"""``hf-optim`` answers ``--help`` and a user's typo before torch or transformers is imported.

Each command runs as a user runs it, in a fresh interpreter (``python -m hf_optim.cli``, and the installed
``hf-optim`` script), under ``python -X importtime``, which lists every module the process imported: the error must
come with neither torch nor transformers among them. No wall times are asserted (they depend on the machine's
load); the import list is what makes the answer fast. What the quick checks read without importing (hf_optim's
optimizer names, transformers' optimizer names, the fields and types of the four classes a recipe passes keys to) is
compared with the real thing after import, and each quick error with the full check's whole list for the same
input.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hf_optim.integrations.name_table import HF_OPTIM_OPTIMIZER_NAMES
from hf_optim.integrations.names import OPTIMIZER_NAMES
from hf_optim.optim import registry
from hf_optim.recipes import RecipeError, load_recipe, quickcheck, rundir
from hf_optim.recipes.loading import apply_overrides, load_raw
from hf_optim.recipes.train import default_output_dir

HEAVY = {"torch", "transformers", "trl", "peft", "bitsandbytes"}


def hf_optim_command(args: list[str], cwd: Path, script: bool = False) -> tuple[subprocess.CompletedProcess, set]:
    """Run ``hf-optim ARGS`` in a fresh interpreter under -X importtime: (the process, the top-level packages it
    imported)."""
    entry = [shutil.which("hf-optim")] if script else ["-m", "hf_optim.cli"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-X", "importtime", *entry, *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=300)
    imported = {m.group(1).strip().split(".")[0]
                for m in re.finditer(r"^import time:\s+\d+ \|\s+\d+ \|\s+(\S.*)$", done.stderr, re.M)}
    return done, imported


def error_lines(done: subprocess.CompletedProcess) -> list[str]:
    return [line for line in done.stderr.splitlines() if not line.startswith("import time:")]


@pytest.fixture
def held_run(tmp_path) -> Path:
    """A directory that holds a run: one logged training step (what rundir.inspect counts)."""
    run = tmp_path / "held"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 1, "loss": 2.0}) + "\n")
    return run


TYPOS = [
    (["train", "quickstrat"],
     "error: quickstrat: no such file or bundled recipe; did you mean 'quickstart'? (`hf-optim ls` lists the bundled "
     "ones)"),
    (["train", "quickstart", "training.optim=adamw_8bitt"],
     "error: command line: training.optim: unknown optimizer 'adamw_8bitt'; did you mean 'adamw_8bit', 'adamw_4bit', "
     "'adamw_32bit'? (`hf-optim optimizers` lists hf_optim's names; transformers' are in "
     "transformers.training_args.OptimizerNames)"),
    (["validate", "quickstart", "training.learning_rat=1e-4"],
     "error: command line: training.learning_rat: unknown SFTConfig field; did you mean 'learning_rate'?"),
    (["train", "quickstart", "trainig.max_steps=3"], "error: command line: trainig: unknown section; did you mean "
                                                      "'training'?"),
    (["train", "quickstart", "data.pathh=x.jsonl"], "error: command line: data.pathh: unknown key; did you mean "
                                                     "'path'?"),
    (["validate", "quickstart", "--fit", "24GiB", "--no-estimate"],
     "error: --fit 24GiB plans from the memory estimate, which --no-estimate leaves out: give one of them"),
    (["train"], "hf-optim train: error: a recipe is required: a recipe file or the name of a bundled one (`hf-optim "
                "ls` lists them, e.g. quickstart) (see hf-optim train --help)"),
]


@pytest.mark.parametrize(("args", "expected"), TYPOS, ids=[" ".join(a) for a, _ in TYPOS])
def test_a_typo_is_one_line_before_torch_is_imported(args, expected, tmp_path):
    done, imported = hf_optim_command(args, tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert error_lines(done) == [expected]
    assert not imported & HEAVY, sorted(imported & HEAVY)


def test_a_directory_that_holds_a_run_and_a_missing_plot_directory_before_torch(tmp_path, held_run):
    done, imported = hf_optim_command(["train", "quickstart", "--output-dir", str(held_run)], tmp_path)
    assert done.returncode == 2 and not imported & HEAVY
    assert error_lines(done) == [f"error: {held_run} already holds a run (1 logged step): start it again with "
                                 "--overwrite, or choose another --output-dir"]
    # the default directory, runs/<recipe>, as train would use it
    default = tmp_path / "runs" / "quickstart"
    shutil.copytree(held_run, default)
    done, imported = hf_optim_command(["train", "quickstart"], tmp_path)
    assert done.returncode == 2 and not imported & HEAVY
    assert error_lines(done) == ["error: runs/quickstart already holds a run (1 logged step): start it again with "
                                 "--overwrite, or choose another --output-dir"]
    done, imported = hf_optim_command(["plot", str(tmp_path / "nowhere")], tmp_path)
    assert done.returncode == 2 and not imported & HEAVY
    assert error_lines(done) == [f"error: run directory '{tmp_path / 'nowhere'}' does not exist"]


def test_cp_onto_an_existing_file_is_one_error_line(tmp_path):
    existing = tmp_path / "mine.yaml"
    existing.write_text("keep me\n")
    done, imported = hf_optim_command(["cp", "quickstart", str(existing)], tmp_path)
    assert done.returncode == 2 and not imported & HEAVY
    assert error_lines(done) == [f"error: {existing} exists; not overwritten (give another destination, or remove it "
                                 "first)"]
    assert existing.read_text() == "keep me\n"


@pytest.mark.parametrize("args", [["--help"], ["train", "--help"], ["validate", "--help"], ["run", "--help"],
                                  ["doctor", "--help"], ["ls"]])
def test_help_and_ls_do_not_import_torch(args, tmp_path):
    done, imported = hf_optim_command(args, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not imported & HEAVY, sorted(imported & HEAVY)
    assert "usage:" in done.stdout or "bundled recipes" in done.stdout


@pytest.mark.skipif(shutil.which("hf-optim") is None, reason="the hf-optim script is not installed (pip install -e .)")
def test_the_installed_script_defers_too(tmp_path):
    done, imported = hf_optim_command(["train", "quickstrat"], tmp_path, script=True)
    assert done.returncode == 2 and not imported & HEAVY
    assert error_lines(done)[0].startswith("error: quickstrat: no such file or bundled recipe")


def test_a_verb_that_needs_torch_gets_the_whole_package(tmp_path):
    """After the quick checks the command imports hf_optim in full: transformers' names are patched in this process
    (`run -c` runs the code in the command's own process)."""
    code = ("import hf_optim, hf_optim.recipes, transformers.training_args as t; "
            "print('lamb_8bit' in [m.value for m in t.OptimizerNames], hf_optim.AdamW8bit.__name__, "
            "callable(hf_optim.recipes.load_recipe))")
    done, imported = hf_optim_command(["run", "--", "python", "-c", code], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["True", "AdamW8bit", "True"]
    done, _ = hf_optim_command(["optimizers"], tmp_path)
    assert done.returncode == 0 and "paged_adamw_8bit" in done.stdout


# ---- the quick checks' names are the real ones ------------------------------------------------------------------
def registered_by_tests() -> set[str]:
    """The ``optim=`` names of algorithms registered from outside hf_optim in this process: a registration lasts for
    the process, and ``tests/algorithms/test_custom_algorithm.py`` registers an example algorithm."""
    return {name for family in registry.families() if not family.base.__module__.startswith("hf_optim.")
            for name in family.trainer_names}


def test_the_static_name_table_is_the_registry():
    assert list(HF_OPTIM_OPTIMIZER_NAMES) == sorted(set(OPTIMIZER_NAMES) - registered_by_tests()), \
        "hf_optim/integrations/name_table.py is out of date: run python tools/readme_tables.py --write"


def test_optimizer_names_read_from_source_are_the_installed_ones():
    from transformers.training_args import OptimizerNames

    theirs = quickcheck.transformers_optimizer_names()
    patched = {member.value for member in OptimizerNames}  # hf_optim adds its names to transformers' enum
    # what the quick check accepts is what the full check accepts (schema.installed_classes)
    assert theirs is not None
    assert theirs | set(HF_OPTIM_OPTIMIZER_NAMES) == (patched | set(OPTIMIZER_NAMES)) - registered_by_tests()


def test_every_target_read_from_source_is_the_installed_one():
    """The quick check's four classes, read from source, accept the keys the installed classes accept, under the
    same labels and with the same deprecated aliases."""
    from hf_optim.recipes import source_targets, targets

    installed, read = targets.pass_through_targets(), source_targets.pass_through_targets()
    assert read is not None
    for section, target in installed.items():
        assert (read[section].label, set(read[section].fields), read[section].aliases) == \
            (target.label, set(target.fields), target.aliases), section


PROBES = ["x", "no", "linear", "2e-4", 3, 0, -1, 2.5, True, False, None, ["q_proj"], [1], {"a": 1}, {}]


def test_a_value_the_source_vouches_for_passes_the_installed_check():
    """A type read from source stands for what it cannot name with a type that matches nothing, so a value it
    accepts is accepted by the installed class's type too; what it cannot decide is Undecided, never refused."""
    from hf_optim.recipes import source_targets, targets
    from hf_optim.recipes.checks import Undecided, read_by_type

    installed, read = targets.pass_through_targets(), source_targets.pass_through_targets()
    vouched = 0
    for section, target in installed.items():
        for name, annotation in read[section].fields.items():
            for value in PROBES:
                try:
                    ok, _ = read_by_type(annotation, value, exact=False)
                except Undecided:
                    continue
                assert ok
                vouched += 1
                assert read_by_type(target.fields[name], value)[0], (section, name, value, annotation)
    assert vouched > 1000  # most of the fields and probes are decided from source


TWO_SECTIONS = ["training.learning_rat=1e-4", "peft.lora_rr=8"]


@pytest.mark.parametrize("overrides,decided,problems", [
    (["training.optim=lamb_8bitt"], True, 1), (["training.learning_rat=1e-4"], True, 1),
    (["trainig.max_steps=3"], True, 1), (["logging.monitr=false"], True, 1),
    (["training.optim=nope", "data.pathh=x"], True, 2), (TWO_SECTIONS, True, 2),
    (["trainig.x=1", "data.seed=no", "logging.monitor=maybe"], True, 3),  # own sections' values: the same pydantic
    (["training.learning_rat=1", "peft.r=abc"], False, 2),  # a value refused: the full check words it
    (["training.learning_rat=1", "training.optim_args=eps=1e-6"], False, 1),  # read by the optimizer's class
])
def test_a_quick_error_is_the_full_checks_whole_list(overrides, decided, problems):
    """The quick check raises only the full check's own list, every problem in the same order and words; where the
    source cannot decide, it raises nothing and the full check answers (issue 43: one section's errors only)."""
    with pytest.raises(RecipeError) as full:
        load_recipe("quickstart", overrides)
    if decided:
        with pytest.raises(RecipeError) as quick:
            quickcheck.quick_check("quickstart", overrides, smoke=False)
        assert str(quick.value).splitlines() == str(full.value).splitlines()
    else:
        quickcheck.quick_check("quickstart", overrides, smoke=False)
    assert len(full.value.issues) == problems


def test_typos_in_every_bundled_recipe_are_answered_from_source():
    """A typo in any bundled recipe is answered whole before torch is imported, except where an hf_optim optimizer's
    optim_args are set (the optimizer's own class reads them): the full check answers those."""
    from hf_optim.recipes.loading import bundled_names

    for name in bundled_names():
        raw = apply_overrides(load_raw(name), TWO_SECTIONS)
        with pytest.raises(RecipeError) as full:
            load_recipe(name, TWO_SECTIONS)
        quick = quickcheck.complete_issues(raw)
        if raw.data["training"].get("optim_args") and raw.data["training"]["optim"] in HF_OPTIM_OPTIMIZER_NAMES:
            assert quick is None, name
        else:
            assert quick == full.value.issues, name


@pytest.mark.parametrize("verb", ["validate", "train"])
def test_problems_in_two_sections_are_listed_whole_before_torch(verb, tmp_path):
    """Issue 43: a recipe with a bad key in training and one in peft showed only the first."""
    (tmp_path / "two.yaml").write_text("extends: quickstart\ntraining:\n  learnin_rate: 1e-4\npeft:\n  lora_rr: 8\n")
    done, imported = hf_optim_command([verb, "two.yaml"], tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert error_lines(done) == ["invalid recipe (2 problems):",
                                 "two.yaml: peft.lora_rr: unknown LoraConfig field; did you mean 'r'?",
                                 "two.yaml: training.learnin_rate: unknown SFTConfig field; did you mean "
                                 "'learning_rate'?"]
    assert not imported & HEAVY, sorted(imported & HEAVY)
    assert not (tmp_path / "runs").exists()


def test_a_valid_recipe_passes_the_quick_checks(tmp_path):
    for name in ("quickstart", "llama-3.2-1b-full", "llama-3.1-8b-qlora"):
        quickcheck.quick_check(name, ["training.optim=adamw_torch", "training.learning_rate=1e-4"], smoke=False)
        quickcheck.quick_check(name, [], smoke=True, train_into=str(tmp_path / name))


def test_a_smoke_run_has_its_own_directory():
    """--smoke never writes into the real run's directory (the real run would then be refused)."""
    for overrides, expected in (([], Path("runs/quickstart-smoke")),
                                (["training.output_dir=elsewhere"], Path("elsewhere"))):
        recipe = load_recipe("quickstart", overrides, smoke=True)
        assert default_output_dir(recipe) == expected
        assert quickcheck.output_dir(apply_overrides(load_raw("quickstart"), overrides), smoke=True) == expected
    assert default_output_dir(load_recipe("quickstart")) == Path("runs/quickstart")
    assert rundir.smoke_dir("out/run") == Path("out/run-smoke")
