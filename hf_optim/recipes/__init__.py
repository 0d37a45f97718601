"""Recipes: YAML files that describe a fine-tune (model, quantization, LoRA, SFTConfig, data, logging), validated
against the installed Hugging Face classes. ``hf-optim train RECIPE`` runs one; see docs/guide/recipes.md."""

from typing import TYPE_CHECKING

from hf_optim import _startup

if TYPE_CHECKING:  # what _load() binds, for type checkers
    from hf_optim.recipes.api import load_recipe, sweep, train
    from hf_optim.recipes.errors import RecipeError, RecipeIssue
    from hf_optim.recipes.loading import bundled_dir, bundled_names
    from hf_optim.recipes.rundir import RunDirectoryError
    from hf_optim.recipes.schema import Recipe
    from hf_optim.recipes.train import RunResult

__all__ = ["load_recipe", "train", "sweep", "Recipe", "RecipeError", "RecipeIssue", "RunDirectoryError", "RunResult",
           "bundled_dir", "bundled_names"]


def _load() -> None:
    """Import this package's names (at once, except in the ``hf-optim`` command: :mod:`hf_optim._startup`)."""
    from hf_optim.recipes.api import load_recipe, sweep, train
    from hf_optim.recipes.errors import RecipeError, RecipeIssue
    from hf_optim.recipes.loading import bundled_dir, bundled_names
    from hf_optim.recipes.rundir import RunDirectoryError
    from hf_optim.recipes.schema import Recipe
    from hf_optim.recipes.train import RunResult

    globals().update(load_recipe=load_recipe, sweep=sweep, train=train, RecipeError=RecipeError,
                     RecipeIssue=RecipeIssue, bundled_dir=bundled_dir, bundled_names=bundled_names,
                     RunDirectoryError=RunDirectoryError, Recipe=Recipe, RunResult=RunResult)


if _startup.deferred():
    __getattr__ = _startup.deferred_getattr(__name__, __all__)
else:
    _load()
