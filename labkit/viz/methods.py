"""Several setups side by side: one stacked bar per method (or per predicted / measured run) at its peak."""

from __future__ import annotations

from matplotlib.figure import Figure

from labkit.memory.report import CATEGORIES, Breakdown
from labkit.memory.units import GiB, fmt_bytes

from .style import CATEGORY_COLORS, DOES_NOT_FIT, _axes, _legend, _stack, pick_unit


def _breakdown(obj) -> Breakdown:
    """A Breakdown, or the peak of an Estimate or a Measurement."""
    if isinstance(obj, Breakdown):
        return obj
    peak = getattr(obj, "peak", None)
    if isinstance(peak, Breakdown):
        return peak
    raise TypeError(f"expected a Breakdown, an Estimate or a Measurement, got {type(obj).__name__}")


def peak_bars(items: dict, budgets_gib=(), ax=None, title: str | None = None) -> Figure:
    """One stacked bar per item ({label: Breakdown | Estimate | Measurement}, drawn in order), each
    segment a category, the total written on top; a dashed line per budget in GiB."""
    if not items:
        raise ValueError("peak_bars needs at least one item to draw")
    peaks = {str(label): _breakdown(obj) for label, obj in items.items()}
    top = max([b.total for b in peaks.values()] + [g * GiB for g in budgets_gib])
    unit, size = pick_unit(top)
    fig, ax = _axes(ax, (1.6 + 1.1 * len(peaks), 3.6), right=0.78)
    for x, b in enumerate(peaks.values()):
        _stack(ax, x, b, size)
        ax.text(x, b.total / size, fmt_bytes(b.total), ha="center", va="bottom", fontsize=8, fontweight="bold")
    for g in budgets_gib:
        ax.axhline(g * GiB / size, color=DOES_NOT_FIT, lw=0.8, ls="--")
        ax.text(len(peaks) - 0.5, g * GiB / size, f" {g:g} GiB", color=DOES_NOT_FIT, fontsize=8, va="center")
    ax.set_xticks(range(len(peaks)), list(peaks), fontsize=8)
    ax.set_xlim(-0.6, len(peaks) - 0.4)
    ax.set_ylim(0, 1.12 * top / size)
    ax.set_ylabel(f"memory at the peak ({unit})")
    if title:
        ax.set_title(title, fontsize=10)
    ax.spines[["top", "right"]].set_visible(False)
    used = [c for c in CATEGORIES if any(b.bytes[c] for b in peaks.values())]
    _legend(ax, used, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


__all__ = ["peak_bars", "CATEGORY_COLORS"]
