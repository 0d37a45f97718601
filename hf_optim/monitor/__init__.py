"""Training logs for any Hugging Face Trainer: loss, speed and memory to files and plots, and run comparison.

``TrainingMonitor`` is a ``TrainerCallback``; ``plot_run`` redraws one run's plots; ``compare_runs`` puts several
runs side by side. Needs transformers, matplotlib and psutil (``pip install 'hf_optim[monitor]'``); nvidia-ml-py
adds device-level GPU memory.
"""

from typing import TYPE_CHECKING

from hf_optim import _startup

if TYPE_CHECKING:  # what _load() binds, for type checkers
    from hf_optim.monitor.callback import TrainingMonitor
    from hf_optim.monitor.compare import compare_runs
    from hf_optim.monitor.plots import plot_run
    from hf_optim.monitor.runfiles import RunData, load_run

__all__ = ["TrainingMonitor", "plot_run", "compare_runs", "load_run", "RunData"]


def _load() -> None:
    """Import this package's names (at once, except in the ``hf-optim`` command: :mod:`hf_optim._startup`)."""
    from hf_optim.monitor.callback import TrainingMonitor
    from hf_optim.monitor.compare import compare_runs
    from hf_optim.monitor.plots import plot_run
    from hf_optim.monitor.runfiles import RunData, load_run

    globals().update(TrainingMonitor=TrainingMonitor, compare_runs=compare_runs, plot_run=plot_run,
                     RunData=RunData, load_run=load_run)


if _startup.deferred():
    __getattr__ = _startup.deferred_getattr(__name__, __all__)
else:
    _load()
