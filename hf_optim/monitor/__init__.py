"""Training logs for any Hugging Face Trainer: loss, speed and memory to files and plots, and run comparison.

``TrainingMonitor`` is a ``TrainerCallback``; ``plot_run`` redraws one run's plots; ``compare_runs`` puts several
runs side by side. Needs transformers, matplotlib and psutil (``pip install 'hf_optim[monitor]'``); nvidia-ml-py
adds device-level GPU memory.
"""

from hf_optim.monitor.callback import TrainingMonitor
from hf_optim.monitor.compare import compare_runs
from hf_optim.monitor.plots import plot_run
from hf_optim.monitor.runfiles import RunData, load_run

__all__ = ["TrainingMonitor", "plot_run", "compare_runs", "load_run", "RunData"]
