"""The waterfall chart: the naive step's peak, then one floating bar per knob (what it saved or cost),
then the recipe's peak by category (labkit.plan.waterfall computes the bars)."""

from __future__ import annotations

import textwrap

from matplotlib.figure import Figure

from labkit.memory.units import fmt_bytes

from .style import DOES_NOT_FIT, FITS, _axes, _legend, _stack, pick_unit

SAVES, COSTS = "#2E7D32", "#C62828"  # a knob that lowers the peak, one that raises it


def waterfall_chart(w, ax=None, budget: int | None = None) -> Figure:
    """w: a labkit.plan.waterfall.Waterfall. The first and last bars are stacked by category; between
    them each knob's bar floats from the peak before it to the peak after it, labelled with the bytes
    and the share it saved; a dot marks the ledger's peak where `w` was verified."""
    steps = w.steps
    n = len(steps) + 1
    fig, ax = _axes(ax, (max(7.0, 1.05 * n + 2.5), 4.6), right=0.80)
    top = max([s.peak for s in steps] + [budget or 0, 1])
    unit, size = pick_unit(top)
    _stack(ax, 0, steps[0].phases, size, min_label=0.08 * top / size)
    for i, s in enumerate(steps[1:], start=1):
        lo, hi = sorted((s.peak, s.peak + s.saved))
        ax.bar(i, (hi - lo) / size, bottom=lo / size, width=0.6, color=SAVES if s.saved >= 0 else COSTS)
        sign = "-" if s.saved > 0 else "+" if s.saved < 0 else ""
        ax.text(i, hi / size, f"{sign}{fmt_bytes(abs(s.saved))}\n{100 * abs(s.saved_share):.0f} %",
                ha="center", va="bottom", fontsize=8)
        ax.plot([i + 0.3, i + 0.7], [s.peak / size] * 2, color="#555555", lw=0.8, ls=":")  # to the next
    _stack(ax, n - 1, steps[-1].phases, size, min_label=0.08 * top / size)
    ax.text(n - 1, steps[-1].peak / size, fmt_bytes(steps[-1].peak), ha="center", va="bottom", fontsize=9,
            weight="bold")
    ax.text(0, steps[0].peak / size, fmt_bytes(steps[0].peak), ha="center", va="bottom", fontsize=9,
            weight="bold")
    measured = [(i, s.measured) for i, s in enumerate(steps) if s.measured is not None]
    for i, m in measured:  # at the bar's predicted peak: its bottom, or the naive bar's top
        ax.plot(i, m / size, "ko", ms=4)
    if budget:
        ax.axhline(budget / size, color=FITS if steps[-1].peak <= budget else DOES_NOT_FIT, ls="--", lw=1)
        ax.text(-0.55, budget / size, f"budget {fmt_bytes(budget)}", va="bottom", ha="left", fontsize=8)
    labels = ["naive"] + [s.knob.value for s in steps[1:]] + ["recipe"]
    ax.set_xticks(range(n), [textwrap.fill(label, 12, break_long_words=False) for label in labels], fontsize=8)
    ax.set_xlim(-0.6, n - 0.4)
    ax.set_ylim(0, top / size * 1.18)
    ax.set_ylabel(f"peak memory ({unit})")
    ax.set_title("what each knob buys, applied in this order (savings depend on the order)", fontsize=10)
    ax.spines[["top", "right"]].set_visible(False)
    _legend(ax, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    if measured:
        ax.text(1.01, 0.02, "\u25cf measured peak", transform=ax.transAxes, fontsize=8)
    return fig
