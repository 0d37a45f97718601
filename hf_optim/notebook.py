"""Helpers for the notebooks in ``notebooks/``: smoke mode, device and memory read-outs, a live training plot.

The notebooks show the Hugging Face code users write themselves (from_pretrained, LoraConfig, SFTConfig,
SFTTrainer); what would be the same boilerplate in each of them lives here. Smoke mode (``HF_OPTIM_SMOKE=1``, used
by CI) swaps the Hub model and dataset for the recipes' builtin tiny checkpoint and bundled chat data, so every
notebook runs top to bottom on a CPU, offline.
"""

from __future__ import annotations

import io
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from hf_optim.monitor.accounting import unwrap_optimizer
from hf_optim.recipes.smoke import SMOKE_ENV, smoke_requested

GIB = 2**30

# Smoke runs use the builtin tiny model of the recipes (hf_optim.tiny.TINY_CHAT_SHAPE: hidden 256, k/v 128 wide).
# Its LoRA tensors must reach bitsandbytes' 4096-element threshold, or 8-bit optimizers silently keep 32-bit state:
# rank 32 x 128 = 4096 for the narrowest (k/v lora_B), as in recipes/quickstart.yaml.
SMOKE_LORA_R = 32
SMOKE_EXAMPLES = 128  # of the 600 bundled chats: plenty for a few steps, quick for the trainers to tokenize
SMOKE_BANNER = (
    "SMOKE RUN: the outputs below are from a CPU smoke run (tiny model, bundled data, a few steps), not a T4. "
    "Run the notebook on a GPU for real figures."
)


def smoke_mode(override: bool | None = None) -> bool:
    """Whether the notebook runs in smoke mode.

    Args:
        override: ``True`` / ``False`` decides; ``None`` (default) reads ``HF_OPTIM_SMOKE`` as the ``hf-optim``
            command does (set and not ``0``).
    """
    return bool(override) if override is not None else smoke_requested()


@dataclass(frozen=True)
class SmokeAssets:
    """Where :func:`smoke_assets` put the tiny checkpoint and the dataset (both loadable like Hub ids)."""

    model_dir: str
    dataset_dir: str


def smoke_assets(root: str | os.PathLike = "smoke_assets") -> SmokeAssets:
    """Save the builtin tiny Llama-3-shaped checkpoint (with the bundled tokenizer) and the bundled chat data.

    The same model, tokenizer and data as ``recipes/quickstart.yaml`` and the recipes' smoke mode, written where
    ``AutoModelForCausalLM.from_pretrained(assets.model_dir)`` and ``load_dataset(assets.dataset_dir)`` load them:
    the notebook then runs the very lines it runs for a Hub model and dataset.

    Args:
        root: directory to write into (default ``"smoke_assets"``, relative to the working directory).
    """
    from hf_optim.tiny import CHAT_FILE, bundled_tokenizer, save_builtin_model

    root = Path(root)
    model_dir, dataset_dir = root / "tiny-llama-3", root / "tiny-chat"
    if not (model_dir / "config.json").exists():
        save_builtin_model(model_dir)
        bundled_tokenizer().save_pretrained(model_dir)
    dataset_dir.mkdir(parents=True, exist_ok=True)
    lines = CHAT_FILE.read_text().splitlines()[:SMOKE_EXAMPLES]
    (dataset_dir / "train.jsonl").write_text("\n".join(lines) + "\n")
    return SmokeAssets(str(model_dir), str(dataset_dir))


# ---------------------------------------------------------------------------------------------------- device


def device_summary(smoke: bool = False) -> str:
    """One line about the accelerator, and a clear error when a real run has none.

    Args:
        smoke: ``True`` accepts a CPU (default ``False``: a real run without a GPU raises ``RuntimeError``).
    """
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        bf16 = torch.cuda.is_bf16_supported(including_emulation=False)  # emulated bf16 (T4) does not count
        return (f"GPU: {props.name}, {props.total_memory / GIB:.1f} GiB, compute capability "
                f"{props.major}.{props.minor}, bf16 {'yes' if bf16 else 'no (training in fp16)'}; "
                f"torch {torch.__version__}, CUDA {torch.version.cuda}")
    if not smoke:
        raise RuntimeError(
            "No CUDA GPU found. On Colab: Runtime > Change runtime type > T4 GPU, then run all cells again "
            f"(or set {SMOKE_ENV}=1 for a CPU smoke run on a tiny model)."
        )
    return f"No GPU: CPU smoke run ({os.cpu_count()} CPU cores, torch {torch.__version__})"


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's parameters and buffers (4-bit weights count as their packed uint8 storage)."""
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def memory_report(label: str, model: torch.nn.Module | None = None) -> dict:
    """Print (and return) where memory stands now: GPU allocated / reserved / peak, NVML, host RSS, model size.

    Args:
        label: what moment this is (``"after loading"``).
        model: when given (default ``None``), its weights' size is included.
    """
    from hf_optim.monitor.nvml_memory import NvmlMemory
    from hf_optim.monitor.sampling import host_rss_bytes

    report: dict = {"label": label, "host_rss_gib": host_rss_bytes() / GIB}
    parts = []
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        report.update(
            allocated_gib=torch.cuda.memory_allocated() / GIB,
            reserved_gib=torch.cuda.memory_reserved() / GIB,
            peak_reserved_gib=torch.cuda.max_memory_reserved() / GIB,
            total_gib=total / GIB,
        )
        parts.append(f"GPU allocated {report['allocated_gib']:.2f} GiB, reserved {report['reserved_gib']:.2f} GiB "
                     f"(peak {report['peak_reserved_gib']:.2f} GiB = "
                     f"{100 * report['peak_reserved_gib'] / report['total_gib']:.0f}% of {report['total_gib']:.1f})")
        used = NvmlMemory().sample()["nvml_used_bytes"]  # sees paged (managed) memory torch's counters miss
        if used is not None:
            report["nvml_used_gib"] = used / GIB
            parts.append(f"device in use (NVML) {used / GIB:.2f} GiB")
    else:
        parts.append("GPU: none")
    parts.append(f"host RSS {report['host_rss_gib']:.2f} GiB")
    if model is not None:
        report["model_gib"] = model_bytes(model) / GIB
        parts.append(f"model weights {model_bytes(model) / 2**20:,.1f} MiB")
    print(f"[{label}] " + "; ".join(parts))
    return report


def optimizer_state_report(optimizer: torch.optim.Optimizer) -> str:
    """A few lines: the optimizer's class, its state size by dtype, and what fp32 AdamW state would take instead.

    Args:
        optimizer: any ``torch.optim.Optimizer`` after at least one step (``trainer.optimizer`` works as well).
    """
    from hf_optim.memory import state_memory

    optimizer = unwrap_optimizer(optimizer)
    memory = state_memory(optimizer)
    trainable = sum(p.numel() for group in optimizer.param_groups for p in group["params"] if p.requires_grad)
    adamw_fp32 = 8 * trainable  # two fp32 moments per trainable element
    by_dtype = ", ".join(f"{dtype} {nbytes / 2**20:,.2f} MiB" for dtype, nbytes in sorted(memory.by_dtype.items()))
    lines = [
        f"optimizer:        {type(optimizer).__module__}.{type(optimizer).__name__}",
        f"trainable params: {trainable:,}",
        f"optimizer state:  {memory.total_bytes / 2**20:,.2f} MiB ({by_dtype or 'empty: no step taken yet'})",
        f"fp32 AdamW state: {adamw_fp32 / 2**20:,.2f} MiB for the same parameters"
        + (f" (this optimizer keeps {memory.total_bytes / adamw_fp32:.0%} of that)" if adamw_fp32 else ""),
    ]
    if memory.paged_bytes:
        lines.append(f"paged (CUDA managed memory): {memory.paged_bytes / 2**20:,.2f} MiB")
    return "\n".join(lines)


def state_table(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None = None, limit: int = 12) -> str:
    """A text table of per-parameter optimizer state: shape, and each state tensor's dtype and bytes.

    Args:
        optimizer: the optimizer (accelerate's wrapper is unwrapped).
        model: when given (default ``None``), parameters are labelled with their names.
        limit: rows to show (default 12); the rest are summarised in one line.
    """
    optimizer = unwrap_optimizer(optimizer)
    names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
    rows = []
    for param, state in optimizer.state.items():
        tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.numel() > 0}
        desc = ", ".join(f"{k}: {str(v.dtype).removeprefix('torch.')} {v.numel() * v.element_size():,} B"
                         for k, v in tensors.items() if v.numel() > 1)
        name = names.get(id(param), "?").removeprefix("base_model.model.")  # PEFT's wrapper prefix
        rows.append(f"{name[-56:]:<58}{str(tuple(param.shape)):<14}{desc}")
    header = f"{'parameter':<58}{'shape':<14}state tensors (dtype, bytes)"
    shown = rows[:limit]
    if len(rows) > limit:
        shown.append(f"... and {len(rows) - limit} more parameters")
    return "\n".join([header, *shown])


# ---------------------------------------------------------------------------------------------------- live plot


def _memory_now() -> tuple[str, float]:
    from hf_optim.monitor.sampling import host_rss_bytes

    if torch.cuda.is_available():
        return "GPU reserved (GiB)", torch.cuda.memory_reserved() / GIB
    return "host RSS (GiB)", host_rss_bytes() / GIB


def _in_notebook() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and "IPKernelApp" in shell.config


def _make_live_plot_callback():
    from transformers import TrainerCallback

    class LivePlot(TrainerCallback):
        """Redraws a loss / memory figure in place while a Trainer runs (one output, updated).

        Args:
            title: figure title (default ``"training"``).
            min_interval_s: redraw at most this often, seconds (default 2.0); the last state is always drawn.
        """

        def __init__(self, title: str = "training", min_interval_s: float = 2.0):
            self.title = title
            self.min_interval_s = min_interval_s
            self.steps: list[int] = []
            self.losses: list[float] = []
            self.memory_steps: list[int] = []
            self.memory: list[float] = []
            self.memory_label = ""
            self._handle = None
            self._last_draw = 0.0

        def on_log(self, args, state, control, logs=None, **kwargs):
            logs = logs or {}
            self.memory_label, value = _memory_now()
            self.memory_steps.append(state.global_step)
            self.memory.append(value)
            if "loss" in logs:
                self.steps.append(state.global_step)
                self.losses.append(float(logs["loss"]))
            if time.monotonic() - self._last_draw >= self.min_interval_s:
                self.draw()

        def on_train_end(self, args, state, control, **kwargs):
            self.draw()

        def figure_png(self) -> bytes:
            from matplotlib.figure import Figure

            from hf_optim.monitor.series import ema

            fig = Figure(figsize=(10, 3.2), layout="constrained")
            loss_ax, mem_ax = fig.subplots(1, 2)
            if self.losses:
                loss_ax.plot(self.steps, self.losses, alpha=0.35, label="loss (raw)")
                loss_ax.plot(self.steps, ema(self.losses), label="loss (EMA, beta=0.9)")
                loss_ax.legend(loc="upper right")
            else:
                loss_ax.text(0.5, 0.5, "no loss logged yet", ha="center", va="center", transform=loss_ax.transAxes)
            loss_ax.set(xlabel="step", ylabel="loss", title=f"{self.title}: loss")
            if self.memory:
                mem_ax.plot(self.memory_steps, self.memory, marker=".", color="tab:green")
            mem_ax.set(xlabel="step", ylabel=self.memory_label, title=f"{self.title}: memory")
            buffer = io.BytesIO()
            fig.savefig(buffer, format="png", dpi=80)
            return buffer.getvalue()

        def draw(self) -> None:
            self._last_draw = time.monotonic()
            if not _in_notebook():
                if self.losses:
                    print(f"[{self.title}] step {self.steps[-1]} loss {self.losses[-1]:.4f} "
                          f"{self.memory_label} {self.memory[-1]:.2f}")
                return
            from IPython.display import Image, display

            image = Image(data=self.figure_png(), format="png")
            if self._handle is None:
                self._handle = display(image, display_id=True)
            else:
                self._handle.update(image)

    return LivePlot


def __getattr__(name: str):
    # LivePlot subclasses transformers' TrainerCallback: built on first use, so importing this module stays cheap.
    if name == "LivePlot":
        cls = _make_live_plot_callback()
        globals()["LivePlot"] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
