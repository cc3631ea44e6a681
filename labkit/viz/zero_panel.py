"""The ZeRO panel: ranks, stage, offload, model and a per-device budget redraw each stage's per-rank bytes; a
button runs 2 real ranks under that budget (each rank's ledger raises the out-of-memory a device of that size
would) and draws measured vs predicted for each, one rank under the other."""

from __future__ import annotations

import html

import ipywidgets as widgets
from IPython.display import Image, display
from matplotlib.figure import Figure

from labkit.estimate import Recipe
from labkit.estimate.zero_terms import stages
from labkit.memory import GiB, fmt_bytes
from labkit.memory.report import CATEGORIES
from labkit.models.gpt import GPTConfig

from .live import _in_ipython
from .plots import compare_bar
from .style import DOES_NOT_FIT, FITS, _legend, _Panel, _stack, beside, log_grid, pick_unit, to_png

# labkit GPTs from tiny (measurable here in seconds) to the ZeRO paper's scale
MODELS = {
    "gpt-tiny (0.1M)": GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=2, n_embd=64),
    "gpt-small (0.8M)": GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128),
    "gpt2 (124M)": GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768),
    "gpt2-xl (1.6B)": GPTConfig(vocab_size=50304, block_size=1024, n_layer=48, n_head=25, n_embd=1600),
}
MEASURE_LIMIT = 64 * 2**20  # measure only steps this small: two ranks on a shared CPU in seconds


def stage_bars(ests: dict, budget: int, chosen: int, ax=None) -> Figure:
    """Per-rank predicted peak of each ZeRO stage as stacked bars by category, the budget line across."""
    fig = Figure(figsize=(7.5, 4)) if ax is None else ax.figure
    ax = ax or fig.add_axes([0.1, 0.14, 0.6, 0.74])
    top = max(max(e.peak.total for e in ests.values()), budget if budget <= 4 * max(e.peak.total for e in ests.values()) else 0)
    unit, size = pick_unit(top)
    for z, e in ests.items():
        _stack(ax, z, e.peak, size)
        fits = e.peak.total <= budget
        ax.text(z, e.peak.total / size, fmt_bytes(e.peak.total), ha="center", va="bottom", fontsize=8,
                color=FITS if fits else DOES_NOT_FIT, weight="bold" if z == chosen else "normal")
    if budget <= 4 * top:
        ax.axhline(budget / size, color=DOES_NOT_FIT, linewidth=1.5)
    ax.set_xticks(range(4), [f"ZeRO-{z}" + (" *" if z == chosen else "") for z in range(4)])
    ax.set_ylim(0, top / size * 1.15)
    ax.set_ylabel(f"per-rank peak ({unit})")
    ax.set_title(next(iter(ests.values())).label.split(" zero=")[0] + f", budget {fmt_bytes(budget)} per device",
                 fontsize=9)
    ax.spines[["top", "right"]].set_visible(False)
    _legend(ax, CATEGORIES[::-1], loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


class ZeroPanel(_Panel):
    """Per-rank memory of data parallelism and ZeRO-1/2/3. Controls: ranks, stage, offload, model, rows per rank,
    sequence, budget per device. Every change: one call (`zero_terms.stages`) and the bars. The button (for
    models small enough) runs 2 ranks (`dp_ranks.measure_ranks`) under the budget and draws each rank's measured
    vs predicted, or shows the out-of-memory a rank's ledger raised. A change of any control clears the last run's
    result: it belongs to the controls it ran with."""

    def __init__(self, model: str = "gpt-tiny (0.1M)", ranks: int = 2, stage: int = 3, offload: bool = False,
                 rows: int = 4, seq: int = 32, budget_gib: float = 0.01):
        style = {"description_width": "90px"}
        self.model = widgets.Dropdown(options=list(MODELS), value=model, description="model", style=style)
        self.ranks = widgets.Dropdown(options=[2**k for k in range(11)], value=ranks, description="ranks", style=style)
        self.stage = widgets.ToggleButtons(options=[0, 1, 2, 3], value=stage, description="ZeRO stage", style=style)
        self.offload = widgets.Checkbox(value=offload, description="offload optimizer state")
        self.rows = widgets.IntSlider(value=rows, min=1, max=64, description="rows / rank", style=style,
                                      continuous_update=False)
        self.seq = widgets.IntSlider(value=seq, min=8, max=1024, step=8, description="seq", style=style,
                                     continuous_update=False)
        lo, hi = log_grid(budget_gib, -12, 8, 0.25)  # the slider's grid passes through the budget given
        self.budget = widgets.FloatLogSlider(value=budget_gib, base=2, min=lo, max=hi, step=0.25,
                                             description="budget GiB", readout_format=".3g", style=style,
                                             continuous_update=False)
        self.prediction = widgets.Image(format="png")
        self.verdict = widgets.HTML()
        self.button = widgets.Button(description="Measure 2 ranks", button_style="primary", icon="play")
        self.message = widgets.HTML()
        self.output = widgets.Output()
        self.last_estimates = self.last_measurements = self.last_figure = self.last_error = None
        controls = (self.model, self.ranks, self.stage, self.offload, self.rows, self.seq, self.budget)
        self.button.on_click(self._on_run)
        self.widget = widgets.VBox([beside(widgets.VBox(list(controls)), self.prediction),
                                    self.verdict, self.button, self.message, self.output])
        self._watch(controls)

    def recipe(self, ranks: int | None = None) -> Recipe:
        """The chosen stage on `ranks` (default: the ranks chosen); one rank has nothing to shard, so there
        ZeRO is on only with its offload (labkit.estimate.zero_terms.stages)."""
        n = int(self.ranks.value) if ranks is None else ranks
        stage = int(self.stage.value)
        off = bool(self.offload.value) and stage > 0
        return Recipe(MODELS[self.model.value], batch=int(self.rows.value) * n, seq=int(self.seq.value), dp=n,
                      zero=stage if n > 1 or off else 0, zero_offload=off)

    def run_recipe(self) -> Recipe:
        """What the button runs: the chosen stage on 2 ranks, with the rows per rank and sequence chosen."""
        return self.recipe(ranks=2)

    def budget_bytes(self) -> int:
        return int(self.budget.value * GiB)

    def _on_change(self, _change=None) -> None:
        self.message.value, self.last_measurements, self.last_figure, self.last_error = "", None, None, None
        if _in_ipython():
            self.output.clear_output()
        try:
            ests = stages(self.recipe())
        except ValueError as e:
            self.last_estimates = None
            self.verdict.value = f"<b style='color:{DOES_NOT_FIT}'>no prediction: {e}</b>"
            self.button.disabled = True
            return
        self.last_estimates = ests
        budget = int(self.budget.value * GiB)
        self.prediction.value = to_png(stage_bars(ests, budget, int(self.stage.value)), dpi=80, tight=False)
        e = ests[int(self.stage.value)]
        fits = e.peak.total <= budget
        too_big = e.peak.total > MEASURE_LIMIT
        # a greyed button says why: the reason is in the verdict and on the button's hover text
        why = (f"too big to measure here: the button runs 2 ranks on this machine, for steps up to "
               f"{fmt_bytes(MEASURE_LIMIT)} per rank; a smaller model, fewer rows or a shorter seq can be measured")
        self.verdict.value = (f"<b style='color:{FITS if fits else DOES_NOT_FIT}'>ZeRO-{self.stage.value}: "
                              f"{fmt_bytes(e.peak.total)} per rank ({e.peak_phase}) "
                              f"{'fits' if fits else 'does not fit'} in {fmt_bytes(budget)}</b>"
                              + (f"<br><span style='color:#555555'>{html.escape(why)}</span>" if too_big else ""))
        self.button.disabled = too_big
        self.button.tooltip = why if too_big else "run 2 real ranks of this stage, each under the budget"

    def _on_run(self, _button=None) -> None:
        if self.button.disabled:
            return
        from labkit.distributed import RankFailed
        from labkit.distributed.dp_ranks import measure_ranks
        from labkit.estimate import estimate

        r, budget = self.run_recipe(), self.budget_bytes()
        est = estimate(r)
        fits = est.peak.total <= budget
        said = (f"predicted {fmt_bytes(est.peak.total)} per rank, which {'fits' if fits else 'does not fit'} in "
                f"{fmt_bytes(budget)}")
        self.button.disabled = True
        self.message.value = f"running 2 ranks, ZeRO-{r.zero}, each under a {fmt_bytes(budget)} budget ({said})..."
        try:
            ms = measure_ranks(r, world=2, budget=budget)
        except RankFailed as e:  # a rank's ledger went over the budget (or the rank failed): say which
            self.last_measurements, self.last_error = None, e
            if e.detail.startswith("SimulatedOutOfMemoryError"):
                self.message.value = (f"<b style='color:{DOES_NOT_FIT}'>2 ranks, ZeRO-{r.zero}: out of memory on "
                                      f"rank {e.rank} under its {fmt_bytes(budget)} budget ({said}): "
                                      f"{e.detail.split(': ', 1)[1]}</b>")
            else:
                self.message.value = f"<b style='color:{DOES_NOT_FIT}'>the run failed: {e}</b>"
            return
        except Exception as e:  # a callback's traceback never reaches the notebook: say it here
            self.last_measurements, self.last_error = None, e
            self.message.value = f"<b style='color:{DOES_NOT_FIT}'>the run failed: {type(e).__name__}: {e}</b>"
            return
        finally:
            self.button.disabled = False
        self.last_measurements, self.last_error = ms, None
        fig = Figure(figsize=(9.5, 8.4))  # one rank under the other, each in compare_bar's own layout
        for k, m in enumerate(ms):
            compare_bar(est, m, ax=fig.add_axes([0.09, 0.58 - 0.5 * k, 0.31, 0.35]))
        self.last_figure = fig
        worst = max(abs(m.peak.total / est.peak.total - 1) for m in ms)
        why = "" if fits else (" although the prediction is over it: the prediction is "
                               f"{max(m.peak.total for m in ms) / est.peak.total - 1:+.2%} off the fullest rank")
        self.message.value = (f"<b style='color:{FITS}'>2 ranks, ZeRO-{r.zero}, each under a {fmt_bytes(budget)} "
                              f"budget: measured {', '.join(fmt_bytes(m.peak.total) for m in ms)}, {said} "
                              f"(within {worst:.2%}){why}</b>")
        if _in_ipython():
            self.output.clear_output(wait=True)
            with self.output:
                display(Image(data=to_png(fig, dpi=80), format="png"))
