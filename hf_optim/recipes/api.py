"""The recipe workflow in three calls: :func:`load_recipe`, :func:`train`, :func:`sweep`."""

from __future__ import annotations

import logging
from pathlib import Path

from hf_optim.checkpoints import last_complete_checkpoint
from hf_optim.recipes import rundir
from hf_optim.recipes.loading import apply_overrides, load_raw
from hf_optim.recipes.preflight import check_model_source, preflight
from hf_optim.recipes.schema import Recipe, validate
from hf_optim.recipes.smoke import SMOKE_STEPS, smoke_recipe, smoke_requested
from hf_optim.recipes.train import RunResult, default_output_dir, free_memory, run, run_dir_name, sweep_values

logger = logging.getLogger("hf_optim")


def load_recipe(name_or_path: str | Path, overrides: list[str] | tuple[str, ...] = (), smoke: bool = False) -> Recipe:
    """Read, merge and validate a recipe.

    Args:
        name_or_path: a recipe file, or the name of a bundled recipe (``hf-optim ls``).
        overrides (default ()): ``KEY.PATH=VALUE`` strings applied after ``extends`` (and after smoke mode).
        smoke (bool, default False): smoke mode (also on when ``HF_OPTIM_SMOKE=1``): the tiny builtin model and
            bundled data, a few steps on CPU, the recipe's method and optimizer kept.

    Raises:
        RecipeError: listing every problem, each as ``file: key.path: message``.
    """
    raw = load_raw(name_or_path)
    smoke = smoke_requested(smoke)
    if smoke:
        raw = smoke_recipe(raw)
    recipe = validate(apply_overrides(raw, list(overrides)))
    if smoke:
        recipe.notes.append(f"smoke mode: builtin tiny model and data, {recipe.training.get('max_steps', SMOKE_STEPS)}"
                            f" steps on CPU, method {recipe.method} and optimizer {recipe.optim} kept")
    return recipe


def train(name_or_path: str | Path, overrides: list[str] | tuple[str, ...] = (), smoke: bool = False,
          output_dir: str | Path | None = None, quiet: bool = False, resume: str | None = None,
          overwrite: bool = False) -> RunResult:
    """Load a recipe (see :func:`load_recipe`) and train it once. Returns the :class:`RunResult`.

    ``quiet`` (default False) hides third-party notices and the Trainer's log dicts
    (:mod:`hf_optim.recipes.console`), as ``hf-optim train`` does without ``-v``. ``resume`` (default None:
    ``"auto"``, a checkpoint or a run directory) continues a run, ``overwrite`` (default False) starts a directory
    that holds a run again from step 0: see :func:`hf_optim.recipes.train.run`.

    Before anything is written, the recipe passes :func:`~hf_optim.recipes.preflight.preflight` (what ``validate``
    checks) and :func:`~hf_optim.recipes.preflight.check_model_source`: a problem raises :class:`RecipeError`."""
    return run(ready_to_train(load_recipe(name_or_path, overrides, smoke)), output_dir, quiet=quiet, resume=resume,
               overwrite=overwrite)


def ready_to_train(recipe: Recipe) -> Recipe:
    """``recipe`` after every check ``train`` runs before loading the model (raises :class:`RecipeError`), with
    ``model.local_files_only`` set when the Hub is unreachable but the model is cached."""
    preflight(recipe)
    return check_model_source(recipe)


def sweep(name_or_path: str | Path, spec: str, overrides: list[str] | tuple[str, ...] = (), smoke: bool = False,
          output_dir: str | Path | None = None, quiet: bool = False, resume: bool = False,
          overwrite: bool = False) -> tuple[list[RunResult], Path | None]:
    """Train one recipe once per value of one key, each run in its own subdirectory, then compare them.

    Args:
        name_or_path: the recipe.
        spec: ``KEY.PATH=V1,V2,...``, e.g. ``training.optim=adamw_torch,adamw_8bit,paged_adamw_8bit``.
        overrides (default ()): applied to every run, before the swept value.
        smoke (bool, default False): smoke mode for every run.
        output_dir (default None): parent of the runs (default: the recipe's output directory); ``compare.md``
            and the comparison plots go there. The first value is the comparison's baseline.
        quiet (bool, default False): hide third-party notices and the Trainer's log dicts (see
            :mod:`hf_optim.recipes.console`), as ``hf-optim train`` does without ``-v``.
        resume (bool, default False): continue an interrupted sweep: a run that finished (or ran out of memory) is
            kept as it is, a run with a checkpoint resumes from its last complete one, any other starts again.
        overwrite (bool, default False): start runs whose directories hold a run again from step 0.

    Each run is named by its value (``paged_adamw_8bit``) in the comparison, whatever ``logging.run_name`` says.

    Every recipe is validated and passes the checks :func:`train` runs, and every run directory is checked, before
    the first run starts (a directory that holds a run needs ``resume`` or ``overwrite``). A run that runs out of
    memory becomes an OOM row of the comparison and the sweep continues; Ctrl-C stops the sweep after the run it
    interrupted (no comparison: the report is None). Returns (results, path of compare.md).
    """
    from hf_optim.monitor import compare_runs

    key, values = sweep_values(spec)
    recipes = [ready_to_train(load_recipe(name_or_path, [*overrides, f"{key}={value}"], smoke)) for value in values]
    parent = Path(output_dir) if output_dir is not None else default_output_dir(recipes[0])
    title = f"{recipes[0].logging.run_name or Path(recipes[0].source).stem}: sweep of {key}"
    plans = [_sweep_member(parent / run_dir_name(value), resume, overwrite) for value in values]
    results = []
    for value, recipe, (out, kept, member_resume, member_overwrite) in zip(values, recipes, plans):
        if kept is not None:
            logger.info("sweep %s=%s: kept (%s)", key, value, kept.status)
            results.append(kept)
            continue
        logger.info("sweep %s=%s", key, value)
        recipe.logging.run_name = value  # in a sweep a run is named by its value, whatever the recipe calls it
        results.append(run(recipe, out, quiet=quiet, resume=member_resume, overwrite=member_overwrite))
        free_memory()
        if results[-1].status in ("interrupted", "killed"):
            return results, None
    report = compare_runs([r.output_dir for r in results], parent, baseline=results[0].output_dir, title=title)
    return results, Path(report)


def _sweep_member(out: Path, resume: bool, overwrite: bool) -> tuple[Path, RunResult | None, str | None, bool]:
    """(directory, result kept as it is or None, resume, overwrite) for one run of a sweep; raises
    RunDirectoryError (before any run starts) for a directory that holds a run and neither flag."""
    if not resume:
        rundir.prepare(out, None, overwrite)
        return out, None, None, overwrite
    if overwrite:
        rundir.prepare(out, "auto", overwrite)  # says that the two flags exclude each other
    found = rundir.inspect(out)
    if found.status in ("ok", "oom"):
        return out, _kept_result(out, found.status), None, False
    if last_complete_checkpoint(out) is not None:
        return out, None, rundir.AUTO, False
    if found.holds_a_run:
        logger.info("sweep: %s has no complete checkpoint; it starts again from step 0", out)
    return out, None, None, True


def _kept_result(out: Path, status: str) -> RunResult:
    """The result of a run of an earlier sweep, read back from its summary.json."""
    from hf_optim.monitor.runfiles import load_run

    summary = load_run(out).summary
    optimizer = summary.get("optimizer") or {}
    name = f"{str(optimizer.get('module', '')).split('.')[0]}.{optimizer['name']}" if optimizer.get("name") else None
    return RunResult(out, status, name, summary.get("train_loss_run_mean"), global_step=summary.get("global_step"))
