"""Lesson 11's panel: DGC sparsity and warm-up, PowerSGD's rank and the parameter server's staleness redraw the
bytes each step sends (`comm_ranks.plan_bytes`, formulas only); the button trains on real ranks
(`comm_ranks.explore`) and draws the loss curves."""

from __future__ import annotations

import html

import ipywidgets as widgets
from matplotlib.figure import Figure

from labkit.distributed import comm_ranks
from labkit.distributed.compression import DGCConfig, PowerSGDConfig
from labkit.distributed.dp_ranks import TrainRun
from labkit.distributed.param_server import PSConfig
from labkit.memory import fmt_bytes

from .style import _Panel, beside, pick_unit, to_png

SPARSITIES = (0.75, 0.9, 0.99, 0.999)
COLORS = {"dense": "#4C72B0", "dgc": "#DD8452", "powersgd": "#55A868", "parameter server": "#C44E52"}


class CommPanel(_Panel):
    """Thin: reads the controls, calls `plan_bytes` (or `explore` for the button), draws."""

    def __init__(self, run: TrainRun, slow_worker_s: float = 0.0):
        self.run, self.slow_worker_s = run, slow_worker_s
        style = {"description_width": "110px"}
        self.sparsity = widgets.SelectionSlider(options=SPARSITIES, value=0.99, description="DGC sparsity",
                                                style=style)
        self.warmup = widgets.IntSlider(value=1, min=0, max=4, description="warm-up steps", style=style)
        self.rank = widgets.IntSlider(value=1, min=1, max=8, description="PowerSGD rank", style=style)
        self.staleness = widgets.IntSlider(value=1, min=0, max=4, description="PS staleness", style=style)
        self.button = widgets.Button(description="Measure: train on real ranks", icon="play",
                                     layout=widgets.Layout(width="240px"))
        self.bytes_plot, self.loss_plot = widgets.Image(format="png"), widgets.Image(format="png")
        self.verdict, self.message = widgets.HTML(), widgets.HTML()
        self.last_plan = self.last_losses = self.last_error = None
        controls = (self.sparsity, self.warmup, self.rank, self.staleness)
        self.button.on_click(self._on_train)
        self.widget = widgets.VBox([beside(widgets.VBox(list(controls[:2])), widgets.VBox(list(controls[2:]))),
                                    self.bytes_plot, self.verdict, self.button, self.message])
        self._watch(controls)

    def _on_change(self, _change=None) -> None:
        self.last_plan = comm_ranks.plan_bytes(self.run, self._dgc(), PowerSGDConfig(rank=self.rank.value))
        self._draw_bytes(self.last_plan)

    def _dgc(self) -> DGCConfig:
        return DGCConfig(sparsity=self.sparsity.value, warmup_steps=self.warmup.value)

    def _draw_bytes(self, plan: dict) -> None:
        fig = Figure(figsize=(8, 3.2))
        ax = fig.add_axes([0.1, 0.16, 0.6, 0.72])
        unit, size = pick_unit(max(max(v) for v in plan.values()))
        steps = range(1, self.run.steps + 1)
        for name in ("dense", "dgc", "powersgd", "parameter server"):
            ax.plot(steps, [b / size for b in plan[name]], marker="o", ms=3, color=COLORS[name],
                    label=name + (" (server)" if name == "parameter server" else ""))
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel(f"bytes sent by the busiest rank ({unit}, log)")
        ax.set_title("bytes on the wire per step, by definition", fontsize=9)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
        ax.spines[["top", "right"]].set_visible(False)
        self.bytes_plot.value = to_png(fig, dpi=80, tight=False)
        last = {k: v[-1] for k, v in plan.items()}
        self.verdict.value = "<b>" + html.escape(
            f"last step: dense {fmt_bytes(last['dense'])}, DGC {fmt_bytes(last['dgc'])} "
            f"({last['dense'] / last['dgc']:.0f}x less), PowerSGD rank {self.rank.value} {fmt_bytes(last['powersgd'])} "
            f"({last['dense'] / last['powersgd']:.0f}x less), parameter server {fmt_bytes(last['parameter server'])} "
            f"from the server (at any staleness: s = {self.staleness.value} changes who waits, not the bytes; "
            f"the button shows what it does to the loss)") + "</b>"

    def _on_train(self, _button=None) -> None:
        self.button.disabled = True
        self.message.value = "training on 2 ranks, then on a server and 2 workers ..."
        try:
            self.last_losses = comm_ranks.explore(self.run, self._dgc(), PowerSGDConfig(rank=self.rank.value),
                                                  PSConfig("async", self.staleness.value), self.slow_worker_s)
            self.last_error = None
        except Exception as e:  # shown, not raised: the panel stays usable
            self.last_error = e
            self.message.value = f"<b style='color:#C62828'>{html.escape(str(e).splitlines()[0])}</b>"
            return
        finally:
            self.button.disabled = False
        fig = Figure(figsize=(8, 3.2))
        ax = fig.add_axes([0.1, 0.16, 0.6, 0.72])
        for name, losses in self.last_losses.items():
            ax.plot(range(1, len(losses) + 1), losses, label=name,
                    color=COLORS.get(name.split(" (")[0], "#8C8C8C"))
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (mean over workers)")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
        ax.spines[["top", "right"]].set_visible(False)
        self.loss_plot.value = to_png(fig, dpi=80, tight=False)
        if self.loss_plot not in self.widget.children:  # shown once there are curves to show
            self.widget.children = (*self.widget.children, self.loss_plot)
        final = {k: v[-1] for k, v in self.last_losses.items()}
        self.message.value = html.escape("final loss: " + ", ".join(f"{k} {v:.3f}" for k, v in final.items()))
