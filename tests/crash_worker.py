"""A Trainer run that asks to be killed: test_crash_safety.py sends it SIGKILL when it prints ``KILL-ME``.

``python tests/crash_worker.py MODE OUTPUT_ROOT``; MODE ``between``: after step 3 (checkpoint-2 complete, the
next not started); ``during``: in the middle of writing checkpoint-4's optimizer.pt (half of the bytes written).
"""

from __future__ import annotations

import io
import os
import sys
import time
from pathlib import Path

import torch
from crash_settings import MAX_STEPS, NAME, SAVE_STEPS
from trainer_helpers import checkpointing_trainer
from transformers import TrainerCallback

import hf_optim  # noqa: F401  (the optim= names)


def wait_for_kill() -> None:
    print("KILL-ME", flush=True)
    time.sleep(600)
    sys.exit("was not killed")


class KillAfterStep(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            wait_for_kill()


def kill_while_saving(target: str) -> None:
    """Make torch.save of ``target`` write half of its bytes, flush them, and wait to be killed."""
    original = torch.save

    def save(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)) and str(f).endswith(target):
            buffer = io.BytesIO()
            original(obj, buffer, *args, **kwargs)
            data = buffer.getvalue()
            with open(f, "wb") as handle:
                handle.write(data[: len(data) // 2])
                handle.flush()
            wait_for_kill()
        return original(obj, f, *args, **kwargs)

    torch.save = save


def main(mode: str, output_root: Path) -> None:
    callbacks = []
    if mode == "between":
        callbacks.append(KillAfterStep(SAVE_STEPS + 1))
    elif mode == "during":
        kill_while_saving(os.path.join(f"checkpoint-{2 * SAVE_STEPS}", "optimizer.pt"))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    trainer = checkpointing_trainer(output_root, NAME, max_steps=MAX_STEPS, save_steps=SAVE_STEPS, callbacks=callbacks)
    trainer.train()
    sys.exit("training finished without being killed")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
