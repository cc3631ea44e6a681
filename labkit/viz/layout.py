"""Views of a model split over devices: the pipeline chart (ranks x time), per-rank memory bars, and a panel
whose controls (stages, micro-batches, schedule, tensor-parallel degree) redraw both at once."""

from __future__ import annotations

import html

from matplotlib.figure import Figure

from labkit.memory.report import CATEGORIES
from labkit.memory.units import fmt_bytes

from .style import DOES_NOT_FIT, FITS, _axes, _legend, _Panel, _stack, beside, pick_unit, to_png

__all__ = ["pipeline_chart", "rank_bars", "LayoutPanel"]

F_COLOR, B_COLOR = "#4C72B0", "#DD8452"


def pipeline_chart(timelines, ax=None, title: str | None = None, bubble: float | None = None) -> Figure:
    """Each stage's forwards (blue) and backwards (orange) on a time line, stage 0 at the top, each box
    labelled with its micro-batch: the idle gaps are the bubble. timelines: per stage, (kind, i, start, end)
    (labkit.distributed.pipeline.simulate, or StepRun.times as measured)."""
    fig, ax = _axes(ax, (8, 0.6 + 0.55 * len(timelines)))
    t0 = min(t[2] for tl in timelines for t in tl)
    span = max(t[3] for tl in timelines for t in tl) - t0
    for s, tl in enumerate(timelines):
        for kind, i, start, end in tl:
            ax.barh(s, end - start, left=start - t0, color=F_COLOR if kind == "F" else B_COLOR, edgecolor="white",
                    height=0.8)
            if (end - start) > span / 60:
                ax.text((start + end) / 2 - t0, s, str(i), ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(timelines)), [f"stage {s}" for s in range(len(timelines))])
    ax.invert_yaxis()
    ax.set_xlabel("time" + (" (s)" if span < 1e3 and not float(span).is_integer() else ""))
    ax.spines[["top", "right"]].set_visible(False)
    head = title or "pipeline"
    if bubble is not None:
        head += f": bubble {bubble:.1%} of the step"
    ax.set_title(head, fontsize=9)
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color=F_COLOR, label="forward"), Patch(color=B_COLOR, label="backward")],
              loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return fig


def rank_bars(estimates, ax=None, budget: int | None = None, labels=None, measured=None) -> Figure:
    """Each rank's predicted peak as a bar stacked by category (and, given `measured` totals, a black tick
    at each rank's measured peak)."""
    n = len(estimates)
    fig, ax = _axes(ax, (max(7.0, 3.0 + 0.5 * n), 4), right=1 - 2.0 / max(7.0, 3.0 + 0.5 * n))  # >= 0.5 in. a bar
    top = max(max(e.peak.total for e in estimates), budget or 0, max(measured or [0]))
    unit, size = pick_unit(top)
    for x, e in enumerate(estimates):
        _stack(ax, x, e.peak, size)
        ax.text(x, e.peak.total / size, fmt_bytes(e.peak.total), ha="center", va="bottom", fontsize=7,
                rotation=90 if n > 8 else 0)
        if measured is not None:
            ax.plot([x - 0.4, x + 0.4], [measured[x] / size] * 2, color="black", linewidth=2)
    ax.set_xticks(range(len(estimates)), labels or [f"rank {k}" for k in range(len(estimates))], fontsize=8)
    if budget is not None:
        ax.axhline(budget / size, color=DOES_NOT_FIT, linewidth=1.2)
    ax.set_ylim(0, top / size * (1.35 if n > 8 else 1.15))  # room for the rotated totals
    ax.set_ylabel(f"predicted peak per rank ({unit})")
    ax.spines[["top", "right"]].set_visible(False)
    _legend(ax, CATEGORIES[::-1], loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


NO_MEASURE = ("This panel predicts only (it has no measure button): a measurement starts one process per rank, "
              "up to 8 x 8 here. Section 4 measured every rank of p = 2 and t = 2 with its own ledger.")
DEFAULTS = dict(pp=2, micro=4, schedule="1f1b", tp=1, sp=False)  # what the panel opens on: 2 stages, 4 micro-batches


class LayoutPanel(_Panel):
    """Stages, micro-batches, schedule, tensor-parallel degree and sequence parallelism for one model; every change
    makes two library calls (labkit.estimate.estimate_ranks and labkit.distributed.pipeline.simulate) and
    redraws the per-rank bars and the pipeline chart with its bubble. `reset()` returns to DEFAULTS."""

    def __init__(self, model, batch: int, seq: int, dtype: str = "fp32", optimizer: str = "adamw",
                 device: str = "cpu", max_stages: int = 8, max_tp: int = 8):
        import ipywidgets as widgets

        self.model, self.batch, self.seq, self.dtype, self.optimizer, self.device = model, batch, seq, dtype, optimizer, device
        style = {"description_width": "110px"}
        self.pp = widgets.IntSlider(value=DEFAULTS["pp"], min=1, max=max_stages, description="stages p", style=style,
                                    continuous_update=False)
        self.micro = widgets.SelectionSlider(options=[d for d in range(1, batch + 1) if batch % d == 0],
                                             value=self._default_micro(batch), description="micro-batches m",
                                             style=style, continuous_update=False)
        self.schedule = widgets.ToggleButtons(options=["gpipe", "1f1b"], value=DEFAULTS["schedule"], description="schedule",
                                              style=style)
        self.tp = widgets.SelectionSlider(options=[t for t in (1, 2, 4, 8) if t <= max_tp], value=DEFAULTS["tp"],
                                          description="tensor parallel t", style=style, continuous_update=False)
        self.sp = widgets.Checkbox(value=DEFAULTS["sp"], description="sequence parallel", style=style)
        self.bars, self.chart = widgets.Image(format="png"), widgets.Image(format="png")
        self.chart.layout.max_width = "100%"  # a narrow window scales the chart down rather than cut it
        self.words = widgets.HTML()
        self.note = widgets.HTML(f"<i>{html.escape(NO_MEASURE)}</i>")
        self.last_estimates = self.last_bubble = self.last_error = None
        self._hold = False
        self.widget = widgets.VBox([beside(widgets.VBox([self.pp, self.micro, self.schedule, self.tp, self.sp]),
                                           self.bars), self.chart, self.words, self.note])
        self._watch((self.pp, self.micro, self.schedule, self.tp, self.sp))

    @staticmethod
    def _default_micro(batch: int) -> int:
        m = min(DEFAULTS["micro"], batch)
        return m if batch % m == 0 else 1

    def reset(self) -> None:
        """Back to DEFAULTS (one redraw): a lesson's assert cell ends here, so Run All leaves a readable panel."""
        self._hold = True
        try:
            self.pp.value, self.micro.value = DEFAULTS["pp"], self._default_micro(self.batch)
            self.schedule.value, self.tp.value, self.sp.value = DEFAULTS["schedule"], DEFAULTS["tp"], DEFAULTS["sp"]
        finally:
            self._hold = False
        self._on_change()

    def _on_change(self, _change=None) -> None:
        from labkit.distributed.pipeline import measured_bubble, simulate
        from labkit.estimate import estimate_ranks

        if self._hold:
            return
        p, m, t = int(self.pp.value), int(self.micro.value), int(self.tp.value)
        sp = bool(self.sp.value) and t > 1
        try:
            ests = estimate_ranks(self.model, self.batch, self.seq, dtype=self.dtype, optimizer=self.optimizer,
                                  device=self.device, pp=p, tp=t, micro_batch=self.batch // m,
                                  schedule=self.schedule.value if p > 1 else "1f1b", sequence_parallel=sp)
        except ValueError as e:
            self.last_estimates, self.last_error = None, e
            self.words.value = f"<b style='color:{DOES_NOT_FIT}'>{html.escape(str(e))}</b>"
            return
        self.last_estimates, self.last_error = ests, None
        labels = [f"s{k // t}" + (f" t{k % t}" if t > 1 else "") for k in range(len(ests))]
        self.bars.value = to_png(rank_bars(ests, labels=labels), dpi=70, tight=False)
        sim = simulate(self.schedule.value, m, p)
        self.last_bubble = measured_bubble(sim)
        self.chart.value = to_png(pipeline_chart(sim, title=f"{self.schedule.value}, p={p}, m={m} (forward 1, "
                                                            "backward 2)", bubble=self.last_bubble), dpi=70)
        top = max(ests, key=lambda e: e.peak.total)
        self.words.value = (f"<b style='color:{FITS}'>largest rank {fmt_bytes(top.peak.total)} "
                            f"({html.escape(top.label)}); bubble (p-1)/(m+p-1) = {p - 1}/{m + p - 1} = "
                            f"{self.last_bubble:.1%}</b>")
