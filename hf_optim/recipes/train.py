"""``hf-optim train``: one run of a recipe, or a sweep over one key (optimizers) followed by a comparison."""

from __future__ import annotations

import gc
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from hf_optim.checkpoints import checkpoint_problems, last_complete_checkpoint
from hf_optim.memory import StateMemory, state_memory
from hf_optim.monitor.accounting import unwrap_optimizer
from hf_optim.recipes import rundir
from hf_optim.recipes.build import build_datasets, build_lora_config, build_model, build_sft_config, build_tokenizer
from hf_optim.recipes.console import quiet_console, quiet_progress, ticking
from hf_optim.recipes.errors import RecipeError, RecipeIssue
from hf_optim.recipes.hardware import resolve_auto
from hf_optim.recipes.loading import COMMAND_LINE
from hf_optim.recipes.schema import Recipe

logger = logging.getLogger("hf_optim")


@dataclass
class RunResult:
    """What one run produced.

    Attributes:
        output_dir: the run directory (recipe.yaml, the monitor's files, the saved model or adapter).
        status: ``"ok"``, ``"oom"``, ``"interrupted"`` (Ctrl-C) or ``"killed"`` (SIGTERM, SIGHUP; see
            :mod:`hf_optim.recipes.interrupt`).
        optimizer: the optimizer class that ran (``hf_optim.PagedAdamW8bit``), None when it never got built.
        train_loss: the Trainer's mean training loss over the steps this call ran (all of them unless it resumed),
            None after an OOM or a forced stop.
        state: the optimizer-state footprint at the end of training (``hf_optim.state_memory``).
        state_dtypes: per trainable tensor, (elements, dtype of its first state tensor), at the end of training.
        global_step: the last optimizer step that ended (None when training never started).
        resumed_from: the checkpoint this run resumed from, None for a run from step 0.
        checkpoint: after an interruption, the checkpoint a resume starts from (the one saved when it stopped, else
            the last complete one), None when there is none.
        memory: a random-weights run's measured memory by component beside the estimate (the contents of
            ``memory_by_component.json``, :mod:`hf_optim.recipes.real_shape`), None for other runs.
        signal: the signal that stopped a ``"killed"`` run (``"SIGTERM"``), else None.
        exit_status: the exit status a command reports for a run that was stopped (130 after Ctrl-C, 128 + the
            signal's number after SIGTERM or SIGHUP), else None.
    """

    output_dir: Path
    status: str
    optimizer: str | None = None
    train_loss: float | None = None
    state: StateMemory | None = None
    state_dtypes: list[tuple[int, str]] = field(default_factory=list)
    global_step: int | None = None
    resumed_from: str | None = None
    checkpoint: str | None = None
    memory: dict | None = None
    signal: str | None = None
    exit_status: int | None = None


def default_output_dir(recipe: Recipe) -> Path:
    """``training.output_dir`` when the recipe sets it, else ``runs/<recipe name>``."""
    configured = recipe.training.get("output_dir")
    return Path(configured) if configured else Path("runs") / Path(recipe.source).stem


def write_recipe(recipe: Recipe, output_dir: Path) -> Path:
    """Write the resolved recipe to ``output_dir/recipe.yaml``: it reruns the same job with ``hf-optim train``."""
    output_dir.mkdir(parents=True, exist_ok=True)
    header = [f"# Resolved from {recipe.source} by hf-optim train.", "# It reruns this job: hf-optim train recipe.yaml"]
    header += [f"# {note}" for note in recipe.notes]
    path = output_dir / "recipe.yaml"
    body = yaml.safe_dump(recipe.to_dict(), sort_keys=False, default_flow_style=False)
    path.write_text("\n".join(header) + "\n" + body)
    return path


def class_path(optimizer: torch.optim.Optimizer) -> str:
    """``hf_optim.AdamW8bit``: the class that steps, under accelerate's and DeepSpeed's wrappers."""
    cls = type(unwrap_optimizer(optimizer))
    module = cls.__module__.split(".")[0]
    return f"{module}.{cls.__qualname__}"


def state_dtypes(optimizer: torch.optim.Optimizer) -> list[tuple[int, str]]:
    """(elements, dtype) of each parameter's per-element state (uint8 for 8-bit state, float32 for 32-bit)."""
    out = []
    for param, state in optimizer.state.items():
        per_element = [v for v in state.values() if isinstance(v, torch.Tensor) and v.numel() >= param.numel() > 0
                       and v.numel() % param.numel() == 0]
        if per_element:
            out.append((param.numel(), str(per_element[0].dtype).removeprefix("torch.")))
    return out


def _optimizer_reporter(found: dict):
    from transformers import TrainerCallback

    from hf_optim.integrations.launch_check import unapplied_sharding

    class OptimizerReport(TrainerCallback):
        """Logs the optimizer class the Trainer built from ``training.optim`` (at train start; hf_optim's classes
        log their own line when built) and keeps its state footprint (at train end). At train start it also says
        (rank 0, one line) when the launch asked for FSDP and none applied."""

        def on_train_begin(self, args, state, control, optimizer=None, model=None, **kwargs):
            unapplied = unapplied_sharding(args, model, args.world_size)
            if unapplied and state.is_world_process_zero:
                logger.warning("%s", unapplied)
            if optimizer is not None:
                found["optimizer"] = class_path(optimizer)
                if not found["optimizer"].startswith("hf_optim."):
                    logger.info("optimizer: training.optim=%r -> %s", str(getattr(args.optim, "value", args.optim)),
                                found["optimizer"])

        def on_train_end(self, args, state, control, optimizer=None, **kwargs):
            inner = unwrap_optimizer(optimizer) if optimizer is not None else None
            if inner is None:
                return
            found["state"] = state_memory(inner)
            found["state_dtypes"] = state_dtypes(inner)

    return OptimizerReport()


class KeepAdapterDtypes:
    """Trainer mixin: resuming from a checkpoint leaves every trainable parameter in the dtype it had.

    TRL's SFTTrainer keeps a QLoRA adapter in bf16 (the QLoRA paper's choice) and the checkpoint stores it so, but
    the Trainer loads it back with peft's ``load_adapter``, whose default ``autocast_adapter_dtype=True`` turns it
    into float32: a resumed QLoRA run went on training another model (float32 adapter, other rounding) than the
    run it resumed. Casting back is exact: the values were bf16 when they were saved.
    """

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        target = self.model if model is None else model
        dtypes = {name: p.dtype for name, p in target.named_parameters() if p.requires_grad}
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        for name, param in target.named_parameters():
            if name in dtypes and param.dtype != dtypes[name]:
                param.data = param.data.to(dtypes[name])


def run(recipe: Recipe, output_dir: str | Path | None = None, quiet: bool = False, resume: str | None = None,
        overwrite: bool = False, measure=None) -> RunResult:
    """Train ``recipe`` once (``auto`` resolved for this machine) into ``output_dir``.

    Args:
        recipe: the validated recipe.
        output_dir (default None): the run directory; None: :func:`default_output_dir`.
        quiet (bool, default False): see :func:`hf_optim.recipes.console.quiet_console`.
        resume (default None): continue a run: ``"auto"`` (the last complete checkpoint of ``output_dir``), a
            ``checkpoint-N`` folder or a run directory; ``training.resume_from_checkpoint`` says the same from the
            recipe. None: start at step 0.
        overwrite (bool, default False): start again at step 0 in a directory that holds a run, deleting its
            checkpoints and logs first (:func:`hf_optim.recipes.rundir.clear`).
        measure (default None): a random-weights run (:mod:`hf_optim.recipes.real_shape`, which passes its
            ``RandomWeightsRun``): called with the resolved recipe, it gives the callback that measures, builds the
            tokenizer, data and model, and writes the report; no model is saved. None: a normal run.

    A directory that holds a run (checkpoints, logged steps or a saved model) is never written over without
    ``resume`` or ``overwrite``: :class:`~hf_optim.recipes.rundir.RunDirectoryError` says so, before anything is
    loaded. A CUDA out-of-memory error is recorded by the monitor and returned as ``status="oom"``; Ctrl-C returns
    ``status="interrupted"``, SIGTERM or SIGHUP ``status="killed"`` (:mod:`hf_optim.recipes.interrupt`); any other
    error is recorded in ``summary.json`` as ``"status": "failed"`` with its first line once training has begun,
    propagates, and removes the directory if this call created it and nothing was logged in it yet.
    """
    with quiet_console(quiet):
        return _run(recipe, output_dir, quiet, resume, overwrite, measure)


def resume_request(recipe: Recipe, resume: str | None) -> str | None:
    """``resume`` or the recipe's ``training.resume_from_checkpoint`` (taken out of the recipe: the Trainer reads it
    only from ``train()``'s argument, and recipe.yaml reruns the job, not the resume)."""
    configured = recipe.training.pop("resume_from_checkpoint", None)
    if resume is not None and configured is not None and resume != configured:
        raise rundir.RunDirectoryError(f"--resume {resume} and training.resume_from_checkpoint={configured} name "
                                       "different checkpoints: give one of them")
    return resume if resume is not None else configured


def _run(recipe: Recipe, output_dir: str | Path | None, quiet: bool, resume: str | None,
         overwrite: bool, measure=None) -> RunResult:
    from trl import SFTTrainer

    from hf_optim.monitor import TrainingMonitor
    from hf_optim.recipes.interrupt import EXIT_STATUS, GracefulStop, Terminated, handling_termination

    class RecipeTrainer(KeepAdapterDtypes, SFTTrainer):
        """SFTTrainer whose resume keeps the adapter's dtype."""

    recipe = resolve_auto(recipe)
    out = Path(output_dir) if output_dir is not None else default_output_dir(recipe)
    checkpoint = rundir.prepare(out, resume_request(recipe, resume), overwrite)
    created = not out.exists()
    if overwrite and rundir.inspect(out).holds_a_run:
        logger.info("--overwrite: deleting the checkpoints and logs of the run in %s", out)
        rundir.clear(out)
    if checkpoint is not None:
        logger.info("resuming from %s", checkpoint)
    recipe.training["output_dir"] = str(out)  # recipe.yaml names where this run really went
    write_recipe(recipe, out)
    for note in recipe.notes:
        logger.info("%s", note)
    found: dict = {}
    callbacks = [_optimizer_reporter(found)]
    monitor = None
    if recipe.logging.monitor:
        monitor = TrainingMonitor(out, run_name=recipe.logging.run_name, recipe=recipe.to_dict())
        callbacks.insert(0, monitor)
    measuring = measure(recipe) if measure is not None else None
    # a random-weights run saves nothing: Ctrl-C stops it after the step under way, without a checkpoint
    stop = GracefulStop(monitor, checkpoint=measuring is None)
    callbacks.append(stop)
    if measuring is not None:
        callbacks.append(measuring.probe)
    try:
        if measuring is not None:
            tokenizer, train_data, model = measuring.build()
            eval_data = None
        else:
            tokenizer = build_tokenizer(recipe)
            train_data, eval_data = build_datasets(recipe)
            model = build_model(recipe)
        trainer = RecipeTrainer(model=model, args=build_sft_config(recipe, out), train_dataset=train_data,
                                eval_dataset=eval_data, processing_class=tokenizer,
                                peft_config=build_lora_config(recipe), callbacks=callbacks)
        del model
        progress = quiet_progress(trainer) if quiet else None
        detail = measuring.probe.progress_detail if measuring is not None else None
        with stop.handling_sigint(), handling_termination(), ticking(progress, detail):
            try:
                output = trainer.train(resume_from_checkpoint=checkpoint)
            except (KeyboardInterrupt, Terminated) as end:  # a second Ctrl-C, or SIGTERM: the step under way is lost
                step = trainer.state.global_step
                what = end.name if isinstance(end, Terminated) else "Ctrl-C"
                if rundir.remove_partial_checkpoint(out, step):
                    logger.warning("removed checkpoint-%d: %s cut its writing short", step, what)
                if isinstance(end, Terminated):
                    if monitor is not None:
                        monitor.record_signal(end.signum)
                    return RunResult(out, "killed", found.get("optimizer"), global_step=step, resumed_from=checkpoint,
                                     checkpoint=last_complete_checkpoint(out), signal=end.name,
                                     exit_status=end.exit_status)
                if monitor is not None:
                    monitor.record_interrupt()
                return RunResult(out, "interrupted", found.get("optimizer"), global_step=step,
                                 resumed_from=checkpoint, checkpoint=last_complete_checkpoint(out),
                                 exit_status=EXIT_STATUS)
    except torch.OutOfMemoryError as exc:
        logger.error("out of memory: %s", str(exc).splitlines()[0] if str(exc) else "CUDA out of memory")
        if monitor is not None:
            monitor.record_oom(exc)
        memory = measuring.finish(out, [], "oom") if measuring is not None else None
        return RunResult(out, "oom", found.get("optimizer"), resumed_from=checkpoint, memory=memory)
    except KeyboardInterrupt:  # before training began: nothing to keep
        rundir.remove_failed_attempt(out, created)
        return RunResult(out, "interrupted", resumed_from=checkpoint, exit_status=EXIT_STATUS)
    except BaseException as exc:
        if monitor is not None and monitor.in_progress:  # summary.json says running: say how it ended instead
            monitor.record_failure(exc)
        rundir.remove_failed_attempt(out, created)
        raise
    done = (output.training_loss, found.get("state"), found.get("state_dtypes", []), trainer.state.global_step,
            checkpoint)
    if stop.stopped_at is not None:
        saved = out / f"checkpoint-{stop.stopped_at}"
        resume_point = str(saved) if saved.is_dir() and not checkpoint_problems(saved) else \
            last_complete_checkpoint(out)
        memory = None
        if measuring is not None:  # what the steps that ran measured is still worth its report
            memory = measuring.finish(out, _logged_losses(trainer), "interrupted")
        return RunResult(out, "interrupted", found.get("optimizer"), *done, checkpoint=resume_point, memory=memory,
                         exit_status=EXIT_STATUS)
    if measuring is not None:  # random weights: nothing worth saving, the measurement is the result
        return RunResult(out, "ok", found.get("optimizer"), *done,
                         memory=measuring.finish(out, _logged_losses(trainer), "ok"))
    trainer.save_model(str(out))
    return RunResult(out, "ok", found.get("optimizer"), *done)



def _logged_losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def sweep_values(spec: str) -> tuple[str, list[str]]:
    """``"training.optim=adamw_torch,paged_adamw_8bit"`` -> (``"training.optim"``, ``[...]``)."""
    key, sep, values = spec.partition("=")
    items = [v.strip() for v in values.split(",") if v.strip()]
    if not sep or not key.strip() or not items:
        raise RecipeError([RecipeIssue(COMMAND_LINE, "--sweep", f"takes KEY=V1,V2,..., e.g. training.optim=adamw_torch,"
                                       f"paged_adamw_8bit; got {spec!r}")])
    return key.strip(), items


def run_dir_name(value: str) -> str:
    """A directory name for one sweep value."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", value).strip("_") or "value"


def free_memory() -> None:
    """Release what a finished (or out-of-memory) run left, before the next run of a sweep starts."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
