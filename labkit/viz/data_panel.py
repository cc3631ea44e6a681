"""Lesson 12's panel: dataset size, workers, prefetch, phi and a budget redraw both predictions at once
(`labkit.models.scaling.plan`); the button measures the CNN step at that phi under the budget."""

from __future__ import annotations

import html

import ipywidgets as widgets
from matplotlib.figure import Figure

from labkit.data.loading import LoaderConfig
from labkit.memory import MiB, fmt_bytes
from labkit.models.cnn import CNNConfig, predict
from labkit.models.scaling import measure_within, plan

from .style import DOES_NOT_FIT, FITS, _Panel, beside, log_grid, pick_unit, to_png

REPEATS = (1, 10, 100, 1000, 10000)


class DataScalingPanel(_Panel):
    """Thin: reads the controls, calls `plan(...)` (or `measure_within` for the button), draws."""

    def __init__(self, corpus_tokens: int, batch: int = 16, seq: int = 128, cnn_batch: int = 8,
                 budget_mib: float = 8.0, config: CNNConfig | None = None):
        self.corpus_tokens, self.batch, self.seq, self.cnn_batch = corpus_tokens, batch, seq, cnn_batch
        self.config = config or CNNConfig()
        style = {"description_width": "90px"}
        self.repeat = widgets.SelectionSlider(options=REPEATS, value=1, description="dataset x", style=style)
        self.workers = widgets.IntSlider(value=2, min=0, max=8, description="workers", style=style)
        self.prefetch = widgets.IntSlider(value=2, min=1, max=8, description="prefetch", style=style)
        self.phi = widgets.FloatSlider(value=1.0, min=0.0, max=6.0, step=0.5, description="phi", style=style)
        lo, hi = log_grid(budget_mib, 0, 10, 0.25)  # the slider's grid passes through the lesson's budget
        self.budget = widgets.FloatLogSlider(value=budget_mib, base=2, min=lo, max=hi, step=0.25,
                                             description="budget MiB", style=style)
        self.button = widgets.Button(description="Measure the CNN step", icon="play",
                                     layout=widgets.Layout(width="auto"))  # as wide as its words
        self.prediction = widgets.Image(format="png")
        self.verdict, self.message = widgets.HTML(), widgets.HTML()
        self.last_plan = self.last_result = self.last_figure = None  # tests read them
        controls = (self.repeat, self.workers, self.prefetch, self.phi, self.budget)
        self.button.on_click(self._on_measure)
        self.widget = widgets.VBox([beside(widgets.VBox(list(controls[:3])), widgets.VBox(list(controls[3:]))),
                                    self.prediction, self.verdict, self.button, self.message])
        self._watch(controls)

    def _budget_bytes(self) -> int:
        return int(self.budget.value * MiB)

    def _on_change(self, _change=None) -> None:
        self.prefetch.disabled = self.workers.value == 0  # prefetching needs workers
        loader = LoaderConfig(self.workers.value, self.prefetch.value, self.batch, self.seq)
        self.last_plan = plan(self.corpus_tokens, self.repeat.value, loader, self.phi.value, self.cnn_batch,
                              self._budget_bytes(), config=self.config)
        self._draw(self.last_plan)

    def _on_measure(self, _button=None) -> None:
        self.button.disabled = True
        try:
            fits, out = measure_within(self.config.at(self.phi.value), self.cnn_batch, self._budget_bytes())
        finally:
            self.button.disabled = False
        self.last_result = (fits, out)
        if fits:
            text = f"measured: peak {fmt_bytes(out.peak.total)}, saved activations {fmt_bytes(out.saved)}: fits"
        else:
            text = f"does not fit: {out}"
        self.message.value = f"<b style='color:{FITS if fits else DOES_NOT_FIT}'>{html.escape(text)}</b>"

    def _draw(self, p) -> None:
        fig = Figure(figsize=(10, 3.6))
        left, right = fig.subplots(1, 2)
        # a linear axis: disk and RAM drawn as far apart as they are (a log axis drew 1000x as a step of 3)
        unit, size = pick_unit(max(p.dataset_bytes, p.loader_bytes))
        sizes = [p.dataset_bytes, p.loader_bytes]
        left.bar(["dataset on disk", "loader RAM / rank"], [b / size for b in sizes], color=["#8C8C8C", "#4C72B0"])
        for x, b in enumerate(sizes):
            left.text(x, b / size, fmt_bytes(b), ha="center", va="bottom", fontsize=9)
        left.set_ylim(0, max(sizes) / size * 1.18)
        left.set_ylabel(unit)
        left.set_title(f"data x{self.repeat.value}: RAM does not follow the disk")
        budget = self._budget_bytes()
        colors = ["#55A868" if r <= budget else "#C44E52" for r in p.resident]
        right.bar([f"{phi:g}" for phi in p.phis], [r / MiB for r in p.resident], color=colors)
        right.axhline(budget / MiB, color="k", ls="--", lw=1, label=f"budget {fmt_bytes(budget)}")
        right.set_ylim(0, max(max(p.resident), budget) / MiB * 1.3)  # the legend above the bars and the line
        right.set_xlabel("phi")
        right.set_ylabel("MiB")
        right.set_title(f"CNN batch {self.cnn_batch}: params + buffers + saved activations")
        right.legend(loc="upper left")
        fig.tight_layout()
        self.last_figure = fig
        self.prediction.value = to_png(fig, dpi=80, tight=False)
        need = predict(self.config.at(self.phi.value), self.cnn_batch).resident
        fits = need <= budget
        best = "none" if p.best_phi is None else f"{p.best_phi:g}"
        self.verdict.value = (f"<b style='color:{FITS if fits else DOES_NOT_FIT}'>"
                              + html.escape(f"phi {self.phi.value:g} needs {fmt_bytes(need)}: "
                                            + ("fits" if fits else "does not fit") + f" in {fmt_bytes(budget)}; "
                                            f"largest phi that fits: {best}. Loader RAM per rank "
                                            f"{fmt_bytes(p.loader_bytes)} for {fmt_bytes(p.dataset_bytes)} on disk.")
                              + "</b>")
