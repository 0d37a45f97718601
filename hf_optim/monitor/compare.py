"""Several runs side by side: loss overlay, memory bars, speed bars and a markdown table with baseline deltas."""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass
from pathlib import Path

from hf_optim.errors import UserValueError, suggest
from hf_optim.monitor.plots import DPI, new_figure, step_axis
from hf_optim.monitor.runfiles import RunData, load_run
from hf_optim.monitor.series import auto_ema_beta, byte_unit, ema

COMPARE_MD = "compare.md"
LOSS_PNG = "compare_loss.png"
MEMORY_PNG = "compare_memory.png"
SPEED_PNG = "compare_speed.png"
_PARTS = (("weights_bytes", "weights", "#4c72b0"), ("gradient_bytes", "gradients", "#55a868"),
          ("optimizer_state_bytes", "optimizer state", "#c44e52"), ("rest_bytes", "rest (activations, overhead)",
                                                                   "#b0b0b0"))
_LABEL_SIZE = 8.5
_LABEL_GAP_PX = 6
_SLANT = 30


@dataclass
class _Row:
    label: str
    run: RunData

    @property
    def oom(self) -> bool:
        return self.run.status == "oom"

    @property
    def breakdown(self) -> dict:
        return self.run.summary.get("memory_breakdown") or {}

    @property
    def peak(self) -> int | None:
        return self.breakdown.get("peak_bytes")

    @property
    def peak_reserved(self) -> int | None:
        return (self.run.summary.get("peaks") or {}).get("cuda_peak_reserved_run_bytes")

    @property
    def state(self) -> int | None:
        return (self.run.summary.get("optimizer_state") or {}).get("total_bytes")

    @property
    def tokens_per_s(self) -> float | None:
        return None if self.oom else self.run.summary.get("mean_tokens_per_s")

    @property
    def step_ms(self) -> float | None:
        seconds = None if self.oom else self.run.summary.get("mean_step_time_s")
        return None if seconds is None else 1e3 * seconds

    @property
    def final_loss(self) -> float | None:
        return None if self.oom else self.run.summary.get("final_loss")

    @property
    def ema_loss(self) -> float | None:
        return None if self.oom else self.run.summary.get("ema_loss")


def logged_loss_mean(run_dir) -> float | None:
    """The mean of the training losses logged over the whole run in ``run_dir`` (its ``metrics.jsonl``), or None
    when none was logged.

    A resumed run's ``metrics.jsonl`` holds every step, those logged before the checkpoint it resumed from included
    (the monitor keeps them and appends), whereas the Trainer's ``train_loss`` (``train_loss_run_mean`` in
    summary.json) covers only the steps the last process ran: two identical runs, one of them resumed, have the same
    mean here and different ones there."""
    return load_run(run_dir).logged_loss_mean


def _labels(runs: list[RunData]) -> list[str]:
    labels, used = [], set()
    for run in runs:
        label = run.name
        if label in used:
            label = f"{label} ({run.run_dir})"
        used.add(label)
        labels.append(label)
    return labels


def _pick_baseline(rows: list[_Row], baseline) -> _Row:
    if baseline is None:
        return next((row for row in rows if not row.oom), rows[0])
    wanted = str(baseline)
    for row in rows:
        if wanted in (row.label, row.run.run_dir.name) or Path(wanted).resolve() == row.run.run_dir.resolve():
            return row
    choices = [row.label for row in rows]
    close = suggest(wanted, choices + [row.run.run_dir.name for row in rows])
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    raise UserValueError(f"baseline {wanted!r} is not one of the compared runs "
                         f"({', '.join(map(repr, choices))}).{hint}")


def _unit_for(values) -> tuple[str, int]:
    return byte_unit(max((v for v in values if v is not None), default=0))


def _amount(number: float, sign: bool = False) -> str:
    """Three significant digits, trailing zeros kept (``1.00``, ``0.509``, ``673``), no scientific notation."""
    magnitude = abs(number)
    decimals = 0 if magnitude >= 100 else 1 if magnitude >= 10 else 2 if magnitude >= 1 else 3
    return format(number, ("+" if sign else "") + f".{decimals}f")


def _bytes_cell(value, size) -> str:
    return "-" if value is None else _amount(value / size)


def _delta(value, base, *, size: int = 1, relative: bool = True, fmt: str | None = None) -> str:
    if value is None or base is None:
        return "-"
    diff = (value - base) / size
    text = _amount(diff, sign=True) if fmt is None else format(diff, fmt)
    if relative and base:
        text += f" ({100.0 * (value - base) / base:+.1f}%)"
    return text


def _table(rows: list[_Row], base: _Row) -> list[str]:
    peak_unit, peak_size = _unit_for([r.peak for r in rows] + [r.peak_reserved for r in rows])
    state_unit, state_size = _unit_for([r.state for r in rows])
    has_reserved = any(r.peak_reserved is not None for r in rows)
    header = ["run", "optimizer", "status", f"peak ({peak_unit})", "Δ peak"]
    if has_reserved:
        header += [f"peak reserved ({peak_unit})"]
    header += [f"optimizer state ({state_unit})", "Δ state", "step (ms)", "Δ step", "tokens/s", "Δ tokens/s",
               "final loss", "Δ final loss",
               "EMA loss"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        is_base = row is base
        status = "**OOM**" if row.oom else row.run.status
        if row.oom:
            status += f" at step {row.run.summary.get('oom_step', '?')}"
        cells = [row.label + (" (baseline)" if is_base else ""), row.run.optimizer_label, status,
                 _bytes_cell(row.peak, peak_size) + (" at OOM" if row.oom and row.peak is not None else ""),
                 "" if is_base else _delta(row.peak, base.peak, size=peak_size)]
        if has_reserved:
            cells.append(_bytes_cell(row.peak_reserved, peak_size))
        cells += [
            _bytes_cell(row.state, state_size),
            "" if is_base else _delta(row.state, base.state, size=state_size),
            "-" if row.step_ms is None else f"{row.step_ms:,.1f}",
            "" if is_base else _delta(row.step_ms, base.step_ms, fmt="+,.1f"),
            "-" if row.tokens_per_s is None else f"{row.tokens_per_s:,.0f}",
            "" if is_base else _delta(row.tokens_per_s, base.tokens_per_s, fmt="+,.0f"),
            "-" if row.final_loss is None else f"{row.final_loss:.4f}",
            "" if is_base else _delta(row.final_loss, base.final_loss, relative=False, fmt="+.4f"),
            "-" if row.ema_loss is None else f"{row.ema_loss:.4f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


# ---- figures -----------------------------------------------------------------------------------------------------

def _colors(count: int) -> list:
    from matplotlib import colormaps

    palette = colormaps["tab10"]
    return [palette(i % 10) for i in range(count)]


ZOOM_MIN_POINTS = 20
"""Runs with at least this many logged losses get an inset of the last half of their EMA curves."""


def _loss_overlay(rows: list[_Row]):
    fig = new_figure(10, 5.5)
    ax = fig.add_subplot()
    drawn = 0
    curves = []
    for i, (row, color) in enumerate(zip(rows, _colors(len(rows)))):
        points = [(r["step"], r["loss"]) for r in row.run.train if r.get("loss") is not None]
        if not points:
            continue
        steps, losses = zip(*points)
        beta = row.run.summary.get("ema_beta")
        beta = auto_ema_beta(len(losses)) if beta is None else beta
        suffix = " (OOM)" if row.oom else ""
        style = ("-", "--", "-.", ":")[i % 4]  # runs that learn alike overlap: keep each one visible
        smoothed = ema(losses, beta)
        ax.plot(steps, losses, color=color, lw=0.8, alpha=0.35, ls=style)
        ax.plot(steps, smoothed, color=color, lw=2.0, ls=style, marker="o" if len(steps) == 1 else None,
                label=f"{row.label}{suffix}: EMA, raw faint")
        drawn = max(drawn, len(steps))
        curves.append((steps, smoothed, color, style))
    zoomed = drawn >= ZOOM_MIN_POINTS and _zoom_last_half(ax, curves)
    if drawn < 2:
        ax.text(0.5, 0.5, "too few logged loss points to draw curves (fewer than 2 per run)",
                transform=ax.transAxes, ha="center", va="center", color="#8a2c0d",
                bbox=dict(boxstyle="round", facecolor="#fff3cd", edgecolor="#d4a017"))
    step_axis(ax)
    ax.set_ylabel("training loss")
    ax.set_title("training loss by run")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="lower left" if zoomed else "best")  # the inset takes the upper right
    return fig


def _zoom_last_half(ax, curves: list) -> bool:
    """An inset of the EMA curves over the last half of the steps, its loss axis fitted to them: the main axis
    spans the first steps' high loss, which flattens the end, where optimizers differ by a percent or two.
    Returns whether it was drawn (not when the curves are flat there)."""
    last = max(max(steps) for steps, *_ in curves)
    start = last / 2
    tails = [[(s, v) for s, v in zip(steps, values) if s >= start] for steps, values, *_ in curves]
    values = [v for tail in tails for _, v in tail]
    low, high = min(values), max(values)
    if not high > low:
        return False
    inset = ax.inset_axes([0.52, 0.45, 0.45, 0.5])
    for tail, (_, _, color, style) in zip(tails, curves):
        if tail:
            inset.plot(*zip(*tail), color=color, lw=1.6, ls=style)
    margin = (high - low) * 0.08
    inset.set_xlim(start, last)
    inset.set_ylim(low - margin, high + margin)
    inset.set_title("EMA, last half of the steps", fontsize=8)
    inset.tick_params(labelsize=7)
    inset.grid(alpha=0.3)
    return True


def _stacked_bars(ax, rows: list[_Row], parts, size: int) -> list[float]:
    bottoms = [0.0] * len(rows)
    for key, label, color in parts:
        heights = [(row.breakdown.get(key) or 0) / size for row in rows]
        ax.bar(range(len(rows)), heights, bottom=bottoms, color=color, label=label, width=0.6)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    return bottoms


def _annotate_bars(ax, rows: list[_Row], tops: list[float], notes: list[str]) -> None:
    for i, (row, top, note) in enumerate(zip(rows, tops, notes)):
        if row.oom:
            ax.bar(i, top, width=0.6, fill=False, hatch="//", edgecolor="#c0392b")
            note = "OOM" + (f"\n{note}" if note else "")
        ax.annotate(note, xy=(i, top), xytext=(0, 3), textcoords="offset points", ha="center", va="bottom",
                    fontsize=8.5, color="#c0392b" if row.oom else "black")
    _set_bar_labels(ax, rows)
    ax.set_ylim(0, max(tops + [0]) * 1.2 or 1)
    ax.grid(axis="y", alpha=0.3)


def _bar_label(row: _Row) -> str:
    """The run's name, and under it the optimizer class when the name does not already say it."""
    optimizer = row.run.optimizer_label
    same = optimizer.lower().replace("_", "") == row.label.lower().replace("_", "")  # adafactor / Adafactor
    return row.label if same or optimizer == "?" else f"{row.label}\n{optimizer}"


def _set_bar_labels(ax, rows: list[_Row]) -> None:
    ax.set_xticks(range(len(rows)), [_bar_label(row) for row in rows], fontsize=_LABEL_SIZE)


def _label_boxes(fig, ax) -> list:
    renderer = fig.canvas.get_renderer()
    return [label.get_window_extent(renderer) for label in ax.get_xticklabels() if label.get_text()]


def _fits_side_by_side(fig, ax) -> bool:
    boxes = _label_boxes(fig, ax)
    width = fig.bbox.width
    return all(box.x0 >= 0 and box.x1 <= width for box in boxes) and all(
        right.x0 - left.x1 >= _LABEL_GAP_PX for left, right in zip(boxes, boxes[1:]))


def _fits_slanted(fig, ax, unslanted_heights: list[float]) -> bool:
    """Slanted labels are parallel strips: they stay apart when the tick spacing across the slant exceeds a
    label's height (its lines, measured unslanted). Long ones would also squeeze the bars: at most a third of the
    figure's height goes to them."""
    ticks = [ax.transData.transform((x, 0))[0] for x in ax.get_xticks()]
    spacing = min((b - a for a, b in zip(ticks, ticks[1:])), default=float("inf"))
    tallest = max((box.height for box in _label_boxes(fig, ax)), default=0)
    return (spacing * math.sin(math.radians(_SLANT)) >= max(unslanted_heights, default=0) + _LABEL_GAP_PX
            and tallest <= fig.bbox.height / 3)


def fit_bar_labels(fig, axes: list, rows: list[_Row]) -> str:
    """Make the bar labels of ``axes`` readable, never overlapping: side by side when they fit, else slanted
    (30 degrees), else numbered with a key under the figure. Returns which (``"flat"``, ``"slanted"``,
    ``"numbered"``)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)  # a renderer to measure text with (the figure is drawn by savefig later anyway)
    fig.canvas.draw()
    if all(_fits_side_by_side(fig, ax) for ax in axes):
        return "flat"
    heights = {id(ax): [box.height for box in _label_boxes(fig, ax)] for ax in axes}
    for ax in axes:
        for label in ax.get_xticklabels():
            label.set(rotation=_SLANT, horizontalalignment="right", rotation_mode="anchor")
    fig.canvas.draw()  # constrained layout makes room for the slanted labels: measure the spacing after it
    if all(_fits_slanted(fig, ax, heights[id(ax)]) for ax in axes):
        return "slanted"
    for ax in axes:
        ax.set_xticks(range(len(rows)), [str(i) for i in range(1, len(rows) + 1)], fontsize=_LABEL_SIZE,
                      rotation=0, horizontalalignment="center")
    entries = [f"{i}: {row.label}" + (f" ({_bar_label(row).split(chr(10))[1]})" if "\n" in _bar_label(row) else "")
               for i, row in enumerate(rows, start=1)]
    chars = int(fig.bbox.width / (_LABEL_SIZE * fig.dpi / 72 * 0.62))  # DejaVu Sans averages ~0.6 em a character
    fig.supxlabel(_pack(entries, chars), fontsize=_LABEL_SIZE)
    for legend in list(fig.legends):  # the key takes the bottom: a figure legend there moves to the right
        handles, labels = legend.legend_handles, [text.get_text() for text in legend.get_texts()]
        legend.remove()
        fig.legend(handles, labels, loc="outside right upper", fontsize=_LABEL_SIZE)
    return "numbered"


def _pack(entries: list[str], width: int) -> str:
    """Entries on as few lines of at most ``width`` characters as fit whole; a longer entry wraps on its own."""
    lines: list[str] = []
    for entry in entries:
        if lines and len(lines[-1]) + 3 + len(entry) <= width:
            lines[-1] += "   " + entry
        else:
            lines.extend(textwrap.wrap(entry, width=max(width, 20), subsequent_indent="    "))
    return "\n".join(lines)


def _memory_bars(rows: list[_Row]):
    """Left: the whole peak split in four. Right: weights, gradients and optimizer state alone, on their own
    scale, because next to activations and process overhead they are often too thin to see."""
    fig = new_figure(max(9.0, 2.6 * len(rows) + 4), 5.5)
    whole, model_side = fig.subplots(1, 2)
    unit, size = _unit_for([r.peak for r in rows] + [sum(r.breakdown.get(k) or 0 for k, *_ in _PARTS) for r in rows])
    tops = _stacked_bars(whole, rows, _PARTS, size)
    _annotate_bars(whole, rows, tops, [f"{_amount(r.peak / size)} {unit}" if r.peak is not None else "" for r in rows])
    bases = {row.breakdown.get("basis") for row in rows if row.breakdown}
    basis = bases.pop() if len(bases) == 1 else "mixed bases: not comparable"
    whole.set_title(f"peak memory ({basis})", fontsize=10)
    whole.set_ylabel(unit)

    parts = _PARTS[:3]
    sums = [sum(r.breakdown.get(k) or 0 for k, *_ in parts) for r in rows]
    unit, size = _unit_for(sums)
    tops = _stacked_bars(model_side, rows, parts, size)
    _annotate_bars(model_side, rows, tops, [f"state {_amount((r.breakdown.get('optimizer_state_bytes') or 0) / size)}"
                                            f" {unit}" for r in rows])
    model_side.set_title("weights + gradients + optimizer state (zoomed)", fontsize=10)
    model_side.set_ylabel(unit)
    handles, labels = whole.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=4, fontsize=8.5)
    fig.suptitle("memory breakdown by run")
    fit_bar_labels(fig, [whole, model_side], rows)
    return fig


def _speed_bars(rows: list[_Row]):
    fig = new_figure(max(6.0, 1.4 * len(rows) + 2), 4.5)
    ax = fig.add_subplot()
    speeds = [row.tokens_per_s or 0.0 for row in rows]
    bars = ax.bar(range(len(rows)), speeds, color=_colors(len(rows)), width=0.6)
    for i, (row, bar) in enumerate(zip(rows, bars)):
        text = "OOM" if row.oom else ("unknown" if row.tokens_per_s is None else f"{row.tokens_per_s:,.0f}")
        ax.annotate(text, xy=(i, bar.get_height()), xytext=(0, 3), textcoords="offset points", ha="center",
                    va="bottom", fontsize=9, color="#c0392b" if row.oom else "black")
    _set_bar_labels(ax, rows)
    ax.set_ylabel("tokens/s (mean over steps after the first)")
    ax.set_ylim(top=max(speeds + [0]) * 1.15 or 1)
    ax.set_title("training speed")
    ax.grid(axis="y", alpha=0.3)
    fit_bar_labels(fig, [ax], rows)
    return fig


def compare_runs(run_dirs, out_dir, baseline=None, title: str | None = None) -> Path:
    """Compare run directories written by :class:`~hf_optim.monitor.TrainingMonitor`.

    Writes ``compare.md`` (a table of peak memory, optimizer-state size, tokens/s, final and EMA loss, each with its
    delta against the baseline; runs that ran out of memory appear as OOM rows) and ``compare_loss.png``,
    ``compare_memory.png`` (weights / gradients / optimizer state / rest bars), ``compare_speed.png``.

    Args:
        run_dirs: the run directories, in the order to show them.
        out_dir: where to write (created if needed).
        baseline: the run deltas are taken against: a run name, a run directory or its name. Default None: the
            first run that did not run out of memory.
        title: the heading of ``compare.md`` (default ``"Run comparison"``); a sweep says what it swept.

    Returns:
        The path of ``compare.md``.
    """
    run_dirs = list(run_dirs)
    if not run_dirs:
        raise UserValueError("compare_runs needs at least one run directory")
    runs = [load_run(d) for d in run_dirs]
    rows = [_Row(label, run) for label, run in zip(_labels(runs), runs)]
    base = _pick_baseline(rows, baseline)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, build in ((LOSS_PNG, _loss_overlay), (MEMORY_PNG, _memory_bars), (SPEED_PNG, _speed_bars)):
        build(rows).savefig(out_dir / name, dpi=DPI)

    bases = sorted({row.breakdown.get("basis", "?") for row in rows})
    lines = [f"# {title or 'Run comparison'} ({len(rows)} runs, baseline: {base.label})", ""]
    lines += _table(rows, base)
    lines += [
        "",
        "- peak: " + ("; ".join(bases)) + ". `cuda_peak_allocated` is torch's peak of allocated CUDA memory over the"
        " run; `host_rss_peak_sampled` (CPU runs) is the largest host RSS sampled at log steps and includes the"
        " Python process itself." + (" **The runs use different bases: their peaks are not comparable.**"
                                     if len(bases) > 1 else ""),
        "- Δ columns: the run minus the baseline (and the change in percent). step and tokens/s are steady-state"
        " means over the training steps after the first (the first step, which includes compilation and the"
        " creation of the optimizer state, is `first_step_time_s` in each run's summary.json; logging and"
        " evaluation excluded); final loss is the last logged training loss.",
        "- OOM rows: the run ran out of memory; its peak is the one measured when the error was recorded.",
        "",
        f"![training loss]({LOSS_PNG})",
        "",
        f"![peak memory breakdown]({MEMORY_PNG})",
        "",
        f"![training speed]({SPEED_PNG})",
        "",
        "Runs:",
        "",
    ]
    lines += [f"- {row.label}: `{row.run.run_dir}`" for row in rows]
    path = out_dir / COMPARE_MD
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
