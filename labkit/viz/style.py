"""What every labkit figure shares: one colour per category and phase, units, PNG output, stacked bars."""

from __future__ import annotations

import io

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from labkit.memory.report import CATEGORIES, Breakdown, Category
from labkit.memory.units import GiB, KiB, MiB

# One colour per category, the same in every labkit figure (seaborn's "deep" palette).
CATEGORY_COLORS: dict[Category, str] = {
    Category.PARAM: "#4C72B0",  # blue
    Category.BUFFER: "#8C8C8C",  # grey
    Category.GRAD: "#DD8452",  # orange
    Category.OPT: "#55A868",  # green
    Category.ACT: "#C44E52",  # red
    Category.TEMP: "#CCB974",  # sand
}
PHASE_COLORS = {"forward": "#4C72B0", "backward": "#DD8452", "optimizer": "#55A868"}
FITS, DOES_NOT_FIT = "#2E7D32", "#C62828"  # green and red for verdicts and budget lines


def log_grid(value: float, lo: float, hi: float, step: float) -> tuple[float, float]:
    """(min, max) exponents for a FloatLogSlider of base 2 whose grid of `step`s passes through `value`.

    The browser's slider snaps its value to min + k * step; with min on the grid through `value`, the value a
    lesson passes in (a budget of 26.64 MiB) stays what the panel uses, not the nearest grid point (26.91 MiB).
    lo and hi: the exponents the range reaches at least (it may pass them by less than one step)."""
    import math

    at = math.log2(value)  # a value outside [lo, hi] widens the range to hold it
    return at - max(math.ceil((at - lo) / step), 0) * step, at + max(math.ceil((hi - at) / step), 0) * step


def pick_unit(n_bytes: float) -> tuple[str, int]:
    """The binary unit that reads best for sizes up to n_bytes: (name, bytes per unit)."""
    for name, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n_bytes >= size:
            return name, size
    return "B", 1


def to_png(fig: Figure, dpi: int = 100, tight: bool = True) -> bytes:
    """The figure as PNG bytes (what panels and live plots put on screen); tight=False is twice as
    fast (one draw, not two) for figures whose layout already fits."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight" if tight else None)
    return buf.getvalue()


def _show_figures_as_png() -> None:
    """In IPython, show a returned Figure as PNG even before pyplot loads the inline backend (which would)."""
    try:
        from IPython import get_ipython

        png = get_ipython().display_formatter.formatters["image/png"]
    except (ImportError, AttributeError):  # no IPython, or not running in it
        return
    if Figure not in png.type_printers:
        png.for_type(Figure, to_png)


_show_figures_as_png()


def beside(*boxes):
    """Widgets side by side that wrap, one under the other, when the window is too narrow for them all: none
    is squeezed (a squeezed control cuts its name, "sequenc", hides its slider's readout, truncates its
    drop-down), and a picture shrinks to the width it is given rather than spill over."""
    import ipywidgets as widgets

    for box in boxes:
        box.layout.flex = "0 0 auto"  # its own width: never shrunk below what its controls need
        if isinstance(box, widgets.Image):
            box.layout.max_width = "100%"  # a picture wider than the output area scales down
            box.layout.height = "auto"
    return widgets.HBox(list(boxes), layout=widgets.Layout(flex_flow="row wrap", align_items="flex-start"))


class _Panel:
    """What every labkit panel shares: controls that redraw it, and `widget`, what a notebook shows."""

    def _watch(self, controls) -> None:
        """Call `_on_change` whenever one of `controls` changes, and once now, to draw the panel."""
        for w in controls:
            w.observe(self._on_change, names="value")
        self._on_change()

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)


def _axes(ax, figsize, right=0.97):
    if ax is not None:
        return ax.figure, ax
    fig = Figure(figsize=figsize)
    ax = fig.add_subplot(1, 1, 1)
    fig.subplots_adjust(left=0.09, right=right, bottom=0.16, top=0.86)
    return fig, ax


def _stack(ax, x: float, b: Breakdown, size: int, width: float = 0.6, min_label: float = 0.0) -> None:
    """One stacked bar, PARAM at the bottom; segments taller than min_label get their value written in."""
    bottom = 0.0
    for c in CATEGORIES:
        h = b.bytes[c] / size
        if h > 0:
            ax.bar(x, h, width, bottom=bottom, color=CATEGORY_COLORS[c], edgecolor="white", linewidth=0.5)
            if min_label and h >= min_label:
                ax.text(x, bottom + h / 2, f"{h:.3g}", ha="center", va="center", fontsize=8, color="white")
        bottom += h


def _legend(ax, cats=CATEGORIES, extra=(), **kw) -> None:
    """The categories' colours (and `extra` handles first, e.g. the budget line) in a legend."""
    handles = [*extra, *(Patch(color=CATEGORY_COLORS[c], label=c.value) for c in cats)]
    ax.legend(handles=handles, fontsize=8, frameon=False, **kw)
