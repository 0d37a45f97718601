"""The checks ``hf-optim train`` and ``validate`` run before torch is imported, so that a typo is answered at once.

Importing torch, transformers and TRL takes seconds (a minute on a loaded machine); these checks need none of
them: a recipe name that is neither a file nor a bundled recipe, an unknown section or key of the sections hf_optim
owns, a ``training`` key that is no ``SFTConfig`` field, an unknown ``training.optim`` name, and an output directory
that already holds a run. Each raises the same error, with the same words, as the full check would
(:func:`hf_optim.recipes.schema.validate`, :func:`hf_optim.recipes.rundir.prepare`; tests/cli/test_cli_fast.py compares
them). What cannot be decided without the installed classes is left to the full check, which runs next: these
checks only ever report what the full check reports too.

The names they check against are read without importing their packages: hf_optim's optimizer names from
:data:`HF_OPTIM_OPTIMIZER_NAMES` (a test keeps it equal to the registry's names), transformers' optimizer names and
the ``SFTConfig`` fields from the installed source files (``ast``; anything unexpected there and the check is left
to the full one). Standard library, PyYAML and hf_optim's torch-free modules only.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path

from hf_optim.errors import did_you_mean, suggest
from hf_optim.integrations.name_table import HF_OPTIM_OPTIMIZER_NAMES
from hf_optim.recipes import rundir
from hf_optim.recipes.errors import RecipeError, RecipeIssue
from hf_optim.recipes.loading import COMMAND_LINE, RawRecipe, apply_overrides, load_raw

TOP_LEVEL = ("model", "quantization", "peft", "training", "data", "logging", "description", "hardware")
"""The top-level keys of a recipe (``hf_optim.recipes.schema.TOP_LEVEL``; a test keeps them equal)."""

OWN_KEYS = {"data": ("path", "name", "split", "max_samples", "eval_fraction", "seed"),
            "logging": ("run_name", "monitor")}
"""The keys of the sections hf_optim owns (``schema.DataSection`` / ``LoggingSection`` fields; a test keeps them
equal)."""

_DEFINED_IN = {("transformers", "TrainingArguments"): "transformers.training_args"}
"""Where a class that a lazily-importing package (transformers) re-exports is defined, for :func:`class_fields`."""


def _module_file(module: str) -> Path | None:
    """The source file of ``module`` without importing it (or its package's ``__init__``); None if not found."""
    top, _, rest = module.partition(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    base = Path(next(iter(spec.submodule_search_locations)))
    path = base.joinpath(*rest.split(".")) if rest else base
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@functools.cache
def _module_tree(module: str) -> ast.Module | None:
    path = _module_file(module)
    if path is None:
        return None
    try:
        return ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None


def _class_node(module: str, name: str) -> tuple[str, ast.ClassDef] | None:
    """(module that defines it, its ``class`` statement) for class ``name`` as ``module`` sees it."""
    module = _DEFINED_IN.get((module, name), module)
    tree = _module_tree(module)
    if tree is None:
        return None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return module, node
    for node in tree.body:  # imported into module: follow `from X import name`
        if isinstance(node, ast.ImportFrom) and any(a.name == name and a.asname is None for a in node.names):
            package = module if _module_file(module) and _module_file(module).name == "__init__.py" \
                else module.rpartition(".")[0]
            for _ in range(max(node.level - 1, 0)):
                package = package.rpartition(".")[0]
            source = node.module or ""
            target = (f"{package}.{source}" if source else package) if node.level else source
            return _class_node(target, name) if target and target != module else None
    return None


def class_fields(module: str, name: str) -> frozenset[str] | None:
    """The ``__init__`` fields of dataclass ``name`` of ``module`` and of its dataclass bases, read from the source
    without importing it; None when anything there is not a plain ``@dataclass`` chain this can follow."""
    found = _class_node(module, name)
    if found is None:
        return None
    where, node = found
    if not any(isinstance(d, ast.Name | ast.Call) and ast.unparse(d).startswith("dataclass") for d in
               node.decorator_list):
        return None
    fields: set[str] = set()
    for base in node.bases:
        if not isinstance(base, ast.Name):
            return None
        inherited = class_fields(where, base.id)
        if inherited is None:
            return None
        fields |= inherited
    for statement in node.body:
        if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
            continue
        annotation = ast.unparse(statement.annotation)
        if "ClassVar" in annotation or "InitVar" in annotation:
            return None  # not a plain field: leave it to the full check
        value = statement.value
        if isinstance(value, ast.Call) and ast.unparse(value.func).endswith("field") and any(
                k.arg == "init" for k in value.keywords):
            return None
        fields.add(statement.target.id)
    return frozenset(fields)


@functools.cache
def sft_config_fields() -> frozenset[str] | None:
    """``SFTConfig``'s fields (what a recipe's ``training`` section accepts), or None when its source cannot be
    read as a plain dataclass chain."""
    return class_fields("trl.trainer.sft_config", "SFTConfig")


@functools.cache
def transformers_optimizer_names() -> frozenset[str] | None:
    """The values of ``transformers.training_args.OptimizerNames``, read from its source; None if not readable."""
    tree = _module_tree("transformers.training_args")
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


def _issues(raw: RawRecipe, smoke: bool) -> list[RecipeIssue]:
    issues = []
    data = raw.data
    for key in data:
        if key not in TOP_LEVEL:
            issues.append(RecipeIssue(raw.origin(str(key)), str(key),
                                      f"unknown section{did_you_mean(str(key), list(TOP_LEVEL))}"))
    for section, known in OWN_KEYS.items():
        values = data.get(section)
        if not isinstance(values, dict) or (smoke and section == "data"):  # smoke mode replaces the data section
            continue
        for key in values:
            if key not in known:
                path = f"{section}.{key}"
                issues.append(RecipeIssue(raw.origin(path), path, f"unknown key{did_you_mean(str(key), list(known))}"))
    training = data.get("training")
    if not isinstance(training, dict):
        return issues
    fields = sft_config_fields()
    if fields is not None:
        for key in training:
            if key not in fields:
                path = f"training.{key}"
                issues.append(RecipeIssue(raw.origin(path), path,
                                          f"unknown SFTConfig field{did_you_mean(str(key), sorted(fields))}"))
    theirs = transformers_optimizer_names()
    if "optim" in training and theirs is not None:
        name = str(training["optim"])
        valid = sorted(theirs | set(HF_OPTIM_OPTIMIZER_NAMES))
        if name not in valid:
            close = suggest(name, valid)
            hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            issues.append(RecipeIssue(raw.origin("training.optim"), "training.optim",
                                      f"unknown optimizer {name!r}{hint} (`hf-optim optimizers` lists hf_optim's "
                                      "names; transformers' are in transformers.training_args.OptimizerNames)"))
    return issues


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


def quick_check(recipe: str, overrides: list[str], smoke: bool, train_into: str | None | bool = False) -> None:
    """Raise what the full check would for the problems in ``recipe`` (a file or bundled name) with ``overrides``
    that need no torch; ``train_into`` (for ``hf-optim train`` without ``--resume`` or ``--overwrite``: its
    ``--output-dir``, None for the default) also checks that the output directory holds no run."""
    raw = apply_overrides(load_raw(recipe), list(overrides))
    issues = _issues(raw, smoke)
    if issues:
        raise RecipeError(issues)
    if train_into is False:
        return
    training = raw.data.get("training") if isinstance(raw.data.get("training"), dict) else {}
    if training.get("resume_from_checkpoint"):
        return  # the full check decides how that setting and the directory go together
    rundir.prepare(Path(train_into) if train_into else output_dir(raw, smoke))
