"""The checks ``hf-optim train`` and ``validate`` run before torch is imported, so that a typo is answered at once.

Importing torch, transformers and TRL takes seconds (a minute on a loaded machine); these checks need none of
them: a recipe name that is neither a file nor a bundled recipe, the recipe's sections, keys, value types and
optimizer name, and an output directory that already holds a run. The recipe is checked by the full check's own
walk (:func:`hf_optim.recipes.checks.collect`), against the installed classes read from their source files
(:mod:`hf_optim.recipes.source_targets`) and hf_optim's optimizer names from :data:`HF_OPTIM_OPTIMIZER_NAMES` (a test
keeps it equal to the registry's names). So an error lists every problem, in the same order and words as the full
check (:func:`hf_optim.recipes.schema.validate`, :func:`hf_optim.recipes.rundir.prepare`; tests/cli/test_cli_fast.py
compares them). What the source cannot vouch for (a value of the wrong type, an hf_optim optimizer's
``optim_args``, a smoke or random-weights run) is left to the full check, which runs next and lists every problem.

Standard library, PyYAML, pydantic and hf_optim's torch-free modules only.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

from hf_optim.integrations.name_table import HF_OPTIM_OPTIMIZER_NAMES
from hf_optim.recipes import rundir, source_targets
from hf_optim.recipes.errors import RecipeError, RecipeIssue
from hf_optim.recipes.loading import COMMAND_LINE, RawRecipe, apply_overrides, load_raw


@functools.cache
def transformers_optimizer_names() -> frozenset[str] | None:
    """The values of ``transformers.training_args.OptimizerNames``, read from its source; None if not readable."""
    tree = source_targets.module_tree("transformers.training_args")
    node = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "OptimizerNames"), None) \
        if tree is not None else None
    if node is None:
        return None
    names = set()
    for statement in node.body:
        if isinstance(statement, ast.Assign):
            if not (isinstance(statement.value, ast.Constant) and isinstance(statement.value.value, str)):
                return None
            names.add(statement.value.value)
    return frozenset(names) or None


def output_dir(raw: RawRecipe, smoke: bool) -> Path:
    """Where ``hf-optim train`` writes the run of ``raw`` (command-line overrides applied) without
    ``--output-dir``: ``training.output_dir``, else ``runs/<recipe name>``; a smoke run's own directory in smoke
    mode (:func:`hf_optim.recipes.rundir.smoke_dir`) unless the command line names one."""
    training = raw.data.get("training") if isinstance(raw.data.get("training"), dict) else {}
    configured = training.get("output_dir")
    path = Path(str(configured)) if configured else Path("runs") / Path(raw.source).stem
    if smoke and raw.origin("training.output_dir") != COMMAND_LINE:
        return rundir.smoke_dir(path)
    return path


def complete_issues(raw: RawRecipe) -> list[RecipeIssue] | None:
    """Every problem the full check finds in ``raw``, in its order and words, from the installed classes' source
    (:func:`hf_optim.recipes.checks.collect` against :mod:`hf_optim.recipes.source_targets`); None when the source
    cannot vouch for a value (the full check then decides) or there is no problem."""
    from hf_optim.recipes.checks import MODEL_OWN_KEYS, CheckedAgainst, Undecided, collect

    used = {name for name, values in raw.data.items()  # the sections whose classes are asked about a key
            if isinstance(values, dict) and set(values) - (set(MODEL_OWN_KEYS) if name == "model" else set())}
    targets, theirs = source_targets.pass_through_targets(used), transformers_optimizer_names()
    if targets is None or theirs is None:
        return None
    try:
        found = collect(raw, CheckedAgainst(targets, theirs | set(HF_OPTIM_OPTIMIZER_NAMES), _optim_args, exact=False))
    except Undecided:
        return None
    return found.issues or None


def _optim_args(raw: RawRecipe, name, optim_args, issues: list[RecipeIssue], training: dict) -> None:
    """``schema.check_optim_args`` reads an hf_optim optimizer's arguments with the optimizer's classes: left to
    it."""
    from hf_optim.recipes.checks import Undecided

    if optim_args and str(getattr(name, "value", name)) in HF_OPTIM_OPTIMIZER_NAMES:
        raise Undecided


def quick_check(recipe: str, overrides: list[str], smoke: bool, train_into: str | None | bool = False,
                as_given: bool = True) -> None:
    """Raise what the full check would for the problems in ``recipe`` (a file or bundled name) with ``overrides``,
    when the installed classes' source can vouch for the list (:func:`complete_issues`); ``train_into`` (for
    ``hf-optim train`` without ``--resume`` or ``--overwrite``: its ``--output-dir``, None for the default) also
    checks that the output directory holds no run. ``as_given=False`` (a random-weights run) and smoke mode check a
    recipe changed first, with hf_optim's torch modules: their problems are left to the full check."""
    raw = apply_overrides(load_raw(recipe), list(overrides))
    problems = complete_issues(raw) if as_given and not smoke else None
    if problems is not None:
        raise RecipeError(problems)
    if train_into is False:
        return
    training = raw.data.get("training") if isinstance(raw.data.get("training"), dict) else {}
    if training.get("resume_from_checkpoint"):
        return  # the full check decides how that setting and the directory go together
    rundir.prepare(Path(train_into) if train_into else output_dir(raw, smoke))
