"""Bar labels of the comparison figures never overlap, whatever the run names (issue 16).

Overlap is measured on the rendered pixels: each label (and the key and legend, when drawn) is rendered alone on
the finished layout, and no pixel may carry ink from two of them.
"""

from __future__ import annotations

from itertools import combinations
from pathlib import Path

import numpy as np
import pytest

from hf_optim.monitor import compare
from hf_optim.monitor.runfiles import RunData

SWEEP = ["adamw_torch", "paged_adamw_8bit", "ademamix_8bit", "adafactor"]
CLASSES = {"adamw_torch": "AdamW", "paged_adamw_8bit": "PagedAdamW8bit", "ademamix_8bit": "AdEMAMix8bit",
           "adafactor": "Adafactor"}


def rows(labels: list[str]) -> list:
    out = []
    for i, label in enumerate(labels):
        summary = {"run_name": label, "status": "ok", "mean_tokens_per_s": 100.0 + i,
                   "optimizer": {"name": CLASSES.get(label, "hf_optim.PagedAdamW8bit")},
                   "memory_breakdown": {"basis": "host_rss_peak_sampled", "peak_bytes": 7e8, "weights_bytes": 2e6,
                                        "gradient_bytes": 6e5, "optimizer_state_bytes": 1e6, "rest_bytes": 6.9e8}}
        out.append(compare._Row(label, RunData(Path(f"/runs/{i}"), [], summary)))
    return out


def ink_masks(fig) -> dict[str, np.ndarray]:
    """Per drawn label / key / legend: the pixels it inks, each rendered alone on the frozen layout."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    fig.set_layout_engine("none")  # keep every position as laid out with all elements present
    elements = {f"axes {a} label {i}": label for a, ax in enumerate(fig.axes)
                for i, label in enumerate(ax.get_xticklabels()) if label.get_text()}
    if fig._supxlabel is not None:
        elements["key"] = fig._supxlabel
    elements.update({f"legend {i}": legend for i, legend in enumerate(fig.legends)})
    for element in elements.values():
        element.set_visible(False)
    canvas.draw()
    blank = np.asarray(canvas.buffer_rgba()).astype(int)
    masks = {}
    for name, element in elements.items():
        element.set_visible(True)
        canvas.draw()
        masks[name] = (np.abs(np.asarray(canvas.buffer_rgba()).astype(int) - blank).max(axis=2) > 40)
        element.set_visible(False)
    return masks


def assert_apart(fig) -> None:
    masks = ink_masks(fig)
    assert masks and all(mask.any() for mask in masks.values())
    clashes = [(a, b) for a, b in combinations(masks, 2) if (masks[a] & masks[b]).any()]
    assert not clashes, clashes
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:  # inside the image, not cut at its edges
        for label in ax.get_xticklabels():
            box = label.get_window_extent(renderer)
            assert box.x0 >= 0 and box.y0 >= 0 and box.x1 <= fig.bbox.width, label.get_text()


CASES = {
    "sweep values": (SWEEP, "flat"),
    "the issue's labels": ([f"quickstart (runs/sweep/{v})" for v in SWEEP], None),
    "ten runs": ([f"a_rather_long_run_name_{i}" for i in range(10)], "slanted"),
    "very long names": ([f"an extremely long run name somebody typed for sweep value {i} with notes" for i in range(5)],
                        "numbered"),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("figure", ["memory", "speed"])
def test_bar_labels_never_overlap(case, figure):
    labels, mode = CASES[case]
    fig = (compare._memory_bars if figure == "memory" else compare._speed_bars)(rows(labels))
    shown = [t for t in fig.axes[0].get_xticklabels() if t.get_text()]
    if mode == "flat":
        assert [t.get_text().split("\n")[0] for t in shown] == labels and shown[0].get_rotation() == 0
    elif mode == "slanted":
        assert shown[0].get_rotation() == 30
    elif mode == "numbered":
        assert [t.get_text() for t in shown] == [str(i) for i in range(1, len(labels) + 1)]
        assert all(label in fig._supxlabel.get_text().replace("\n", " ") for label in labels)
    assert_apart(fig)


def test_the_check_sees_labels_that_overlap(monkeypatch):
    """The same figure with the labels left side by side: the pixel check reports the clash (so it can fail)."""
    monkeypatch.setattr(compare, "fit_bar_labels", lambda fig, axes, rows: "flat")
    fig = compare._speed_bars(rows([f"quickstart (runs/sweep/{v})" for v in SWEEP]))
    with pytest.raises(AssertionError, match="label"):
        assert_apart(fig)


def test_bar_label_names_the_class_only_when_the_name_does_not():
    adafactor, adamw = rows(["adafactor", "adamw_torch"])
    assert compare._bar_label(adafactor) == "adafactor"
    assert compare._bar_label(adamw) == "adamw_torch\nAdamW"
