"""Recipes: YAML files that describe a fine-tune (model, quantization, LoRA, SFTConfig, data, logging), validated
against the installed Hugging Face classes. ``hf-optim train RECIPE`` runs one; see README.md (Recipes)."""

from hf_optim.recipes.api import load_recipe, sweep, train
from hf_optim.recipes.errors import RecipeError, RecipeIssue
from hf_optim.recipes.loading import bundled_dir, bundled_names
from hf_optim.recipes.rundir import RunDirectoryError
from hf_optim.recipes.schema import Recipe
from hf_optim.recipes.train import RunResult

__all__ = ["load_recipe", "train", "sweep", "Recipe", "RecipeError", "RecipeIssue", "RunDirectoryError", "RunResult",
           "bundled_dir", "bundled_names"]
