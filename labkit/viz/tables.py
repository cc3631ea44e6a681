"""Tables of memory: which models fit in which budgets (a figure), and bytes per category per phase (text or HTML)."""

from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from labkit.memory.report import CATEGORIES, Breakdown
from labkit.memory.table import wrap_line
from labkit.memory.units import GiB, fmt_bytes, parse_bytes

from .style import DOES_NOT_FIT, FITS, _axes


def fit_table(rows, budgets, ax=None, title: str = "which models fit in which memory") -> Figure:
    """A grid of (model name, peak bytes) rows against budgets (bytes, '16GiB', or {label: size}):
    green cells fit, red cells do not; each cell says how much of the budget the peak needs."""
    if isinstance(budgets, dict):
        cols = [(str(k), parse_bytes(v)) for k, v in budgets.items()]
    else:
        cols = [(fmt_bytes(parse_bytes(b), 0 if parse_bytes(b) % GiB == 0 else 1), parse_bytes(b)) for b in budgets]
    rows = [(str(name), int(peak)) for name, peak in rows]
    width = 2.0 + 1.3 * len(cols)
    fig, ax = _axes(ax, (width, 1.1 + 0.55 * len(rows)))
    for i, (_, peak) in enumerate(rows):
        for j, (_, cap) in enumerate(cols):
            fits = peak <= cap
            ax.add_patch(Rectangle((j, i), 1, 1, facecolor="#C8E6C9" if fits else "#FFCDD2", edgecolor="white", linewidth=2))
            need = peak / cap
            text = f"fits ({need:.0%})" if fits else f"no ({need:.1f}x)" if need < 100 else "no (>100x)"
            ax.text(j + 0.5, i + 0.5, text, ha="center", va="center", fontsize=9, color=FITS if fits else DOES_NOT_FIT)
    ax.set_xlim(0, len(cols))
    ax.set_ylim(len(rows), 0)
    ax.set_xticks([j + 0.5 for j in range(len(cols))], [name for name, _ in cols])
    ax.set_yticks([i + 0.5 for i in range(len(rows))], [f"{name}\npeak {fmt_bytes(peak, 1)}" for name, peak in rows])
    ax.xaxis.tick_top()
    ax.tick_params(length=0)
    for s in ax.spines.values():
        s.set_visible(False)
    ax.set_title(title + "\n(cell: peak as a share of the budget)", fontsize=10, pad=28)
    if ax.figure is fig and len(fig.axes) == 1:
        fig.subplots_adjust(left=1.9 / width, right=0.98, top=1 - 1.0 / fig.get_figheight(), bottom=0.04)
    return fig


class BreakdownTable:
    """Bytes per category (rows) at the peak of each phase (columns): prints as text, shows as HTML."""

    def __init__(self, title: str, header: list[str], rows: list[list]):
        self.title, self.header, self.rows = title, header, rows  # rows: [name, bytes, bytes, ...]

    def _cells(self) -> list[list[str]]:
        return [self.header] + [[r[0]] + [fmt_bytes(v) for v in r[1:]] for r in self.rows]

    def __str__(self) -> str:
        cells = self._cells()
        widths = [max(len(row[j]) for row in cells) for j in range(len(self.header))]
        lines = [wrap_line(self.title)] if self.title else []  # a long label wraps at words
        for k, row in enumerate(cells):
            lines.append("  ".join(row[0].ljust(widths[0]) if j == 0 else v.rjust(widths[j]) for j, v in enumerate(row)))
            if k == 0 or k == len(cells) - 2:
                lines.append("  ".join("-" * w for w in widths))
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        cells = self._cells()
        head = "".join(f"<th>{h}</th>" for h in cells[0])
        body = "".join(
            "<tr>" + "".join(f"<td style='text-align:{'left' if j == 0 else 'right'}'>{'<b>%s</b>' % v if i == len(cells) - 2 else v}</td>"
                             for j, v in enumerate(row)) + "</tr>"
            for i, row in enumerate(cells[1:]))
        return f"<table><caption>{self.title}</caption><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def breakdown_table(result) -> BreakdownTable:
    """Bytes per category and in total for an Estimate or a Measurement (one column per phase, the
    peak phase marked), or for a single Breakdown."""
    if isinstance(result, Breakdown):
        phases, title = {"bytes": result}, ""
    else:
        phases, title = result.phases, getattr(result, "label", "")
    peak = None if isinstance(result, Breakdown) else result.peak_phase
    header = ["category"] + [f"{p} (peak)" if p == peak else p for p in phases]
    rows = [[c.value] + [b.bytes[c] for b in phases.values()] for c in CATEGORIES]
    rows.append(["total"] + [b.total for b in phases.values()])
    return BreakdownTable(title, header, rows)
