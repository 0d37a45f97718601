"""The plots of one run: loss.png, memory.png and dashboard.png, drawn from the run directory's files.

Figures are built with ``matplotlib.figure.Figure`` and rendered by the Agg canvas, never through pyplot: nothing
global changes, so drawing works headless and leaves a notebook's own backend alone. A plot is never empty:
when there are too few points for a curve, the figure says so.
"""

from __future__ import annotations

from pathlib import Path

from hf_optim.monitor import runfiles
from hf_optim.monitor.runfiles import RunData, load_run
from hf_optim.monitor.series import auto_ema_beta, byte_unit, ema, format_bytes

DPI = 110
_PHASE_LABELS = {
    "model_loaded": "model loaded",
    "train_begin": "train begin",
    "after_first_step": "after step 1 (state allocated)",
    "end": "end",
    "oom": "OOM",
    "interrupted": "interrupted",
    "resumed": "resumed",
}


def _phase_label(name: str) -> str | None:
    """The label of a phase; a phase kept from an earlier part of a resumed run is named ``<phase>_at_<step>``."""
    return _PHASE_LABELS.get(name.split("_at_")[0])


_MESSAGE_STYLE = dict(ha="center", va="center", fontsize=10, color="#8a2c0d",
                      bbox=dict(boxstyle="round", facecolor="#fff3cd", edgecolor="#d4a017"))


def require_matplotlib() -> None:
    """Raise a clear error when matplotlib (needed for the plots) is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            "hf_optim.monitor draws its plots with matplotlib, which is not installed: "
            "pip install 'hf_optim[monitor]' (or pass plots=False)"
        ) from exc


def new_figure(width: float, height: float):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=DPI, layout="constrained")


def _series(records: list[dict], key: str) -> tuple[list[float], list[float]]:
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None and r.get("step") is not None]
    return [p[0] for p in points], [p[1] for p in points]


def step_axis(ax) -> None:
    """Label the x axis in optimizer steps, with whole-number ticks."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("optimizer step")
    low, high = ax.get_xlim()
    if high - low < 1:  # a single step: give the axis whole steps on both sides
        middle = round((low + high) / 2)
        ax.set_xlim(middle - 1, middle + 1)


def _message(ax, text: str, y: float = 0.5) -> None:
    ax.text(0.5, y, text, transform=ax.transAxes, wrap=True, **_MESSAGE_STYLE)


def _enough(ax, count: int, what: str, hint: str = "") -> bool:
    """Say on the axes when ``count`` points cannot make a curve; True when there are at least two."""
    if count >= 2:
        return True
    if count == 0:
        ax.set_xticks([])
        ax.set_yticks([])
        _message(ax, f"no {what} logged: nothing to draw" + (f"\n{hint}" if hint else ""))
    else:
        _message(ax, f"only 1 {what} point: too few for a curve" + (f"\n{hint}" if hint else ""), y=0.75)
    return False


def _marker(count: int) -> str | None:
    return "o" if count <= 30 else None


def _title(run: RunData, what: str) -> str:
    title = f"{run.name}: {what}   [{run.optimizer_label}]"
    ended = {"oom": "OUT OF MEMORY", "killed": f"KILLED by {run.summary.get('signal') or 'a signal'}",
             "failed": "FAILED", "died": "PROCESS GONE without recording how it ended", "running": "still running"}
    if run.status in ended:
        title += f"   ({ended[run.status]})"
    return title


# ---- loss --------------------------------------------------------------------------------------------------------

def _draw_loss(ax, run: RunData, *, detailed: bool) -> None:
    steps, losses = _series(run.train, "loss")
    beta = run.summary.get("ema_beta")
    beta = auto_ema_beta(len(losses)) if beta is None else beta
    hint = "log more often (logging_steps) or train longer" if detailed else ""
    if _enough(ax, len(steps), "training loss", hint):
        if beta > 0:
            ax.plot(steps, losses, color="#7aa6d6", lw=1.0, alpha=0.8, marker=_marker(len(steps)), ms=3,
                    label="loss (raw, per log step)")
            ax.plot(steps, ema(losses, beta), color="#1f4e9c", lw=2.2, label=f"loss (EMA, beta={beta:g})")
        else:  # the automatic beta is 0 for runs of <= 10 points: a smoothed curve would equal the raw one
            ax.plot(steps, losses, color="#1f4e9c", lw=1.8, marker=_marker(len(steps)), ms=3,
                    label="loss (raw; too few points to smooth)")
    elif steps:
        ax.plot(steps, losses, "o", color="#1f4e9c", label="loss (raw)")
    eval_steps, eval_losses = _series(run.evals, "eval_loss")
    if eval_steps:
        ax.plot(eval_steps, eval_losses, "s-" if len(eval_steps) > 1 else "s", color="#d9711c", ms=6, lw=1.2,
                label="eval_loss")
    mean, mean_label = run_mean(run)
    resumed_at = run.summary.get("resumed_at_step")
    if mean is not None and detailed:
        ax.axhline(mean, color="#555555", ls="--", lw=1.2, label=f"{mean_label} = {mean:.4f} (not the final loss)")
    oom_step = run.summary.get("oom_step") if run.status == "oom" else None
    if oom_step is not None:
        ax.axvline(oom_step, color="#c0392b", ls=":", lw=1.5, label=f"OOM at step {oom_step}")
    if resumed_at:
        ax.axvline(resumed_at, color="#777777", ls=":", lw=1.2, label=f"resumed from the step-{resumed_at} checkpoint")
    stopped = {"interrupted": "interrupted", "killed": f"killed by {run.summary.get('signal') or 'a signal'}",
               "failed": "failed", "died": "process gone"}.get(run.status)
    if stopped and run.last_step is not None:
        step = run.last_step
        ax.axvline(step, color="#d4a017", ls=":", lw=1.5, label=f"{stopped} at step {step}")
    if detailed and losses:
        final = run.summary.get("final_loss")
        final = losses[-1] if final is None else final  # a summary written when training began has none yet
        ema_final = run.summary.get("ema_loss")
        text = f"final loss {final:.4g}" + (f"\nEMA loss {ema_final:.4g}" if ema_final is not None else "")
        ax.text(0.99, 0.97, text, transform=ax.transAxes, ha="right", va="top", fontsize=9,
                bbox=dict(boxstyle="round", facecolor="white", edgecolor="#bbbbbb"))
    step_axis(ax)
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper right" if not detailed else "center right", fontsize=8)


def run_mean(run: RunData) -> tuple[float | None, str]:
    """(mean training loss, what it is the mean of): the Trainer's ``train_loss`` over all steps, which
    ``hf-optim train`` prints as the run mean; for a resumed run, whose ``train_loss`` covers only the steps after
    the resume, the mean of every logged loss, before the resume included (what ``hf-optim train`` prints then)."""
    resumed_at = run.summary.get("resumed_at_step")
    trainer_mean = run.summary.get("train_loss_run_mean")
    if resumed_at or trainer_mean is None:
        logged = run.logged_loss_mean
        if logged is not None:
            what = ", those before the resume included" if resumed_at else ""
            return logged, f"mean of all logged steps{what}"
    return trainer_mean, "train_loss: the RUN MEAN of all steps"


def loss_figure(run: RunData):
    """Raw and EMA-smoothed loss, eval points, and the run-mean ``train_loss`` labelled as the run mean."""
    fig = new_figure(10, 5.5)
    ax = fig.add_subplot()
    _draw_loss(ax, run, detailed=True)
    ax.set_title(_title(run, "training loss"))
    return fig


# ---- memory ------------------------------------------------------------------------------------------------------

def _memory_points(run: RunData) -> list[dict]:
    """Phase snapshots and log-step samples together, in step order (phases give points even in short runs)."""
    points = [dict(v, phase=k) for k, v in (run.summary.get("phases") or {}).items() if v.get("step") is not None]
    points += run.train
    return sorted(points, key=lambda r: (r["step"], r.get("time_s") or 0.0))


def _is_cuda(run: RunData) -> bool:
    return any(r.get("cuda_allocated_bytes") is not None for r in _memory_points(run))


def _mark_phases(ax, run: RunData, *, labels: bool, key_inside: bool = False) -> None:
    """A dotted line at each phase snapshot's step; with ``labels``, a numbered tag on each and a key naming them:
    right of the axes (memory.png, which leaves room there), or inside them, bottom right (the dashboard's
    panel, whose right neighbour is the summary)."""
    by_step: dict[int, list[str]] = {}
    for name, snapshot in (run.summary.get("phases") or {}).items():
        if _phase_label(name) and snapshot.get("step") is not None:
            by_step.setdefault(snapshot["step"], []).append(_phase_label(name))
    key = []
    left, right = ax.get_xlim() if by_step else (0.0, 1.0)
    last_x, row = None, 0
    for number, (step, names) in enumerate(sorted(by_step.items()), 1):
        oom = "OOM" in names
        color = "#c0392b" if oom else "#555555"
        ax.axvline(step, color="#c0392b" if oom else "#999999", ls=":", lw=1.2)
        if not labels:
            continue
        # A numbered tag in the headroom above the curves (steps 0 and 1 are a few points apart, so tags that
        # would touch go one row lower), on a white box that hides its own dotted line; the names go in a key.
        x = (step - left) / ((right - left) or 1.0)
        row = row + 1 if last_x is not None and x - last_x < 0.025 and row < 2 else 0
        last_x = x
        ax.annotate(str(number), xy=(step, 0.985 - 0.07 * row), xycoords=("data", "axes fraction"), ha="center",
                    va="top", fontsize=8, color=color, zorder=5,
                    bbox=dict(boxstyle="round,pad=0.2", facecolor="white", edgecolor=color, lw=0.6))
        key.append(f"{number}: {' / '.join(names)} (step {step})")
    if key and key_inside:
        ax.text(0.99, 0.03, "phases (dotted lines)\n" + "\n".join(key), transform=ax.transAxes, ha="right",
                va="bottom", multialignment="left", fontsize=7, color="#333333", zorder=6,
                bbox=dict(boxstyle="round,pad=0.3", facecolor="white", edgecolor="#bbbbbb", alpha=0.9))
    elif key:
        ax.text(1.01, 0.0, "phases\n" + "\n".join(key), transform=ax.transAxes, ha="left", va="bottom", fontsize=8,
                color="#333333")


def _draw_process_memory(ax, run: RunData, *, detailed: bool) -> None:
    points = _memory_points(run)
    if _is_cuda(run):
        lines = [
            ("cuda_allocated_bytes", "allocated (torch, at log step)", "#1f77b4", "-"),
            ("cuda_reserved_bytes", "reserved (torch, at log step)", "#2ca02c", "-"),
            ("cuda_peak_allocated_window_bytes", "peak allocated in window", "#1f77b4", "--"),
            ("cuda_peak_reserved_window_bytes", "peak reserved in window", "#2ca02c", "--"),
            ("nvml_used_bytes", "device used (NVML: incl. paged memory, context, other processes)", "#9467bd", "-"),
        ]
        if not detailed:  # the dashboard's small panel: the three lines that matter, short labels
            lines = [("cuda_peak_allocated_window_bytes", "peak allocated (window)", "#1f77b4", "--"),
                     ("cuda_reserved_bytes", "reserved", "#2ca02c", "-"),
                     ("nvml_used_bytes", "NVML device used", "#9467bd", "-")]
    else:
        lines = [("host_rss_bytes", "host RSS (process)", "#1f77b4", "-")]
    largest = max((r.get(key) or 0 for r in points for key, *_ in lines), default=0)
    capacity = next((r.get("cuda_capacity_bytes") for r in points if r.get("cuda_capacity_bytes")), None)
    unit, size = byte_unit(max(largest, capacity or 0))
    drawn = 0
    for key, label, color, style in lines:
        rows = run.train if "window" in key else points  # a phase snapshot's "window" is not a log window
        steps, values = _series(rows, key)
        if not steps:
            continue
        drawn = max(drawn, len(steps))
        ax.plot(steps, [v / size for v in values], ls=style, color=color, lw=1.6, marker=_marker(len(steps)),
                ms=3, label=label)
    if capacity:
        label = f"GPU capacity ({format_bytes(capacity)})" if detailed else "capacity"
        ax.axhline(capacity / size, color="#c0392b", lw=1.5, label=label)
    _enough(ax, drawn, "memory sample", "log more often (logging_steps) or train longer" if detailed else "")
    ax.set_ylabel(unit)
    top = max(largest, capacity or 0) / size
    ax.set_ylim(0, top * 1.25 if top else 1)  # headroom for the phase labels and the legend
    ax.grid(alpha=0.3)
    _mark_phases(ax, run, labels=True, key_inside=not detailed)
    if ax.get_legend_handles_labels()[0]:
        if detailed:
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
        else:
            ax.legend(loc="best", fontsize=7, framealpha=0.8)


def _draw_state_memory(ax, run: RunData) -> None:
    points = _memory_points(run)
    rows = [r for r in points if r.get("optimizer_state_bytes") is not None]
    dtypes = sorted({d for r in rows for d in (r.get("optimizer_state_by_dtype") or {})})
    largest = max((r["optimizer_state_bytes"] for r in rows), default=0)
    unit, size = byte_unit(largest)
    if _enough(ax, len(rows), "optimizer-state sample"):
        steps = [r["step"] for r in rows]
        stacks = [[(r.get("optimizer_state_by_dtype") or {}).get(d, 0) / size for r in rows] for d in dtypes]
        if stacks:
            ax.stackplot(steps, *stacks, labels=[f"state {d}" for d in dtypes], alpha=0.75, step="pre")
        # "pre": a value logged at step k is the state held through step k (allocated during step 1).
        ax.step(steps, [r["optimizer_state_bytes"] / size for r in rows], where="pre", color="black", lw=1.2,
                label="optimizer state total")
        paged = [r.get("optimizer_state_paged_bytes") or 0 for r in rows]
        if any(paged):
            ax.step(steps, [p / size for p in paged], where="pre", color="#c0392b", ls="--",
                    label="paged (CUDA managed)")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    ax.set_ylabel(unit)
    ax.set_ylim(0, largest / size * 1.3 if largest else 1)
    step_axis(ax)
    ax.grid(alpha=0.3)
    _mark_phases(ax, run, labels=False)


def memory_figure(run: RunData):
    """Memory over steps (GPU: torch allocated/reserved, window peaks, NVML, capacity; CPU: host RSS), with the
    phases marked, and the optimizer state by dtype below."""
    fig = new_figure(12, 7)
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[3, 2])
    _draw_process_memory(top, run, detailed=True)
    where = "GPU memory" if _is_cuda(run) else "host memory (CPU run: no GPU fields)"
    top.set_title(_title(run, where))
    _draw_state_memory(bottom, run)
    bottom.set_title("optimizer state (by dtype)", fontsize=10)
    return fig


# ---- dashboard ---------------------------------------------------------------------------------------------------

def _draw_simple(ax, records: list[dict], key: str, title: str, color: str, what: str) -> None:
    steps, values = _series(records, key)
    if _enough(ax, len(steps), what):
        ax.plot(steps, values, color=color, lw=1.6, marker=_marker(len(steps)), ms=3)
    elif steps:
        ax.plot(steps, values, "o", color=color)
    ax.set_title(title, fontsize=10)
    step_axis(ax)
    ax.grid(alpha=0.3)


def _summary_text(run: RunData) -> str:
    s = run.summary
    breakdown = s.get("memory_breakdown") or {}
    optimizer = s.get("optimizer") or {}
    gpu = (s.get("hardware") or {}).get("gpu")

    def num(value, fmt=".4g"):
        return "-" if value is None else format(value, fmt)

    error = s.get("error") or {}
    status = {"oom": f"OOM at step {s.get('oom_step')}", "killed": f"killed by {s.get('signal') or 'a signal'}",
              "failed": f"failed ({error.get('type', 'error')})",
              "died": "died (process gone, no end recorded)"}.get(run.status, run.status)
    lines = [
        f"status: {status}   steps done: {'-' if run.last_step is None else run.last_step}",
        f"optimizer: {optimizer.get('module', '?')}.{optimizer.get('name', '?')}",
        f"device: {gpu['name'] if gpu else (s.get('hardware') or {}).get('device', '?')}",
        f"final loss: {num(s.get('final_loss'))}   EMA: {num(s.get('ema_loss'))}",
        f"{run_mean(run)[1]}: {num(run_mean(run)[0], '.4f')}",
        f"tokens/s (mean): {num(s.get('mean_tokens_per_s'), ',.0f')}",
        f"peak ({breakdown.get('basis', '?')}): {format_bytes(breakdown.get('peak_bytes'))}",
        f"  weights {format_bytes(breakdown.get('weights_bytes'))}, "
        f"grads {format_bytes(breakdown.get('gradient_bytes'))}",
        f"  optimizer state {format_bytes(breakdown.get('optimizer_state_bytes'))}, "
        f"rest {format_bytes(breakdown.get('rest_bytes'))}",
    ]
    return "\n".join(lines)


def dashboard_figure(run: RunData):
    """Loss, learning rate, grad norm, tokens/s, memory and a summary panel on one page."""
    fig = new_figure(15, 8.5)
    axes = fig.subplots(2, 3)
    _draw_loss(axes[0, 0], run, detailed=False)
    axes[0, 0].set_title("loss (raw + EMA)", fontsize=10)
    _draw_simple(axes[0, 1], run.train, "learning_rate", "learning rate", "#2ca02c", "learning-rate")
    _draw_simple(axes[0, 2], run.train, "grad_norm", "grad norm", "#d62728", "grad-norm")
    _draw_simple(axes[1, 0], run.train, "tokens_per_s", "tokens/s (per window)", "#9467bd", "tokens/s")
    _draw_process_memory(axes[1, 1], run, detailed=False)
    axes[1, 1].set_title("GPU memory" if _is_cuda(run) else "host RSS (CPU run)", fontsize=10)
    step_axis(axes[1, 1])
    axes[1, 2].axis("off")
    axes[1, 2].text(0.0, 1.0, _summary_text(run), transform=axes[1, 2].transAxes, ha="left", va="top",
                    fontsize=9.5, family="monospace")
    fig.suptitle(_title(run, "dashboard"), fontsize=12)
    return fig


def plot_run(run_dir) -> list[Path]:
    """(Re)draw ``loss.png``, ``memory.png`` and ``dashboard.png`` of a run directory from its files.

    Args:
        run_dir: a directory written by :class:`~hf_optim.monitor.TrainingMonitor`.

    Returns:
        The paths of the three PNG files.
    """
    run = load_run(run_dir)
    paths = []
    for name, build in ((runfiles.LOSS_PNG, loss_figure), (runfiles.MEMORY_PNG, memory_figure),
                        (runfiles.DASHBOARD_PNG, dashboard_figure)):
        path = run.run_dir / name
        build(run).savefig(path, dpi=DPI)
        paths.append(path)
    return paths

