"""The planner's panel (lesson 13): a model, devices, memory per device and what is allowed redraw the ranked
plans (predicted peak per device against the budget, predicted step time relative to the fastest); the button
verifies the top plan by running it on the device at hand (labkit.plan.verify), for models small enough."""

from __future__ import annotations

import html

import ipywidgets as widgets
from matplotlib.figure import Figure

from labkit.memory import GiB, fmt_bytes

from .style import DOES_NOT_FIT, FITS, _Panel, beside, log_grid, to_png

PEFT_CHOICES = {"full training only": False, "parameter-efficient only": True, "either": "allow"}
PRECISIONS = ("fp32", "mixed-bf16", "bf16")


TIGHT = "#E0A030"  # amber: fits, but within the plan's headroom of the budget


def plan_bars(plans: list, memory: int, ax=None) -> Figure:
    """One horizontal bar per plan (best first, at the top): its predicted peak per device, the budget as a
    line, and the predicted step time relative to the fastest plan at the bar's end. A tight plan (it fits,
    within its headroom of the budget: `plan.tight`) is amber, hatched and says "tight", wherever it is drawn."""
    h = 0.9 + 0.5 * max(len(plans), 1)
    fig = Figure(figsize=(9.5, h)) if ax is None else ax.figure
    ax = ax or fig.add_axes([0.5, 0.55 / h, 0.36, 1 - 0.75 / h])
    top = max([p.peak for p in plans] + [memory])
    unit = GiB if top >= GiB else 2**20
    names = "GiB" if unit == GiB else "MiB"
    for i, p in enumerate(plans):
        y = len(plans) - 1 - i
        fits, tight = p.peak <= memory, p.peak <= memory and p.tight
        ax.barh(y, p.peak / unit, color=TIGHT if tight else FITS if fits else DOES_NOT_FIT, alpha=0.85,
                hatch="//" if tight else None, edgecolor="white")
        ax.text(top / unit * 1.03, y, f"{fmt_bytes(p.peak)}, {p.relative:.2f}x time"
                + (", tight" if tight else ""), va="center", fontsize=8)
    ax.axvline(memory / unit, color=DOES_NOT_FIT, linewidth=1.5)
    ax.set_yticks(range(len(plans)), [_short(i, p) for i, p in enumerate(plans)][::-1], fontsize=8)
    ax.set_xlim(0, top / unit * 1.6)
    heads = sorted({p.headroom for p in plans if p.tight and p.peak <= memory})
    ax.set_xlabel(f"predicted peak per device ({names}); red line: the budget"
                  + (f"; amber: tight (within {heads[0]:.0%} of it)" if len(heads) == 1 else
                     "; amber: tight (within its headroom)" if heads else ""))
    ax.spines[["top", "right"]].set_visible(False)
    return fig


def _short(i: int, p) -> str:
    """A plan's label on its bar: its number and its choices, without the words every plan shares."""
    text = p.summary().replace("full training, ", "").replace("checkpoint none, ", "")
    return f"{i + 1}. {text}" if len(text) <= 58 else f"{i + 1}. {text[:56]}..."


def _devices() -> list[str]:
    from labkit.plan.devices import names

    return list(dict.fromkeys(["cpu", *names()]))


class PlanPanel(_Panel):
    """Controls: model, devices, memory per device (GiB), batch, sequence, what training is allowed, the least
    precise dtype. Every change: one `labkit.plan.plan` call and the `top` best plans' bars. The button ("Measure:
    verify the top plan") runs the top plan for real (`labkit.plan.verify`) when the model is small enough."""

    top = 4  # plans drawn

    def __init__(self, model: str = "gpt2-tiny", devices: int = 1, memory_gib: float = 0.02, batch: int = 4,
                 seq: int = 64, peft: str = "either", min_precision: str = "fp32", device_preset: str | None = None):
        import torch

        from labkit.models.hf import PRESETS

        style = {"description_width": "110px"}
        options = list(PRESETS)
        if model not in options:
            options.insert(0, model)
        self.model = widgets.Dropdown(options=options, value=model, description="model", style=style)
        self.devices = widgets.Dropdown(options=[1, 2, 4, 8], value=devices, description="devices", style=style)
        # whose kernels and speeds the plans assume: this machine's by default, so that verify checks the same bars
        preset = device_preset or ("h100" if torch.cuda.is_available() else "cpu")
        self.device = widgets.Dropdown(options=_devices(), value=preset, description="device kind", style=style)
        lo, hi = log_grid(memory_gib, -10, 8, 0.25)  # the slider's grid passes through the memory given
        self.memory = widgets.FloatLogSlider(value=memory_gib, base=2, min=lo, max=hi, step=0.25,
                                             description="GiB per device", readout_format=".3g", style=style,
                                             continuous_update=False)
        self.batch = widgets.Dropdown(options=[1, 2, 4, 8, 16, 32], value=batch, description="batch", style=style)
        self.seq = widgets.Dropdown(options=[32, 64, 128, 256, 512, 1024, 2048, 4096], value=seq,
                                    description="sequence", style=style)
        self.peft = widgets.Dropdown(options=list(PEFT_CHOICES), value=peft, description="training", style=style)
        self.precision = widgets.Dropdown(options=list(PRECISIONS), value=min_precision,
                                          description="least precise", style=style)
        self.prediction = widgets.Image(format="png")
        self.verdict = widgets.HTML()
        self.button = widgets.Button(description="Measure: verify the top plan", button_style="primary",
                                     icon="play", layout=widgets.Layout(width="260px"))
        self.message = widgets.HTML()
        self.last_plans = self.last_verification = self.last_figure = self.last_error = None
        controls = (self.model, self.devices, self.device, self.memory, self.batch, self.seq, self.peft, self.precision)
        self.button.on_click(self._on_run)
        self.widget = widgets.VBox([beside(widgets.VBox(list(controls)), self.prediction),
                                    self.verdict, self.button, self.message])
        self._watch(controls)

    @property
    def memory_bytes(self) -> int:
        return int(self.memory.value * GiB)

    def _say(self, text: str, color: str) -> str:
        return f"<b style='color:{color}; white-space:normal'>{html.escape(text)}</b>"

    def _on_change(self, _change=None) -> None:
        from labkit.plan import SearchOptions, plan
        from labkit.plan.verify import check_runnable

        self.message.value = ""
        self.last_verification = None
        try:
            options = SearchOptions(PEFT_CHOICES[self.peft.value], self.precision.value, self.top)
            plans = plan(self.model.value, devices=int(self.devices.value), memory=self.memory_bytes,
                         device_preset=self.device.value, batch=int(self.batch.value), seq=int(self.seq.value),
                         options=options)
        except ValueError as e:  # NoPlanError included: say why, draw nothing
            self.last_plans, self.last_error = None, e
            self.verdict.value = self._say(f"no plan: {e}", DOES_NOT_FIT)
            self.button.disabled = True
            return
        self.last_plans, self.last_error = plans, None
        fig = plan_bars(plans, self.memory_bytes)
        self.last_figure = fig
        self.prediction.value = to_png(fig, dpi=80, tight=False)
        best = plans[0]
        self.verdict.value = self._say(
            f"best: {best.summary()}: {fmt_bytes(best.peak)} per device ({best.peak_phase}), bound by "
            f"{best.binding}; {best.fidelity.describe()}"
            + (f"; tight: within {best.headroom:.0%} of the budget" if best.tight else ""), FITS)
        try:
            check_runnable(best.recipe)
            self.button.disabled = False
        except ValueError as e:
            self.button.disabled = True
            self.message.value = self._say(f"verify is off here: {e}", DOES_NOT_FIT)

    def _on_run(self, _button=None) -> None:
        if self.button.disabled or not self.last_plans:
            return
        from labkit.plan import verify

        self.button.disabled, self.message.value = True, "running the top plan under the ledger..."
        try:
            v = verify(self.last_plans[0])  # on the device at hand: CUDA when there is one
        except Exception as e:  # a callback's traceback never reaches the notebook: say it here
            self.last_verification, self.last_error = None, e
            self.message.value = self._say(f"the run failed: {type(e).__name__}: {e}", DOES_NOT_FIT)
            return
        finally:
            self.button.disabled = False
        self.last_verification = v
        verdict = f"the top plan {'fits' if v.fits else 'does not fit'} in {fmt_bytes(v.budget)}"
        self.message.value = self._say(f"{verdict}: {v}", FITS if v.fits else DOES_NOT_FIT)
