"""The timeline's phase labels on real measurements: step in backward (an optimizer step per parameter
inside backward) and many checkpoint segments; labels never overlap, never leave the axes' width,
and the peak is named by the phase and step it happened in."""

import itertools
import re

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from labkit.models.gpt import GPTConfig  # noqa: E402
from labkit.estimate import Recipe  # noqa: E402
from labkit.run import measure_step  # noqa: E402
from labkit.viz import timeline  # noqa: E402

PHASE_LABEL = re.compile(r"^(forward|backward|optimizer|backward \+ optimizer) \d+$")


@pytest.fixture(scope="module")
def step_in_backward():
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32)
    return measure_step(Recipe(cfg, 2, 16, "fp32", step_in_backward=True), steps=2)


@pytest.fixture(scope="module")
def seven_segments():
    cfg = GPTConfig(n_layer=8, n_head=2, n_embd=32, block_size=32)
    return measure_step(Recipe(cfg, 2, 16, "fp32", checkpoint="full", segments=7), steps=2)


def drawn_labels(fig, ax):
    """Draw the figure; -> (renderer, the visible phase labels, every phase label made)."""
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    labels = [t for t in ax.texts if PHASE_LABEL.match(t.get_text())]
    return canvas.get_renderer(), [t for t in labels if t.get_visible()], labels


def check_layout(fig, ax):
    renderer, shown, made = drawn_labels(fig, ax)
    boxes = [t.get_window_extent(renderer) for t in shown]
    for (a, ta), (b, tb) in itertools.combinations(zip(boxes, shown), 2):
        assert not a.overlaps(b), f"{ta.get_text()!r} overlaps {tb.get_text()!r}"
    title = ax.title.get_window_extent(renderer)
    for box, t in zip(boxes, shown):
        assert ax.bbox.x0 - 0.5 <= box.x0 and box.x1 <= ax.bbox.x1 + 0.5, f"{t.get_text()!r} leaves the axes' width"
        assert box.y0 >= ax.bbox.y1 and box.y1 <= fig.bbox.y1, f"{t.get_text()!r} is not between the axes and the top"
        assert not box.overlaps(title), f"{t.get_text()!r} covers the title"
    return [t.get_text() for t in shown], [t.get_text() for t in made]


def peak_phase_and_step(meas):
    """Where the peak happened, read off the ledger's marks directly: (phase, step)."""
    total = meas.timeline.total
    at = total.index(max(total))
    return max((m for m in meas.timeline.phase_starts if m[0] <= at), key=lambda m: m[0])[1:]


def test_step_in_backward_is_one_band_per_step_and_the_peak_is_named_by_its_phase(step_in_backward):
    fig = timeline(step_in_backward, budget=int(step_in_backward.peak.total * 1.05))
    ax = fig.axes[0]
    shown, made = check_layout(fig, ax)
    # dozens of optimizer steps inside each backward make one band, labelled once, with each step's forward
    assert made == ["forward 1", "backward + optimizer 1", "forward 2", "backward + optimizer 2"]
    assert shown == made  # at this size every label fits
    marks = [m for m in step_in_backward.timeline.phase_starts]
    assert sum(p == "optimizer" for _, p, _ in marks) > 10  # the slivers the bands replace
    assert len(ax.lines) - 2 <= len(made)  # one phase line per band (plus the peak and budget lines), not per sliver
    phase, step = peak_phase_and_step(step_in_backward)
    name = "an optimizer step inside backward" if phase == "optimizer" else phase
    peak = [t.get_text() for t in ax.texts if t.get_text().startswith("peak")]
    assert peak == [f"peak {_fmt(step_in_backward)} ({name}, step {step}) "]


def test_many_segments_in_a_narrow_figure_skip_or_stack_labels_never_overlap(seven_segments):
    fig = timeline(seven_segments)
    shown, made = check_layout(fig, fig.axes[0])
    assert shown == made == [f"{p} {s}" for s in (1, 2) for p in ("forward", "backward", "optimizer")]
    narrow = Figure(figsize=(4, 2.5))
    ax = narrow.add_subplot(1, 1, 1)
    timeline(seven_segments, ax=ax)
    narrow.subplots_adjust(left=0.2, right=0.95, top=0.7)  # after drawing: labels are placed when the figure is
    shown, made = check_layout(narrow, ax)
    assert 0 < len(shown) < len(made)  # some left out (the shading and the legend still name them)
    rows = {round(t.get_window_extent(narrow.canvas.get_renderer()).y0) for t in ax.texts if t.get_text() in shown}
    assert len(rows) == 2  # a label too wide for its band moved up a row


def _fmt(meas):
    from labkit.memory import fmt_bytes

    return fmt_bytes(max(meas.timeline.total))
