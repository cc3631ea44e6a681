"""Widget panels: controls redraw the predicted memory at once; a button measures real steps under a budget.

`RecipePanel` is the shape every panel shares (controls -> Recipe keywords -> one `estimate` call -> bars;
the button -> one `run_within_budget(measure_step)` call -> predicted vs measured and the timeline);
`MemoryPanel` (lesson 01) is the first of them, the lessons' own panels are in .lesson_panels."""

from __future__ import annotations

import html

import ipywidgets as widgets
import torch
from IPython.display import Image, display
from matplotlib.figure import Figure

from labkit.memory import GiB, fmt_bytes, run_within_budget
from labkit.estimate import DTYPES, OPTIMIZERS, Recipe, estimate, spec_from
from labkit.run import measure_step
from labkit.models.hf import PRESETS

from .live import _in_ipython
from .plots import compare_bar, prediction_bar, timeline
from .style import DOES_NOT_FIT, FITS, _Panel, beside, log_grid, to_png

RANKS = tuple(2**k for k in range(11))  # GaLore ranks offered: 1 to 1024 (the paper's 7B model uses 1024)


def _defaults() -> dict:
    """Starting values from the device profile (labkit.device), or small CPU-sized ones without it."""
    out = dict(model="gpt2-tiny", batch=8, seq=128, dtype="fp32", budget_gib=1.0, device="cpu", limit=2 * GiB)
    try:
        from labkit import device as dev
    except ImportError:
        return out
    info = dev.describe()
    prof = dev.profile(info)
    kind = "cuda" if info.kind == "cuda" else "cpu"  # the estimator and the runner know cpu and cuda
    memory = info.total_memory or 8 * GiB
    # what this machine can afford to run for real: most of a GPU; on a CPU a few seconds of work
    limit = int(0.8 * memory) if kind == "cuda" else min(2 * GiB, memory // 4)
    out.update(model=prof.hf_preset if prof.hf_preset in PRESETS else "gpt2-tiny", batch=prof.batch,
               seq=prof.seq, dtype=prof.dtype, budget_gib=prof.budget_gib, device=kind, limit=limit)
    return out


STYLE = {"description_width": "90px"}  # room for every control's name


def with_tooltip(widget: widgets.Widget, text: str) -> widgets.Widget:
    """`widget` with a hover text, on ipywidgets 7 and 8 alike (Colab ships 7.7).

    ipywidgets 8 gives every control `tooltip`; 7 gives a slider or dropdown `description_tooltip` (which 8
    keeps only as a deprecated alias) and only buttons `tooltip`. A keyword 7 does not know is dropped with
    a warning, so the text is set through whichever trait the widget has.
    """
    setattr(widget, "tooltip" if widget.has_trait("tooltip") else "description_tooltip", text)
    return widget
BUDGET_RANGE = (-20, 11)  # the budget slider's range, powers of two of a GiB: 1 KiB to 2 TiB
BUDGET_STEP = 0.125  # the budget slider's step, in powers of two (x1.09 a step)
SEQ_MAX = 131072  # the seq slider's end for models whose positions are not bounded lower (llama3.2-1b's 128 Ki)


def say(text: str, color: str) -> str:
    """One style for every verdict and message (fits, does not fit, an error): bold, coloured, wrapping
    between words like prose (not a monospace line cut mid-word)."""
    return (f"<div style='color:{color}; font-weight:600; white-space:normal; word-break:normal; "
            f"overflow-wrap:break-word; line-height:1.4'>{html.escape(text)}</div>")


class RecipePanel(_Panel):
    """Controls that choose a recipe, a budget, the predicted bars, and a button that measures real steps.

    A subclass makes its controls, passes them to `__init__`, and says what they mean in `recipe()`:
    the keywords of `labkit.estimate.Recipe` (model, batch, seq, dtype and the technique's knobs;
    `fixed` holds the ones no control changes). `describe(est)` may add one clause about the estimate.
    Every control change clears the last measurement and calls `estimate` once; the button calls
    `run_within_budget(measure_step)` once. Tests read `last_estimate`, `last_result`, `last_figure`
    and `last_error`.
    """

    def __init__(self, controls, budget: int, *, fixed: dict | None = None, kind: str = "cpu", device=None,
                 data=None, steps: int = 2, measure_limit: int | None = None):
        if budget is None or budget <= 0:
            raise ValueError(f"budget must be a positive number of bytes, got {budget!r}")
        self.fixed = dict(fixed or {})
        self.kind = kind  # the kernels the estimate models: "cpu" or "cuda"
        self.device = kind if device is None else device  # where the button runs the steps
        self.data, self.steps, self.measure_limit = data, steps, measure_limit
        lo, hi = log_grid(budget / GiB, *BUDGET_RANGE, BUDGET_STEP)  # its grid passes through the given budget
        self.budget = widgets.FloatLogSlider(value=budget / GiB, base=2, min=lo, max=hi, step=BUDGET_STEP,
                                             description="budget", readout=False, continuous_update=False,
                                             style=STYLE)  # value in GiB
        self.budget_readout = widgets.Label()  # the budget in the unit that reads best: "3.13 MiB", "24.00 GiB"
        self.prediction = widgets.Image(format="png")  # the predicted bars, redrawn on every change
        self.verdict = widgets.HTML()  # the prediction in words: fits / does not fit, and what measuring offers
        self.button = widgets.Button(description=f"Measure {steps} step" + ("s" if steps > 1 else ""),
                                     button_style="primary", icon="play", layout=widgets.Layout(width="auto"),
                                     tooltip=f"run {steps} real training steps under the budget")
        self.message = widgets.HTML()  # the measurement's outcome in words
        self.output = widgets.Output()  # the measurement's figures
        self.last_estimate = self.last_result = self.last_figure = self.last_error = None
        self.controls = (*controls, self.budget)
        self.button.on_click(self._on_measure)
        self.widget = widgets.VBox([
            beside(widgets.VBox([*controls, widgets.HBox([self.budget, self.budget_readout])]), self.prediction),
            self.verdict, self.button, self.message, self.output,
        ])
        self._watch(self.controls)

    # ---- what a subclass says -----------------------------------------------------------------
    def recipe(self) -> dict:
        """The Recipe keywords the controls choose (besides `fixed`); may enable or disable controls."""
        return {}

    def describe(self, est) -> str:
        """One clause about the estimate for the verdict line, e.g. 'optimizer state 1.20 MiB'."""
        return ""

    # ---- reading the controls ---------------------------------------------------------------
    def _keywords(self) -> dict:
        return {**self.fixed, **self.recipe()}

    def _budget_bytes(self) -> int:
        return int(self.budget.value * GiB)

    # ---- callbacks: read the controls, make one library call, draw ---------------------------
    def _on_change(self, _change=None) -> None:
        self._clear_measurement()  # it was made with other controls: it no longer describes them
        self.budget_readout.value = fmt_bytes(self._budget_bytes())
        try:
            est = estimate(**self._keywords(), device=self.kind)
        except ValueError as e:  # a combination the estimator refuses, e.g. a sequence longer than the model's positions
            self.last_estimate = None
            self._draw_prediction_error(str(e))
            return
        self.last_estimate = est
        self._draw_prediction(est, self._budget_bytes())

    def _on_measure(self, _button=None) -> None:
        if self.button.disabled:
            return
        kw, budget = dict(self._keywords(), device=torch.device(self.device).type), self._budget_bytes()
        self._clear_measurement()
        self.button.disabled = True
        self.message.value = say(f"measuring {self.steps} training steps (from the second on, the optimizer "
                                 f"state is there too)...", "#555555")
        try:
            result = run_within_budget(
                lambda: measure_step(Recipe.of(**kw), steps=self.steps, budget=budget, data=self.data), budget)
        except Exception as e:  # a widget callback's traceback never reaches the notebook: say it here
            self.last_error = e
            self.message.value = say(f"the measurement failed: {type(e).__name__}: {e}", DOES_NOT_FIT)
            return
        finally:
            self.button.disabled = False
        self.last_result = result
        self._draw_result(result, budget)

    def _clear_measurement(self) -> None:
        self.last_result = self.last_figure = self.last_error = None
        self.message.value = ""
        if _in_ipython():
            self.output.clear_output()

    # ---- drawing ----------------------------------------------------------------------------
    def _draw_prediction(self, est, budget: int) -> None:
        self.prediction.value = to_png(prediction_bar(est, budget, kernels=self.kind), dpi=80, tight=False)
        fits = est.peak.total <= budget
        words = (f"predicted peak {fmt_bytes(est.peak.total)} ({est.peak_phase}, {self.kind} kernels): "
                 + ("fits" if fits else "does not fit") + f" in {fmt_bytes(budget)}")
        extra = self.describe(est)
        if extra:
            words += f"; {extra}"
        can_measure = self.measure_limit is None or est.peak.total <= self.measure_limit
        self.button.disabled = not can_measure
        self.button.tooltip = (f"run {self.steps} real training steps under the budget" if can_measure
                               else "too big to run on this machine")
        if can_measure:
            words += " — measure it to check" + ("" if fits else " (expect an out-of-memory)")
        else:
            words += (f" — too big to measure here (this machine runs steps up to "
                      f"{fmt_bytes(self.measure_limit)}); make it smaller to measure")
        self.verdict.value = say(words, FITS if fits else DOES_NOT_FIT)

    def _draw_prediction_error(self, text: str) -> None:
        fig = Figure(figsize=(7, 4))  # the predicted bars' size, so the picture keeps its shape
        fig.text(0.5, 0.5, "no prediction:\n" + text, ha="center", va="center", wrap=True, color=DOES_NOT_FIT,
                 fontsize=11)
        self.prediction.value = to_png(fig, dpi=80, tight=False)
        self.verdict.value = say(f"no prediction: {text}", DOES_NOT_FIT)
        self.button.disabled = True

    def _draw_result(self, result, budget: int) -> None:
        self.message.value = say(result.message, FITS if result.fits else DOES_NOT_FIT)
        self.last_figure = None
        if result.measurement is None:
            return
        fig = Figure(figsize=(10, 8.4))
        top, bottom = fig.subfigures(2, 1)
        compare_bar(self.last_estimate, result.measurement, ax=top.subplots())
        top.subplots_adjust(left=0.09, right=0.40, bottom=0.16, top=0.86)
        timeline(result.measurement, ax=bottom.subplots(), budget=budget)
        bottom.subplots_adjust(left=0.09, right=0.8, bottom=0.14, top=0.82)
        self.last_figure = fig
        if _in_ipython():  # outside a kernel there is nowhere to show it; tests read last_figure
            with self.output:
                display(Image(data=to_png(fig, dpi=80), format="png"))


class MemoryPanel(RecipePanel):
    """Predict one training step's memory for any preset; measure it for real when this machine can.

    Every control change redraws the prediction (one call: `labkit.estimate`). The button
    runs two real steps under the budget (one call: `run_within_budget(measure_step)`) and draws
    predicted vs measured and the memory timeline, or says why the step does not fit. It is offered
    only while the predicted step fits what this machine can run (the device profile's limit).
    The rank slider is GaLore's rank: enabled for the "galore" and "galore8bit" optimizers only.
    """

    def __init__(self, model: str | None = None, batch: int | None = None, seq: int | None = None,
                 dtype: str | None = None, optimizer: str = "adamw", budget_gib: float | None = None, rank: int = 16):
        d = _defaults()
        model = model or d["model"]
        positions = self._positions(model)
        self.model = widgets.Dropdown(options=list(PRESETS), value=model, description="model", style=STYLE)
        self.batch = widgets.IntSlider(value=batch or d["batch"], min=1, max=64, description="batch", style=STYLE,
                                        continuous_update=False)  # redraw on release, not per pixel
        # the sequence runs to the model's positions (gpt2-tiny's 128, gpt2's 1024), and follows the model
        self.seq = widgets.IntSlider(value=min(seq or d["seq"], positions), min=16, max=positions, step=16,
                                     description="seq", style=STYLE, continuous_update=False)
        self.model.observe(self._bound_seq, names="value")  # before the redraw's observer: seq is bounded first
        self.dtype = widgets.Dropdown(options=list(DTYPES), value=dtype or d["dtype"], description="dtype", style=STYLE)
        self.optimizer = widgets.Dropdown(options=list(OPTIMIZERS), value=optimizer, description="optimizer", style=STYLE)
        self.rank = with_tooltip(
            widgets.SelectionSlider(options=sorted({*RANKS, int(rank)}), value=int(rank), description="rank",
                                    style=STYLE, continuous_update=False),
            "GaLore's rank: the optimizer state lives in a rank-r projection")
        super().__init__([self.model, self.batch, self.seq, self.dtype, self.optimizer, self.rank],
                         int((budget_gib or d["budget_gib"]) * GiB), kind=d["device"], measure_limit=int(d["limit"]))

    @staticmethod
    def _positions(model: str) -> int:
        """The longest sequence the model takes: its positions (the seq slider's end)."""
        return min(spec_from(model).max_positions or SEQ_MAX, SEQ_MAX)

    def _bound_seq(self, change) -> None:
        """A new model: the seq slider ends at its positions (a longer seq is cut to them: one redraw more)."""
        self.seq.max = max(self._positions(change["new"]), self.seq.min)

    def recipe(self) -> dict:
        galore = self.optimizer.value.startswith("galore")
        self.rank.disabled = not galore  # other optimizers have no rank
        args = dict(model=self.model.value, batch=int(self.batch.value), seq=int(self.seq.value),
                    dtype=self.dtype.value, optimizer=self.optimizer.value)
        if galore:
            args["rank"] = int(self.rank.value)
        return args
