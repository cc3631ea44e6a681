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


def _legend(ax, cats=CATEGORIES, **kw) -> None:
    handles = [Patch(color=CATEGORY_COLORS[c], label=c.value) for c in cats]
    ax.legend(handles=handles, fontsize=8, frameon=False, **kw)
