"""Lesson 13's waterfall panel: pick a training config (labkit's examples in torchtune's and axolotl's
schemas), see what each of its knobs buys from the naive step, untick a knob to take it out of the recipe
and watch the bars move (labkit.plan.configs reads the config, labkit.plan.waterfall computes the bars)."""

from __future__ import annotations

import html

import ipywidgets as widgets

from labkit.memory import GiB, fmt_bytes

from .style import DOES_NOT_FIT, FITS, _Panel, beside, to_png
from .waterfall import waterfall_chart


class WaterfallPanel(_Panel):
    """Controls: the config, a checkbox per knob (greyed where the config does not use it), the budget per
    device (GiB). Every change: read the config, take out the unticked knobs, one waterfall, its chart and
    verdict. layers: build the config's model with this many blocks (smoke mode), None for all of them."""

    def __init__(self, config: str | None = None, budget_gib: float = 24.0, layers: int | None = None):
        from labkit.plan.configs import example_configs
        from labkit.plan.waterfall import ORDER

        self.examples = example_configs()
        self.layers = layers
        style = {"description_width": "70px"}
        names = list(self.examples)
        self.config = widgets.Dropdown(options=names, value=config or names[0], description="config",
                                       style=style, layout=widgets.Layout(width="420px"))
        self.budget = widgets.BoundedFloatText(value=budget_gib, min=0.001, max=4096, step=1,
                                               description="GiB", style=style,
                                               layout=widgets.Layout(width="180px"))
        self.knobs = {k: widgets.Checkbox(value=True, description=k.value, indent=False,
                                          layout=widgets.Layout(width="260px")) for k in ORDER}
        self.chart = widgets.Image(format="png")
        self.verdict = widgets.HTML()
        self.notes = widgets.HTML()
        self.last = self.last_reading = self.last_error = None
        boxes = widgets.VBox(list(self.knobs.values()))
        self.widget = widgets.VBox([beside(self.config, self.budget), beside(boxes, self.chart), self.verdict,
                                    self.notes])
        self._watch([self.config, self.budget, *self.knobs.values()])

    @property
    def budget_bytes(self) -> int:
        return int(self.budget.value * GiB)

    def _on_change(self, _change=None) -> None:
        from labkit.plan.configs import read_config
        from labkit.plan.waterfall import knobs_used, waterfall, without

        try:
            reading = read_config(self.examples[self.config.value])
            recipe = reading.recipe
            if self.layers:
                recipe = recipe.replace(overrides=(("num_hidden_layers", self.layers),))
            used = knobs_used(recipe)
            for knob, box in self.knobs.items():
                box.disabled = knob not in used
            off = [k for k in used if not self.knobs[k].value]
            w = waterfall(without(recipe, off), alone=False)
        except ValueError as e:
            self.last, self.last_error = None, e
            self.verdict.value = f"<b style='color:{DOES_NOT_FIT}'>{html.escape(str(e))}</b>"
            return
        self.last, self.last_reading, self.last_error = w, reading, None
        self.chart.value = to_png(waterfall_chart(w, budget=self.budget_bytes))
        peak = w.steps[-1].peak
        fits = peak <= self.budget_bytes
        word = "fits" if fits else "does not fit"
        out = ", ".join(k.value for k in off) or "none"
        self.verdict.value = (f"<b style='color:{FITS if fits else DOES_NOT_FIT}'>{html.escape(word)}: "
                              f"{fmt_bytes(peak)} per device against {fmt_bytes(self.budget_bytes)}</b>"
                              f" (knobs taken out: {html.escape(out)})")
        lines = [f"{k}: {why}" for k, why in reading.approximated]
        lines += [f"{k} refused by the estimator: {why}" for k, why in ((k.value, y) for k, y in w.refused)]
        self.notes.value = "<br>".join(html.escape(line) for line in lines)
