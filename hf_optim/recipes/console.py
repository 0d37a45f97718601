"""What ``hf-optim train`` prints: hf_optim's lines, one progress bar, and third-party output when it matters.

Hidden (``hf-optim train -v`` shows everything):

- progress bars of loading and writing weights (transformers, huggingface_hub) and of preparing the dataset
  (datasets): the training bar is the one that tells how far the run is;
- ``DeprecationWarning``, ``PendingDeprecationWarning`` and ``FutureWarning`` raised inside other packages: they are
  about those packages' calls into each other (a recipe's keys reach the installed classes under the names those do
  not deprecate), nothing a recipe can change;
- the Trainer's raw log dict at every logging step: the bar shows the loss, ``metrics.jsonl`` keeps every value;
- :data:`hf_optim.notices.OPTIONAL_KERNEL_NOTICES`: notices that an optional accelerated kernel is not installed,
  when the run works without it (hidden in every process that imports hf_optim; ``-v`` shows them).

Everything else is shown: hf_optim's warnings, other packages' ``UserWarning`` s and logged warnings, written
above the progress bar so that the bar stays one line.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import warnings
from collections.abc import Callable, Iterator

from hf_optim.notices import hf_optim_line, warning_source

_THIRD_PARTY = r"(?!hf_optim\b)"  # a warnings-filter module pattern: any module outside hf_optim
_active = {"depth": 0}


def _write_above_bar(text: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(text, file=sys.stderr)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """One line per warning, above the progress bar: ``[hf_optim] warning: ...`` or
    ``warning (peft, UserWarning): ...``."""
    package = warning_source(filename)
    if package == "hf_optim":
        _write_above_bar(hf_optim_line(message))
    else:
        _write_above_bar(f"warning ({package}, {category.__name__}): {message}")


def _progress_bar_switches() -> list[tuple]:
    """(is_on, turn_off, turn_on) for each installed package whose progress bars are hidden."""
    switches = []
    with contextlib.suppress(ImportError):
        from transformers.utils import logging as hf_logging

        switches.append((hf_logging.is_progress_bar_enabled, hf_logging.disable_progress_bar,
                         hf_logging.enable_progress_bar))
    with contextlib.suppress(ImportError):
        import datasets

        switches.append((datasets.is_progress_bar_enabled, datasets.disable_progress_bars,
                         datasets.enable_progress_bars))
    with contextlib.suppress(ImportError):
        import huggingface_hub.utils as hub

        switches.append((lambda: not hub.are_progress_bars_disabled(), hub.disable_progress_bars,
                         hub.enable_progress_bars))
    return switches


@contextlib.contextmanager
def _progress_bars_off() -> Iterator[None]:
    switches = [(was_on(), off, on) for was_on, off, on in _progress_bar_switches()]
    for _, off, _ in switches:
        off()
    try:
        yield
    finally:
        for was_on, _, on in switches:
            if was_on:
                on()


@contextlib.contextmanager
def quiet_console(enabled: bool = True) -> Iterator[None]:
    """Within the block, hide what the module docstring lists (nothing when ``enabled`` is False). Re-entrant.

    Enter it before the Hugging Face packages are imported: some of the hidden notices are logged at import.
    """
    if not enabled or _active["depth"]:  # off, or inside an enclosing quiet block that already does it all
        yield
        return
    from tqdm.contrib.logging import logging_redirect_tqdm

    _active["depth"] += 1
    try:
        with warnings.catch_warnings(), _progress_bars_off(), logging_redirect_tqdm([logging.getLogger("hf_optim")]):
            for category in (DeprecationWarning, PendingDeprecationWarning, FutureWarning):
                warnings.filterwarnings("ignore", category=category, module=_THIRD_PARTY)
            warnings.showwarning = _show_warning
            yield
    finally:
        _active["depth"] -= 1


def quiet_progress(trainer):
    """Replace the Trainer's progress output (a bar with a printed dict per logging step, or only the dicts when
    ``disable_tqdm``) with one bar that shows the latest loss (no bar when ``disable_tqdm``). Returns that bar's
    callback (None without a bar), for :func:`ticking`."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    class LossProgressBar(ProgressCallback):
        """The Trainer's progress bar with the latest training loss in it, instead of a printed dict per log."""

        loss_text: str | None = None

        def on_log(self, args, state, control, logs=None, **kwargs):
            if state.is_world_process_zero and self.training_bar is not None and logs and "loss" in logs:
                with contextlib.suppress(TypeError, ValueError):
                    self.loss_text = f"loss={float(logs['loss']):.4g}"
                    self.training_bar.set_postfix_str(self.loss_text)

    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    if trainer.args.disable_tqdm:
        return None
    bar = LossProgressBar()
    trainer.add_callback(bar)
    return bar


@contextlib.contextmanager
def ticking(progress, detail: Callable[[], str | None] | None = None, every: float = 1.0) -> Iterator[None]:
    """Within the block, redraw ``progress``'s bar (from :func:`quiet_progress`; None: nothing) every ``every``
    seconds, so that its clock moves during a long step, as it does not when the bar is redrawn only when a step
    ends (a step of a billion-parameter model on a CPU takes minutes); ``detail``, when given, returns what the
    step under way has done so far (shown after the loss). A daemon thread, stopped when the block ends however it
    ends."""
    if progress is None:
        yield
        return
    done = threading.Event()

    def tick() -> None:
        while not done.wait(every):
            bar = progress.training_bar
            if bar is None or bar.disable:
                continue
            with contextlib.suppress(Exception):  # a redraw is cosmetic: never let it end the run
                extra = detail() if detail is not None else None
                text = ", ".join(t for t in (progress.loss_text, extra) if t)
                if extra is not None or text:
                    bar.set_postfix_str(text, refresh=False)
                bar.refresh()

    thread = threading.Thread(target=tick, name="hf_optim progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=5)
