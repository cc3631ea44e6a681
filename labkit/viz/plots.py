"""Static plots of memory: predicted vs measured bars, the timeline of one step, the predicted phases.

Colours, units and PNG output live in .style, the fit grid and breakdown table in .tables; their
names are importable from here too, as the lessons use them (`plots.fit_table`, `plots.to_png`).
"""

from __future__ import annotations

from collections import Counter

import matplotlib
import matplotlib.artist
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.transforms import blended_transform_factory, offset_copy

from labkit.memory.report import CATEGORIES, PHASES, Breakdown
from labkit.memory.units import fmt_bytes

from .style import CATEGORY_COLORS, DOES_NOT_FIT, FITS, PHASE_COLORS, _axes, _legend, _stack, pick_unit, to_png
from .tables import BreakdownTable, breakdown_table, fit_table

__all__ = ["CATEGORY_COLORS", "PHASE_COLORS", "FITS", "DOES_NOT_FIT", "pick_unit", "to_png", "compare_bar",
           "timeline", "prediction_bar", "fit_table", "BreakdownTable", "breakdown_table"]


def _pick(obj, phase: str) -> tuple[str, Breakdown]:
    if phase == "peak":
        return obj.peak_phase, obj.peak
    if phase not in obj.phases:
        raise ValueError(f"no phase {phase!r} here; choose 'peak' or one of {', '.join(obj.phases)}")
    return phase, obj.phases[phase]


def _ratio(measured: int, predicted: int) -> str:
    if predicted == 0:
        return "-" if measured == 0 else "not predicted"
    return f"{measured / predicted:.2f}"


def compare_bar(estimate, measurement, ax=None, phase: str = "peak", tolerance: float = 0.10) -> Figure:
    """Predicted and measured bytes of one phase ("peak" = each one's largest) as two stacked bars,
    with a table beside them of bytes and the ratio measured/predicted per category and in total.
    Ratios further than `tolerance` from 1 are shaded orange: a gap to explain, not to hide."""
    (p_phase, pred), (m_phase, meas) = _pick(estimate, phase), _pick(measurement, phase)
    fig, ax = _axes(ax, (9.5, 4.2), right=0.40)
    top = max(pred.total, meas.total, 1)
    unit, size = pick_unit(top)
    for x, b in ((0, pred), (1, meas)):
        _stack(ax, x, b, size, min_label=0.06 * top / size)
        ax.text(x, b.total / size, fmt_bytes(b.total), ha="center", va="bottom", fontsize=9, weight="bold")
    ax.set_xticks([0, 1], [f"predicted\n({p_phase})", f"measured\n({m_phase})"])
    ax.set_xlim(-0.6, 1.6)
    ax.set_ylim(0, top / size * 1.15)
    ax.set_ylabel(f"memory ({unit})")
    ax.set_title(f"{measurement.label or estimate.label}\npredicted vs measured ({'peak' if phase == 'peak' else phase}), "
                 f"measured / predicted = {_ratio(meas.total, pred.total)}", fontsize=10)
    ax.spines[["top", "right"]].set_visible(False)

    rows = [[c.value, fmt_bytes(pred.bytes[c]), fmt_bytes(meas.bytes[c]), _ratio(meas.bytes[c], pred.bytes[c])] for c in CATEGORIES]
    rows.append(["total", fmt_bytes(pred.total), fmt_bytes(meas.total), _ratio(meas.total, pred.total)])
    table = ax.table(cellText=rows, colLabels=["category", "predicted", "measured", "measured/\npredicted"],
                     bbox=[1.15, 0.0, 1.4, 1.0], cellLoc="right", colLoc="center")
    table.auto_set_font_size(False)
    table.set_fontsize(8)
    for (r, col), cell in table.get_celld().items():
        cell.set_width(1.5 if col == 0 else 1.0)  # relative: the bbox scales them
        if col == 0 and r > 0:
            cell.set_text_props(ha="left")
    for i, c in enumerate((*CATEGORIES, None), start=1):
        if c is not None:
            table[i, 0].set_facecolor(matplotlib.colors.to_rgba(CATEGORY_COLORS[c], 0.45))
        else:
            for j in range(4):
                table[i, j].set_text_props(weight="bold")
        p, m = (pred.total, meas.total) if c is None else (pred.bytes[c], meas.bytes[c])
        off = (p == 0) != (m == 0) or (p and abs(m / p - 1) > tolerance)
        table[i, 3].set_facecolor("#F6C89F" if off else "#DCEFD6" if p else "white")
    return fig


def _bands(marks: list[tuple[int, str, int]], n: int) -> list[tuple[int, int, str, int, list]]:
    """The timeline's phases as bands (start, end, phase, step, pieces), pieces being (start, end, phase).

    A step whose optimizer runs inside its backward (step in backward: one optimizer step per
    parameter as its gradient is ready) is one band, "backward + optimizer", not dozens of slivers."""
    pieces = []  # (start, end, phase, step), empty ones left out
    marks = sorted(marks)
    for i, (start, phase, step) in enumerate(marks):
        end = marks[i + 1][0] if i + 1 < len(marks) else n
        if end > start:
            pieces.append((start, end, phase, step))
    inside, stepped = set(), set()  # steps whose backward resumes after an optimizer step
    for _, _, phase, step in pieces:
        if phase == "optimizer":
            stepped.add(step)
        elif phase == "backward" and step in stepped:
            inside.add(step)
    bands: list[tuple[int, int, str, int, list]] = []
    for start, end, phase, step in pieces:
        last = bands[-1] if bands else None
        if (step in inside and phase in ("backward", "optimizer") and last is not None and last[3] == step
                and last[2] in ("backward", "backward + optimizer")):
            bands[-1] = (last[0], end, "backward + optimizer", step, last[4] + [(start, end, phase)])
        else:
            bands.append((start, end, phase, step, [(start, end, phase)]))
    return bands


class _PhaseLabels(matplotlib.artist.Artist):
    """Places the phase labels when the figure is drawn, once the text widths and the axes' size are known:
    a label sits over its band if it fits there, else one row higher if that row has room, else it is
    left out (the band's shade, named in the legend, still tells the phase)."""

    ROWS = (3, 14)  # points above the axes

    def __init__(self, ax, labels):
        super().__init__()
        self.ax, self.labels = ax, labels  # [(start, end, Text)]
        self.set_zorder(2.9)  # drawn just before the texts (zorder 3): it moves them first
        self.set_in_layout(False)

    def draw(self, renderer) -> None:
        ax = self.ax
        lo, hi = ax.bbox.x0, ax.bbox.x1
        gap = renderer.points_to_pixels(4)
        to_data = ax.transData.inverted()
        upper_right = -float("inf")  # right edge of the last label in the upper row
        for start, end, t in self.labels:
            (x0, _), (x1, _) = ax.transData.transform([(start, 0), (end, 0)])
            x0, x1 = max(x0, lo), min(x1, hi)
            t.set_visible(True)
            w = t.get_window_extent(renderer).width
            if w + gap <= x1 - x0:
                row, c = 0, (x0 + x1) / 2
            else:
                row, c = 1, min(max((x0 + x1) / 2, lo + w / 2), hi - w / 2)  # over the band, inside the axes
                if c - w / 2 < upper_right + gap:
                    t.set_visible(False)
                    continue
                upper_right = c + w / 2
            base = blended_transform_factory(ax.transData, ax.transAxes)
            t.set_transform(offset_copy(base, fig=ax.figure, y=self.ROWS[row], units="points"))
            t.set_position((to_data.transform((c, 0))[0], 1.0))


def timeline(measurement, ax=None, budget: int | None = None, title: str | None = None,
             legend: bool = True) -> Figure:
    """Live bytes by category after every allocation or free (a stacked area), with the phases of each
    step shaded and named, a dashed line at the peak, and a red line at `budget` (bytes) if given, named
    in the legend. Phase labels that do not fit over their band move up a row, or are left out (see
    _PhaseLabels). legend=False leaves the legend out: timelines side by side draw it once, on the last, so
    that one's legend does not cover its neighbour's axis."""
    tl = measurement.timeline
    total = tl.total
    fig, ax = _axes(ax, (10, 4.2), right=0.8)
    ax.set_title(title or f"memory during training: {measurement.label}".rstrip(": "), fontsize=10, pad=28)
    if not total:
        ax.text(0.5, 0.5, "no allocations were recorded", ha="center", va="center", transform=ax.transAxes)
        return fig
    peak = max(total)
    show_budget = budget is not None and budget <= 3 * peak  # else the step would be a sliver at the bottom
    top = max(peak, budget if show_budget else 0, 1)
    unit, size = pick_unit(top)
    # on a y axis shared with timelines drawn before (plt.subplots(..., sharey=True)): their unit, and a limit
    # that only grows, so a smaller timeline drawn last does not clip a taller one drawn first
    drawn = [a for a in ax.get_shared_y_axes().get_siblings(ax) if a is not ax and hasattr(a, "_labkit_timeline_unit")]
    if drawn:
        unit, size = drawn[0]._labkit_timeline_unit
    ax._labkit_timeline_unit = (unit, size)
    n = len(total)
    x = list(range(n + 1))
    bottom = [0.0] * (n + 1)
    for c in CATEGORIES:
        ys = [v / size for v in tl.bytes[c]]
        ys.append(ys[-1])
        upper = [b + y for b, y in zip(bottom, ys)]
        if any(ys):
            ax.fill_between(x, bottom, upper, step="post", color=CATEGORY_COLORS[c], linewidth=0)
        bottom = upper
    ax.set_xlim(0, n)
    ax.set_ylim(0, max([top / size * 1.12] + [a.get_ylim()[1] for a in drawn]))

    peak_at = total.index(peak)
    where, labels, shaded = "", [], []
    bands = _bands(tl.phase_starts, n)
    # gradient accumulation: a step of m micro-batches alternates forward and backward m times. Their bands are
    # shaded one by one, but named once, "m micro-batches, step s", over them all: m labels of "forward 1"
    # would pile up over bands too narrow to hold them
    micro = Counter(step for _, _, phase, step, _ in bands if phase == "forward")
    seen: Counter = Counter()  # forward bands met so far per step: the micro-batch a band belongs to
    for start, end, phase, step, pieces in bands:
        color = PHASE_COLORS.get(phase.split(" ")[0], "#999999")  # "backward + optimizer": backward's shade
        ax.axvspan(start, end, color=color, alpha=0.10, linewidth=0, zorder=0)
        ax.axvline(start, color="#777777", linewidth=0.5, zorder=0.5)  # one line per band, not per sliver
        shaded.append(phase.split(" ")[0])
        seen[step] += phase == "forward"
        grouped = micro[step] > 1 and phase != "optimizer"
        if grouped and labels and labels[-1][3] == step:  # the same step's micro-batches: widen its one label
            labels[-1] = (labels[-1][0], end, labels[-1][2], step)
        else:
            text = f"{micro[step]} micro-batches, step {step}" if grouped else f"{phase} {step}"
            labels.append((start, end, ax.text(start, 1.0, text, ha="center", va="bottom", fontsize=8,
                                               color="#555555" if grouped else color, clip_on=False),
                           step if grouped else None))
        for s, e, piece in pieces:
            if s <= peak_at < e:
                inner = phase != piece  # a piece of a "backward + optimizer" band
                name = ("an optimizer step inside backward" if inner and piece == "optimizer" else piece)
                of = f" of micro-batch {seen[step]}" if grouped else ""
                where = f" ({name}{of}, step {step})"
    labels = [(start, end, t) for start, end, t, _ in labels]
    ax.add_artist(_PhaseLabels(ax, labels))

    # two lines close together: each label goes on the far side of its line, so neither covers the other line
    close = show_budget and abs(budget - peak) <= 0.08 * peak
    budget_above = not close or budget >= peak
    ax.axhline(peak / size, color="black", linestyle="--", linewidth=1)
    ax.text(n, peak / size, f"peak {fmt_bytes(peak)}{where} ", ha="right", va="top" if close and budget_above else "bottom",
            fontsize=8, bbox=dict(facecolor="white", edgecolor="none", alpha=0.8, pad=1))
    budget_line = []  # its size is named in the legend: a label on the chart would cover the stack under it
    if show_budget:
        ax.axhline(budget / size, color=DOES_NOT_FIT, linewidth=1.5)
        budget_line.append(Line2D([], [], color=DOES_NOT_FIT, linewidth=1.5, label=f"budget {fmt_bytes(budget)}"))
    elif budget is not None:
        ax.text(1.02, 0.0, f"budget {fmt_bytes(budget)}:\nfar above the peak\n(off the chart)",
                transform=ax.transAxes, color=DOES_NOT_FIT, ha="left", va="bottom", fontsize=8)
    ax.set_xlabel("event (one tensor allocated or freed)")
    ax.set_ylabel(f"live memory ({unit})")
    ax.spines[["top", "right"]].set_visible(False)
    used = [c for c in CATEGORIES if any(tl.bytes[c])]
    phases = [p for p in PHASE_COLORS if p in shaded]
    handles = (budget_line + [Patch(color=PHASE_COLORS[p], alpha=0.25, label=f"{p} phase") for p in phases]
               + [Patch(color=CATEGORY_COLORS[c], label=c.value) for c in used[::-1]])
    if legend:
        ax.legend(handles=handles, fontsize=8, frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def prediction_bar(estimate, budget: int | None = None, ax=None, kernels: str | None = None) -> Figure:
    """The estimate's bytes at the peak of each phase as stacked bars, with the budget line and a verdict.

    The budget's size is named in the legend, beside its line, not written over the bars. kernels: the kernels
    the estimate models ("cpu" or "cuda"), named in the title: the same recipe predicts differently on each."""
    phases = [p for p in PHASES if p in estimate.phases] + [p for p in estimate.phases if p not in PHASES]
    fig, ax = _axes(ax, (7, 4), right=0.72)
    peak = max(estimate.peak.total, 1)
    show_budget = budget is not None and budget <= 4 * peak
    top = max(peak, budget if show_budget else 0)
    unit, size = pick_unit(top)
    for x, p in enumerate(phases):
        _stack(ax, x, estimate.phases[p], size)
        ax.text(x, estimate.phases[p].total / size, fmt_bytes(estimate.phases[p].total), ha="center", va="bottom",
                fontsize=8, weight="bold" if p == estimate.peak_phase else "normal")
    ax.set_xticks(range(len(phases)), [f"{p}\n(peak)" if p == estimate.peak_phase else p for p in phases])
    ax.set_ylim(0, top / size * 1.15)
    ax.set_ylabel(f"predicted memory ({unit})")
    ax.spines[["top", "right"]].set_visible(False)
    title = f"predicted: {estimate.label}" + (f" ({kernels} kernels)" if kernels else "")
    extra = []  # legend entries above the categories: the budget line
    if budget is not None:
        fits = estimate.peak.total <= budget
        verdict = (f"fits: {fmt_bytes(estimate.peak.total)} of {fmt_bytes(budget)}" if fits
                   else f"does not fit: {fmt_bytes(estimate.peak.total)} > {fmt_bytes(budget)} budget")
        if show_budget:
            ax.axhline(budget / size, color=DOES_NOT_FIT, linewidth=1.5)
            extra.append(Line2D([], [], color=DOES_NOT_FIT, linewidth=1.5, label=f"budget {fmt_bytes(budget)}"))
        else:
            verdict += " (budget line off the chart)"
        ax.text(0.0, 1.02, verdict, transform=ax.transAxes, fontsize=10, weight="bold",
                color=FITS if fits else DOES_NOT_FIT)
        ax.set_title(title, fontsize=9, pad=22)
    else:
        ax.set_title(title, fontsize=9)
    _legend(ax, CATEGORIES[::-1], extra=extra, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig
