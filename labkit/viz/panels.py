"""The memory panel: sliders redraw the predicted memory at once; a button measures one real step."""

from __future__ import annotations

import html

import ipywidgets as widgets
from IPython.display import Image, display
from matplotlib.figure import Figure

from labkit.memory import GiB, fmt_bytes, run_within_budget
from labkit.estimate import DTYPES, OPTIMIZERS, estimate, spec_from
from labkit.run import measure_step
from labkit.models.hf import PRESETS

from .live import _in_ipython
from .plots import compare_bar, prediction_bar, timeline
from .style import DOES_NOT_FIT, FITS, to_png

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


class MemoryPanel:
    """Predict one training step's memory for any preset; measure it for real when this machine can.

    Every control change redraws the prediction (one call: `labkit.estimate`). The button
    runs two real steps under the budget (one call: `run_within_budget(measure_step)`) and draws
    predicted vs measured and the memory timeline, or says why the step does not fit. It is offered
    only while the predicted step fits `measure_limit` bytes (default: what this machine can run).
    The rank slider is GaLore's rank: enabled for the "galore" and "galore8bit" optimizers only.
    """

    def __init__(self, model: str | None = None, batch: int | None = None, seq: int | None = None,
                 dtype: str | None = None, optimizer: str = "adamw", budget_gib: float | None = None,
                 measure_limit: int | None = None, steps: int = 2, rank: int = 16):
        d = _defaults()
        self.device, self.steps = d["device"], steps
        self.measure_limit = int(measure_limit or d["limit"])
        style = {"description_width": "80px"}
        model = model or d["model"]
        positions = spec_from(model).max_positions or d["seq"]  # the default seq must suit the model
        self.model = widgets.Dropdown(options=list(PRESETS), value=model, description="model", style=style)
        self.batch = widgets.IntSlider(value=batch or d["batch"], min=1, max=64, description="batch", style=style,
                                        continuous_update=False)  # redraw on release, not per pixel
        self.seq = widgets.IntSlider(value=seq or min(d["seq"], positions), min=16, max=4096, step=16, description="seq", style=style,
                                      continuous_update=False)
        self.dtype = widgets.Dropdown(options=list(DTYPES), value=dtype or d["dtype"], description="dtype", style=style)
        self.optimizer = widgets.Dropdown(options=list(OPTIMIZERS), value=optimizer, description="optimizer", style=style)
        self.rank = widgets.SelectionSlider(options=sorted({*RANKS, int(rank)}), value=int(rank), description="rank",
                                            style=style, continuous_update=False,
                                            tooltip="GaLore's rank: the optimizer state lives in a rank-r projection")
        self.budget = widgets.FloatLogSlider(value=budget_gib or d["budget_gib"], base=2, min=-10, max=11, step=0.25,
                                             description="budget GiB", readout_format=".3g", style=style,
                                             continuous_update=False)
        self.prediction = widgets.Image(format="png")  # the predicted bars, redrawn on every change
        self.verdict = widgets.HTML()  # fits / does not fit, and whether measuring is offered
        self.button = widgets.Button(description="Measure one step", button_style="primary", icon="play")
        self.message = widgets.HTML()  # the measurement's outcome in words
        self.output = widgets.Output()  # the measurement's figures
        self.last_estimate = self.last_result = self.last_figure = self.last_error = None
        controls = (self.model, self.batch, self.seq, self.dtype, self.optimizer, self.rank, self.budget)
        for w in controls:
            w.observe(self._on_change, names="value")
        self.button.on_click(self._on_measure)
        self.widget = widgets.VBox([
            widgets.HBox([widgets.VBox(list(controls)), self.prediction]),
            self.verdict, self.button, self.message, self.output,
        ])
        self._on_change()

    # ---- reading the controls ---------------------------------------------------------------
    def _args(self) -> dict:
        args = dict(model=self.model.value, batch=int(self.batch.value), seq=int(self.seq.value),
                    dtype=self.dtype.value, optimizer=self.optimizer.value)
        if self._galore():
            args["rank"] = int(self.rank.value)
        return args

    def _galore(self) -> bool:
        return self.optimizer.value.startswith("galore")

    def _budget_bytes(self) -> int:
        return int(self.budget.value * GiB)

    # ---- callbacks: read the controls, make one library call, draw ---------------------------
    def _on_change(self, _change=None) -> None:
        self.rank.disabled = not self._galore()  # other optimizers have no rank
        try:
            est = estimate(**self._args(), device=self.device)
        except ValueError as e:  # e.g. a sequence longer than the model's positions
            self.last_estimate = None
            self._draw_prediction_error(str(e))
            return
        self.last_estimate = est
        self._draw_prediction(est, self._budget_bytes())

    def _on_measure(self, _button=None) -> None:
        if self.button.disabled:
            return
        args, budget = self._args(), self._budget_bytes()
        self.button.disabled, self.message.value = True, f"measuring {self.steps} training steps (from the second on, optimizer state is there too)..."
        try:
            result = run_within_budget(
                lambda: measure_step(**args, steps=self.steps, budget=budget, device=self.device), budget)
        except Exception as e:  # a widget callback's traceback never reaches the notebook: say it here
            self.last_result, self.last_error = None, e
            self.message.value = _html(f"the measurement failed: {type(e).__name__}: {e}", DOES_NOT_FIT)
            return
        finally:
            self.button.disabled = False
        self.last_result, self.last_error = result, None
        self._draw_result(result, budget)

    # ---- drawing ----------------------------------------------------------------------------
    def _draw_prediction(self, est, budget: int) -> None:
        fig = prediction_bar(est, budget)
        self.prediction.value = to_png(fig, dpi=80, tight=False)
        fits = est.peak.total <= budget
        words = (f"predicted peak {fmt_bytes(est.peak.total)} ({est.peak_phase}): "
                 + ("fits" if fits else "does not fit") + f" in {fmt_bytes(budget)}")
        can_measure = est.peak.total <= self.measure_limit
        self.button.disabled = not can_measure
        self.button.tooltip = "" if can_measure else "too big to run on this machine"
        if can_measure:
            words += " — measure it to check" + ("" if fits else " (expect an out-of-memory)")
        else:
            words += (f" — too big to measure here (this machine runs steps up to "
                      f"{fmt_bytes(self.measure_limit)}); pick a smaller model, batch or seq to measure")
        self.verdict.value = _html(words, FITS if fits else DOES_NOT_FIT)

    def _draw_prediction_error(self, text: str) -> None:
        fig = Figure(figsize=(7, 4))
        fig.text(0.5, 0.5, "no prediction:\n" + text, ha="center", va="center", wrap=True, color=DOES_NOT_FIT)
        self.prediction.value = to_png(fig, dpi=80)
        self.verdict.value = _html(f"no prediction: {text}", DOES_NOT_FIT)
        self.button.disabled = True

    def _draw_result(self, result, budget: int) -> None:
        self.message.value = _html(result.message, FITS if result.fits else DOES_NOT_FIT)
        self.last_figure = None
        if _in_ipython():
            self.output.clear_output(wait=True)
        if result.measurement is None:
            return
        fig = Figure(figsize=(10, 8.4))
        top, bottom = fig.subfigures(2, 1)
        compare_bar(self.last_estimate, result.measurement, ax=top.subplots())
        top.subplots_adjust(left=0.09, right=0.40, bottom=0.16, top=0.86)
        timeline(result.measurement, ax=bottom.subplots(), budget=budget)
        bottom.subplots_adjust(left=0.09, right=0.8, bottom=0.14, top=0.86)
        self.last_figure = fig
        if _in_ipython():  # outside a kernel there is nowhere to show it; tests read last_figure
            with self.output:
                display(Image(data=to_png(fig, dpi=80), format="png"))

    def _ipython_display_(self) -> None:
        display(self.widget)


def _html(text: str, color: str) -> str:
    return f"<b style='color:{color}'>{html.escape(text)}</b>"
