"""TrainingMonitor: a TrainerCallback that logs loss, speed and memory of any Trainer run to files and plots."""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from transformers import TrainerCallback

from hf_optim.memory import state_memory
from hf_optim.monitor import runfiles
from hf_optim.monitor.accounting import (
    gradient_bytes,
    memory_breakdown,
    optimizer_info,
    trainable_gradient_estimate,
    unwrap_optimizer,
    weight_bytes,
)
from hf_optim.monitor.environment import hardware, versions
from hf_optim.monitor.sampling import MemorySampler
from hf_optim.monitor.series import auto_ema_beta, ema
from hf_optim.monitor.tokens import TokenCounter

logger = logging.getLogger("hf_optim")

# Keys of the Trainer's logs that become named fields of a record; any other scalar goes under "trainer_logs".
_TRAIN_KEYS = {"loss": "loss", "grad_norm": "grad_norm", "learning_rate": "learning_rate", "epoch": "epoch"}
# The Trainer's end-of-training log has the run-mean "train_loss" and no "loss". ("train_runtime" is no marker:
# with include_num_input_tokens_seen every log step carries it.)
_FINAL_KEY = "train_loss"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:4000]


def _state_fields(optimizer) -> dict:
    memory = state_memory(unwrap_optimizer(optimizer)) if optimizer is not None else None
    if memory is None:
        return {"optimizer_state_bytes": None, "optimizer_state_by_dtype": None,
                "optimizer_state_by_device": None, "optimizer_state_paged_bytes": None}
    return {"optimizer_state_bytes": memory.total_bytes, "optimizer_state_by_dtype": memory.by_dtype,
            "optimizer_state_by_device": memory.by_device, "optimizer_state_paged_bytes": memory.paged_bytes}


class TrainingMonitor(TrainerCallback):
    """Logs a training run to ``output_dir``: ``metrics.jsonl``, ``summary.json``, ``recipe.yaml`` and plots.

    Works with any ``transformers.Trainer`` (TRL's trainers included)::

        monitor = TrainingMonitor("runs/lamb8")
        trainer = SFTTrainer(..., callbacks=[monitor])
        try:
            trainer.train()
        except torch.OutOfMemoryError as exc:
            monitor.record_oom(exc)  # summary.json says "oom", so `compare` shows the run as an OOM row
            raise

    Each Trainer log step becomes one ``metrics.jsonl`` line: loss, grad norm, lr, tokens/s, step time, memory
    (CUDA allocator current / window peak / run peak, % of the GPU, allocator retries and OOMs; NVML device
    usage; host RSS) and the optimizer-state footprint. On CPU every CUDA and NVML field is null. Only the main
    process (``state.is_world_process_zero``) writes files.

    Args:
        output_dir: directory for the files (created if needed); usually the Trainer's ``output_dir``.
        run_name: the run's label in plots and ``compare``. Default: the directory's name.
        recipe: the resolved recipe dict, written as ``recipe.yaml``; ``None`` writes no recipe. Default None.
        ema_beta: smoothing of the EMA loss (bias-corrected), in [0, 1); None picks ``1 - 10/points`` within
            [0, 0.9] from the number of logged losses (the value used is written to summary.json). Default None.
        reset_peak_stats: reset torch's CUDA peak counters at each log step to measure per-window peaks; False
            leaves them alone (window peaks are then null). Default True.
        synchronize: synchronize the CUDA device at the end of each step so step times measure the GPU's work,
            not the Python side's queueing. Default True.
        plots: draw ``loss.png``, ``memory.png`` and ``dashboard.png`` at the end of training (and on OOM).
            Default True.
        memory_sampler: where memory samples come from; default: built from the Trainer's device when training
            begins (CUDA + NVML on a GPU, host RSS only on CPU). For tests and custom devices.
    """

    def __init__(self, output_dir, run_name: str | None = None, recipe: dict | None = None, *,
                 ema_beta: float | None = None, reset_peak_stats: bool = True, synchronize: bool = True,
                 plots: bool = True, memory_sampler: MemorySampler | None = None):
        if ema_beta is not None and not 0.0 <= ema_beta < 1.0:
            raise ValueError(f"TrainingMonitor ema_beta={ema_beta!r} is not valid: use a number in [0, 1)")
        if plots:
            from hf_optim.monitor.plots import require_matplotlib

            require_matplotlib()  # fail now, not after hours of training
        self.output_dir = Path(output_dir)
        self.run_name = run_name or self.output_dir.resolve().name
        self.recipe = recipe
        self.ema_beta = ema_beta
        self.reset_peak_stats = reset_peak_stats
        self.synchronize = synchronize
        self.plots = plots
        self.sampler = memory_sampler
        self.tokens = TokenCounter()
        self.device: torch.device | None = None
        self.writer = True  # becomes state.is_world_process_zero
        self.optimizer = None
        self.model = None
        self.trainer_args: dict = {}
        self.phases: dict[str, dict] = {}
        self.weights: dict[str, int] = {}
        self.gradients: dict[str, int] = {}
        self.losses: list[float] = []
        self.final_metrics: dict = {}
        self.started_at: str | None = None
        self._t_start = None
        self._t_step = None
        self._first_step = None
        self._window = {"steps": 0, "seconds": 0.0, "tokens_at_start": 0}
        self._run_steps = 0
        self._run_seconds = 0.0
        # The first step (compilation, optimizer state creation) is kept apart from the steady-state means.
        self._first_step_seconds: float | None = None
        self._tokens_after_first_step = 0
        self._tokens_at_begin = 0
        self._trainer_counts_tokens = False
        self._last_tokens = 0
        self._global_step = 0
        self._recipe_written = False
        self.error: dict | None = None
        self._in_step = False
        self._oom_step: int | None = None
        # A run resumed from a checkpoint continues the files of the run it resumes: time and tokens go on from the
        # last record kept, and the summary remembers where this process took over.
        self._resumed_at: int | None = None
        self._time_offset = 0.0
        self._tokens_offset = 0
        self._end_status = "ok"
        self._signal: str | None = None
        self._process: dict | None = None
        self._open = False  # summary.json says "running": the atexit hook records how the process ended

    # ---- Trainer events ---------------------------------------------------------------------------------------

    def on_init_end(self, args, state, control, model=None, **kwargs):
        self._bind(args, state, model)
        self._phase("model_loaded", state)

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._bind(args, state, model)
        self.optimizer = optimizer
        self.weights = weight_bytes(model) if model is not None else {}
        self.sampler.start_run()
        self._trainer_counts_tokens = getattr(args, "include_num_input_tokens_seen", "no") not in ("no", False, None)
        if model is not None and not self._trainer_counts_tokens:
            self.tokens.attach(model)
        self._tokens_at_begin = self._tokens_seen(state)
        self._window = {"steps": 0, "seconds": 0.0, "tokens_at_start": self._tokens_at_begin}
        self._first_step = state.global_step + 1
        # A monitor may see several train() calls: each starts its own run record.
        self.losses, self.gradients, self.final_metrics = [], {}, {}
        self.phases = {name: snapshot for name, snapshot in self.phases.items() if name == "model_loaded"}
        self.error, self._oom_step, self._run_steps, self._run_seconds = None, None, 0, 0.0
        self._first_step_seconds, self._tokens_after_first_step = None, 0
        self._end_status = "ok"
        self._resumed_at = state.global_step or None
        self._time_offset, self._tokens_offset = 0.0, 0
        self.started_at = _now()
        self._t_start = time.perf_counter()
        self._signal = None
        self._process = runfiles.this_process()
        if self.writer:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            self._start_metrics_file(state.global_step)
            self._write_recipe_once()
        if self._resumed_at is not None:
            self._phase("resumed", state)
        else:
            self._phase("train_begin", state)
        self._write_summary(runfiles.RUNNING)

    def on_step_begin(self, args, state, control, **kwargs):
        self._t_step = time.perf_counter()
        self._in_step = True

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):
        # Gradients are still held here (the Trainer zeroes them after the optimizer step).
        if model is not None:
            now = gradient_bytes(model)
            if sum(now.values()) > sum(self.gradients.values()):
                self.gradients = now

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        self._in_step = False
        if self.synchronize and self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self._t_step is not None:
            seconds = time.perf_counter() - self._t_step
            self._window["steps"] += 1
            self._window["seconds"] += seconds
            if self._run_steps == 0:
                self._first_step_seconds = seconds
                self._tokens_after_first_step = self._tokens_seen(state) - self._tokens_at_begin
            self._run_steps += 1
            self._run_seconds += seconds
        self._global_step = state.global_step
        if optimizer is not None:
            self.optimizer = optimizer
        if state.global_step == self._first_step and self._resumed_at is None:
            self._phase("after_first_step", state)  # the optimizer state now exists (a resume loads it before)

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = dict(logs or {})
        self._global_step = state.global_step
        if _FINAL_KEY in logs and "loss" not in logs:
            self.final_metrics = logs
            return
        if "loss" in logs:
            record = self._train_record(state, logs)
        elif any(key.startswith("eval_") for key in logs):
            record = {"kind": "eval", "step": state.global_step, "epoch": logs.get("epoch"),
                      "time_s": self._elapsed(), **{k: v for k, v in logs.items() if k != "epoch"}}
        else:
            return
        if self.writer:
            runfiles.append_record(self.output_dir, record)

    def on_train_end(self, args, state, control, **kwargs):
        self._global_step = state.global_step
        self._phase("end" if self._end_status == "ok" else self._end_status, state)
        self.tokens.detach()
        self._write_summary(self._end_status)
        self._draw()

    # ---- outside the Trainer's events ---------------------------------------------------------------------------

    @property
    def in_progress(self) -> bool:
        """summary.json says ``running``: training began and no end has been recorded yet."""
        return self._open

    def mark_interrupted(self) -> None:
        """Training is being stopped before its last step (Ctrl-C): the summary written when it ends says
        ``"status": "interrupted"`` instead of ``"ok"``."""
        self._end_status = "interrupted"

    def record_interrupt(self) -> Path:
        """Record a run stopped by an exception outside the Trainer's events (a ``KeyboardInterrupt``):
        ``summary.json`` gets ``"status": "interrupted"``, the last step that ended and a memory snapshot; plots are
        drawn from the steps logged so far. Returns the summary's path."""
        return self._record_stop("interrupted", self._global_step)

    def record_failure(self, exc: BaseException) -> Path:
        """Record that training stopped on an exception: ``summary.json`` gets ``"status": "failed"`` and the error
        (type and first line; ``"interrupted"`` for a ``KeyboardInterrupt``), the last step that ended, a memory
        snapshot and the plots. Returns the summary's path. A process that ends on an uncaught exception while the
        summary says ``running`` records this itself (at exit), so a script need not call it."""
        if isinstance(exc, KeyboardInterrupt):
            return self.record_interrupt()
        self.error = {"type": type(exc).__name__, "message": _first_line(exc)}
        return self._record_stop("failed", self._global_step)

    def record_signal(self, signum: int) -> Path:
        """Record that a signal (SIGTERM, SIGHUP) ended training: ``summary.json`` gets ``"status": "killed"`` and
        ``"signal": "SIGTERM"``, the last step that ended, a memory snapshot and the plots. Returns the summary's
        path. (SIGKILL cannot be caught: a reader tells that case by the process being gone,
        :func:`hf_optim.monitor.runfiles.effective_status`.)"""
        self._signal = signal.Signals(signum).name
        return self._record_stop("killed", self._global_step)

    def record_oom(self, exc: BaseException) -> Path:
        """Record that training ran out of memory: ``summary.json`` gets ``"status": "oom"``, the error, a memory
        snapshot taken now (the allocator's peak shows what the failing step reached) and what is known so far;
        plots are drawn from the steps logged before the failure. Returns the summary's path.

        Args:
            exc: the exception training raised (``torch.OutOfMemoryError`` or another out-of-memory error).
        """
        # The step that failed: the one under way, or the last one if it failed after its end (in a callback).
        self._oom_step = self._global_step + 1 if self._in_step else self._global_step
        self.error = {"type": type(exc).__name__, "message": str(exc)[:4000]}
        return self._record_stop("oom", self._oom_step)

    def _record_stop(self, status: str, step: int) -> Path:
        """Training stopped outside the Trainer's events: a ``status`` phase snapshot at ``step``, the summary, the
        plots."""
        self.tokens.detach()
        if self.sampler is None:
            self.sampler = MemorySampler.for_device(self.device or torch.device("cpu"),
                                                    reset_peak_stats=self.reset_peak_stats)
        self.phases[status] = self._snapshot(step)
        if self.writer:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            self._write_recipe_once()
        self._write_summary(status)
        self._draw()
        return self.output_dir / runfiles.SUMMARY

    def _at_exit(self) -> None:
        """The process is ending while summary.json still says ``running`` (a script whose ``train()`` raised, or
        that exited inside training): record how, from the exception Python is reporting, if any."""
        if not self._open or self._process is None or self._process.get("pid") != os.getpid():
            return  # finished, or a forked child that inherited the hook
        exc = getattr(sys, "last_value", None)
        try:
            if isinstance(exc, BaseException):
                self.record_failure(exc)
            else:
                self.error = {"type": "exit", "message": "the process exited during training without an exception"}
                self._record_stop("failed", self._global_step)
        except Exception:  # noqa: BLE001 - at exit, a failure to record must not hide the error being reported
            logger.debug("could not record how the run ended", exc_info=True)

    # ---- internals ----------------------------------------------------------------------------------------------

    def _bind(self, args, state, model) -> None:
        self.writer = bool(getattr(state, "is_world_process_zero", True))
        if model is not None:
            self.model = model
        if self.device is None:
            self.device = torch.device(getattr(args, "device", "cpu"))
        if self.sampler is None:
            self.sampler = MemorySampler.for_device(self.device, reset_peak_stats=self.reset_peak_stats)
        keys = ("max_steps", "num_train_epochs", "per_device_train_batch_size", "gradient_accumulation_steps",
                "learning_rate", "lr_scheduler_type", "optim", "optim_args", "bf16", "fp16", "gradient_checkpointing",
                "logging_steps", "seed", "max_grad_norm", "weight_decay")
        self.trainer_args = {k: getattr(args, k) for k in keys if hasattr(args, k)}

    def _speed(self) -> dict:
        """Steady-state means: over the steps after the first, which includes compilation and the creation of
        the optimizer state (a one-step run reports that step)."""
        steady_steps = self._run_steps - 1
        steady_seconds = self._run_seconds - (self._first_step_seconds or 0.0)
        if steady_steps > 0 and steady_seconds > 0:
            step_time = steady_seconds / steady_steps
            tokens_per_s = (self._last_tokens - self._tokens_after_first_step) / steady_seconds
        else:
            step_time = self._run_seconds / self._run_steps if self._run_steps else None
            tokens_per_s = self._last_tokens / self._run_seconds if self._run_seconds > 0 else None
        return {
            "mean_tokens_per_s": tokens_per_s,
            "mean_step_time_s": step_time,
            "first_step_time_s": self._first_step_seconds,
            "speed_basis": "steps after the first (the first, reported apart, includes compilation and state creation)",
        }

    def _tokens_seen(self, state) -> int:
        if self._trainer_counts_tokens:
            return int(getattr(state, "num_input_tokens_seen", 0) or 0)
        return self.tokens.total

    def _elapsed(self) -> float | None:
        if self._t_start is None:
            return None
        return round(self._time_offset + time.perf_counter() - self._t_start, 4)

    def _snapshot(self, step: int) -> dict:
        snapshot = {"step": step, "time_s": self._elapsed(), **self.sampler.sample(end_window=False)}
        snapshot.update(_state_fields(self.optimizer))
        return snapshot

    def _phase(self, name: str, state) -> None:
        self.phases[name] = self._snapshot(state.global_step)

    def _train_record(self, state, logs: dict) -> dict:
        tokens_now = self._tokens_seen(state)
        window = self._window
        window_tokens = tokens_now - window["tokens_at_start"]
        record = {"kind": "train", "step": state.global_step, "time_s": self._elapsed()}
        record.update({field: logs.get(key) for key, field in _TRAIN_KEYS.items()})
        record.update({
            "steps_in_window": window["steps"],
            "step_time_s": window["seconds"] / window["steps"] if window["steps"] else None,
            "tokens": window_tokens,
            "tokens_seen": self._tokens_offset + tokens_now - self._tokens_at_begin,
            "tokens_per_s": window_tokens / window["seconds"] if window["seconds"] > 0 else None,
        })
        record.update(self.sampler.sample(end_window=True))
        record.update(_state_fields(self.optimizer))
        extra = {k: v for k, v in logs.items() if k not in _TRAIN_KEYS and isinstance(v, (int, float))}
        if extra:
            record["trainer_logs"] = extra
        if isinstance(logs.get("loss"), (int, float)):
            self.losses.append(float(logs["loss"]))
        self._window = {"steps": 0, "seconds": 0.0, "tokens_at_start": tokens_now}
        self._last_tokens = tokens_now - self._tokens_at_begin
        return record

    def _start_metrics_file(self, global_step: int) -> None:
        path = self.output_dir / runfiles.METRICS
        if global_step == 0 or not path.exists():
            path.write_text("", encoding="utf-8")
            return
        # Resuming from a checkpoint: keep what was logged up to the checkpoint and append to it. The steps after
        # the checkpoint are about to be redone: their records go, and so does a last line a killed run cut short.
        records = runfiles.read_records(self.output_dir)
        kept = [r for r in records if r.get("step", 0) <= global_step]
        if len(kept) < len(records) or not path.read_bytes().endswith(b"\n"):
            runfiles.rewrite_records(self.output_dir, kept)
        train = [r for r in kept if r.get("kind") == "train"]
        # The final and EMA loss cover the whole run, the logged steps before the checkpoint included.
        self.losses = [r["loss"] for r in train if r.get("loss") is not None]
        self._time_offset = max((r.get("time_s") or 0.0 for r in kept), default=0.0)
        if self._trainer_counts_tokens:  # the Trainer's count was restored with its state: it is the run's total
            self._tokens_offset = self._tokens_at_begin
        else:  # counted by this process's hook: go on from the last record (steps after it are not counted)
            self._tokens_offset = max((r.get("tokens_seen") or 0 for r in train), default=0)
        self._last_tokens = 0
        self._keep_earlier_phases(global_step)

    def _keep_earlier_phases(self, global_step: int) -> None:
        """The phase snapshots of the run being resumed, up to its checkpoint, stay in the summary (memory.png marks
        them); this process's model_loaded (taken at step 0, before the checkpoint was loaded) is dropped."""
        summary = self.output_dir / runfiles.SUMMARY
        try:
            earlier = json.loads(summary.read_text(encoding="utf-8")) if summary.exists() else {}
        except ValueError:
            earlier = {}
        self.phases.pop("model_loaded", None)
        for name, snapshot in (earlier.get("phases") or {}).items():
            step = snapshot.get("step") if isinstance(snapshot, dict) else None
            if step is not None and step <= global_step:
                # a repeated phase (a second interruption or resume) keeps the earlier one under its step
                self.phases[name if name in ("model_loaded", "train_begin", "after_first_step")
                            else f"{name.split('_at_')[0]}_at_{step}"] = snapshot

    def _write_recipe_once(self) -> None:
        if self.recipe is not None and not self._recipe_written:
            runfiles.write_recipe(self.output_dir, self.recipe)
            self._recipe_written = True

    def _summary(self, status: str) -> dict:
        state = state_memory(unwrap_optimizer(self.optimizer)) if self.optimizer is not None else None
        if not self.gradients and self.model is not None:
            gradients, gradient_source = trainable_gradient_estimate(self.model), "estimate_from_trainable_params"
        else:
            gradients, gradient_source = self.gradients, "measured"
        peak = self.sampler.peak_bytes() if self.sampler is not None else None
        basis = self.sampler.basis if self.sampler is not None else "host_rss_peak_sampled"
        breakdown = memory_breakdown(basis=basis, peak_bytes=peak or None, weights=self.weights,
                                     gradients=gradients, state=state)
        breakdown["gradient_source"] = gradient_source
        beta = self.ema_beta if self.ema_beta is not None else auto_ema_beta(len(self.losses))
        smoothed = ema(self.losses, beta) if self.losses else []
        cuda = self.sampler.cuda if self.sampler is not None else None
        nvml = self.sampler.nvml if self.sampler is not None else None
        return {
            "run_name": self.run_name,
            "status": status,
            "error": self.error,
            "signal": self._signal if status == "killed" else None,
            "process": self._process,
            "started_at": self.started_at,
            "resumed_at_step": self._resumed_at,
            "updated_at": _now(),
            "global_step": self._global_step,
            "oom_step": self._oom_step,
            "final_loss": self.losses[-1] if self.losses else None,
            "ema_loss": smoothed[-1] if smoothed else None,
            "ema_beta": beta,
            "train_loss_run_mean": self.final_metrics.get("train_loss"),
            "trainer_final_metrics": self.final_metrics or None,
            "tokens_seen": self._tokens_offset + self._last_tokens,
            "tokens_source": "trainer" if self._trainer_counts_tokens else "forward_hook",
            **self._speed(),
            "optimizer": optimizer_info(self.optimizer),
            "optimizer_state": state.as_dict() if state is not None else None,
            "memory_breakdown": breakdown,
            "peaks": {
                "cuda_peak_allocated_run_bytes": cuda.run_peak_allocated if cuda else None,
                "cuda_peak_reserved_run_bytes": cuda.run_peak_reserved if cuda else None,
                "cuda_capacity_bytes": cuda.capacity_bytes if cuda else None,
                "host_rss_peak_sampled_bytes": self.sampler.host_rss_peak if self.sampler is not None else None,
                "nvml_peak_used_sampled_bytes": self.sampler.nvml_peak if self.sampler is not None else None,
            },
            "nvml_error": nvml.error if nvml is not None else None,
            "phases": self.phases,
            "trainer_args": self.trainer_args,
            "versions": versions(),
            "hardware": hardware(self.device, nvml.driver_version() if nvml is not None else None),
        }

    def _write_summary(self, status: str) -> None:
        if self.writer:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            runfiles.write_json(self.output_dir / runfiles.SUMMARY, self._summary(status))
            opening = status == runfiles.RUNNING
            if opening and not self._open:
                atexit.register(self._at_exit)
            elif not opening and self._open:
                atexit.unregister(self._at_exit)
            self._open = opening

    def _draw(self) -> None:
        if not (self.plots and self.writer):
            return
        from hf_optim.monitor.plots import plot_run

        plot_run(self.output_dir)
