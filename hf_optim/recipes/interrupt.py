"""Ctrl-C during ``hf-optim train``: finish the optimizer step under way, save a checkpoint, stop.

- The first SIGINT asks the Trainer to stop at the end of the optimizer step under way. It then saves
  ``checkpoint-N`` through its own checkpoint code, at the same point of its loop as a periodic save (weights,
  optimizer state, scheduler, RNG states, ``trainer_state.json`` last), so resuming from it is exact, and returns.
  Saving at a step boundary, not at the instant of the signal, is what makes that checkpoint consistent: in the
  middle of a step the gradients, the optimizer state and the RNG streams belong to different steps.
- A second SIGINT stops at once (``KeyboardInterrupt``): the step under way is lost, and a checkpoint that was
  half written by then is removed by the caller, so every ``checkpoint-N`` is complete or absent.
- Any further SIGINT, while the run's files are written after that, exits the process with status 130 at once.

SIGTERM (what ``kill``, a job scheduler or a container runtime sends to stop a process) and SIGHUP (the terminal
closed) stop training at once: the handler raises :class:`Terminated`, the caller removes a checkpoint cut short,
records ``"status": "killed"`` with the signal's name in ``summary.json`` and exits with 128 + the signal's number,
as the default action would. No checkpoint is saved: a scheduler's grace period before SIGKILL is often shorter
than a save.

Under torch.distributed (more than one process) a stop requested in one process at the end of step N could reach
another after its step N+1, and the two would wait on each other forever: there the first SIGINT stops at once, as
the second does in a single process. The handler is only installed from the main thread (Python's rule), and only
acts in the process that installed it (forked dataloader workers ignore SIGINT; the main process ends them).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator

from transformers import TrainerCallback

logger = logging.getLogger("hf_optim")

EXIT_STATUS = 130  # 128 + SIGINT, what a shell reports for a process ended by Ctrl-C


def _distributed() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


TERMINATING_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


class Terminated(BaseException):
    """Raised in the main thread by SIGTERM or SIGHUP during training (a ``BaseException``, like
    ``KeyboardInterrupt``, so that no ``except Exception`` on the way up swallows it)."""

    def __init__(self, signum: int):
        self.signum = signum
        self.name = signal.Signals(signum).name
        super().__init__(f"stopped by {self.name}")

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


@contextlib.contextmanager
def handling_termination() -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP raise :class:`Terminated` in the main thread (only in the process that
    entered it: a forked dataloader worker keeps the handler but does not act on it); the previous handlers come
    back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pid = os.getpid()

    def _raise(signum, frame):
        if os.getpid() == pid:
            raise Terminated(signum)

    previous = {signum: signal.signal(signum, _raise) for signum in TERMINATING_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


class GracefulStop(TrainerCallback):
    """Turns a first Ctrl-C into a stop with a checkpoint at the end of the current optimizer step.

    Args:
        monitor (default None): a :class:`~hf_optim.monitor.TrainingMonitor` to tell (``mark_interrupted``), so that
            its summary says ``"interrupted"``.
        checkpoint (bool, default True): save a checkpoint where it stops; False stops at the end of the step
            without one (a random-weights run, whose weights are not worth saving and cannot be resumed).

    Attributes:
        requested: a stop was asked for (first SIGINT).
        forced: a second SIGINT stopped training at once.
        stopped_at: the step after which the Trainer stopped and saved a checkpoint; None when training ran to its
            end (a stop asked for after the last step changes nothing).
        last_step: the last optimizer step that ended.
    """

    def __init__(self, monitor=None, checkpoint: bool = True):
        self.monitor = monitor
        self.checkpoint = checkpoint
        self.requested = False
        self.forced = False
        self.stopped_at: int | None = None
        self.last_step = 0
        self._pid = os.getpid()

    # ---- Trainer events ---------------------------------------------------------------------------------------

    def on_train_begin(self, args, state, control, **kwargs):
        self.last_step = state.global_step

    def on_step_end(self, args, state, control, **kwargs):
        self.last_step = state.global_step
        if self.requested and self.stopped_at is None and state.global_step < state.max_steps:
            control.should_training_stop = True
            # whatever save_strategy says: this checkpoint is what a resume starts from
            control.should_save = self.checkpoint
            self.stopped_at = state.global_step
            if self.monitor is not None:
                self.monitor.mark_interrupted()

    # ---- the signal ---------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def handling_sigint(self) -> Iterator[GracefulStop]:
        """Within the block, SIGINT behaves as the module docstring says; the previous handler comes back after."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = signal.signal(signal.SIGINT, self._on_sigint)
        try:
            yield self
        finally:
            signal.signal(signal.SIGINT, previous)

    def _on_sigint(self, signum, frame) -> None:
        if os.getpid() != self._pid:  # a forked dataloader worker: the main process decides
            return
        if self.forced:  # third Ctrl-C, while the files of a stopped run are written: leave now
            sys.stderr.write(f"\ninterrupted at step {self.last_step}\n")
            sys.stderr.flush()
            os._exit(EXIT_STATUS)
        if self.requested or _distributed():
            self.forced = True
            raise KeyboardInterrupt
        self.requested = True
        if self.checkpoint:
            logger.warning("Ctrl-C: stopping after step %d with a checkpoint (Ctrl-C again to stop now, without one)",
                           self.last_step + 1)
        else:
            logger.warning("Ctrl-C: stopping after step %d (Ctrl-C again to stop now)", self.last_step + 1)
