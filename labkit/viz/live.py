"""A plot that redraws itself during a training loop, as a PNG in a display handle (no extensions needed)."""

from __future__ import annotations

import time

from matplotlib.figure import Figure

from .style import to_png


def _in_ipython() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return get_ipython() is not None


class LivePlot:
    """Curves of named series against the training step, one panel per series, redrawn as you go.

        lp = LivePlot("training", ylabel={"loss": "loss", "memory": "MiB"})
        for step in range(steps):
            ...
            lp.update(step, loss=loss.item(), memory=ledger.live_bytes / MiB)
        lp.close()

    ylabel: one label for every panel, or {series: label}; a series without one is labelled by its name.
    every: seconds between redraws at most (updates in between only record the values); `close()`
    always draws the last state. In IPython (JupyterLab, Colab, VS Code) the figure is shown as a
    PNG through a display handle that is updated in place; elsewhere `lp.figure` is simply kept.
    """

    def __init__(self, title: str = "", ylabel: str | dict[str, str] | None = None, every: float = 0.5,
                 xlabel: str = "step"):
        if every < 0:
            raise ValueError(f"every must be a number of seconds >= 0, got {every!r}")
        self.title, self.ylabel, self.every, self.xlabel = title, ylabel, every, xlabel
        self.data: dict[str, tuple[list[float], list[float]]] = {}  # series -> (steps, values)
        self.figure = Figure(figsize=(7, 2.6))
        self.redraws = 0  # how many times the figure was drawn (to see the throttle work)
        self._last_draw = float("-inf")
        self._handle = None
        self._lines = {}

    def update(self, step: float, **series: float) -> bool:
        """Record each series' value at `step`; redraw if `every` seconds have passed. True if it redrew."""
        if not series:
            raise ValueError("update needs at least one series, e.g. lp.update(step, loss=2.3)")
        for name, value in series.items():
            steps, values = self.data.setdefault(name, ([], []))
            steps.append(step)
            values.append(float(value))
        if time.monotonic() - self._last_draw < self.every:
            return False
        self.draw()
        return True

    def close(self) -> Figure:
        """Draw the final state (whatever the throttle held back) and return the figure."""
        self.draw()
        return self.figure

    def _label(self, name: str) -> str:
        if isinstance(self.ylabel, dict):
            return self.ylabel.get(name, name)
        return self.ylabel or name

    def _layout(self) -> None:
        """(Re)build one axes per series when a new series appears."""
        fig = self.figure
        fig.clear()
        self._lines = {}
        names = list(self.data)
        fig.set_size_inches(7, 1.2 + 1.6 * len(names))
        axes = fig.subplots(len(names), 1, sharex=True, squeeze=False)[:, 0]
        for ax, name in zip(axes, names):
            (self._lines[name],) = ax.plot([], [], lw=1.5)
            ax.set_ylabel(self._label(name))
            ax.grid(alpha=0.3)
            ax.spines[["top", "right"]].set_visible(False)
        axes[-1].set_xlabel(self.xlabel)
        if self.title:
            fig.suptitle(self.title, fontsize=10)

    def draw(self) -> None:
        """Redraw now, ignoring the throttle."""
        if not self.data:
            return
        if set(self._lines) != set(self.data):
            self._layout()
        for name, (steps, values) in self.data.items():
            line = self._lines[name]
            line.set_data(steps, values)
            ax = line.axes
            ax.relim()
            ax.autoscale_view()
            ax.set_title(f"{name}: {values[-1]:.4g} at {self.xlabel} {steps[-1]}", fontsize=9, loc="left")
        self.figure.tight_layout()
        self.redraws += 1
        self._last_draw = time.monotonic()
        if _in_ipython():
            self._show()

    def _show(self) -> None:
        from IPython.display import Image, display

        image = Image(data=to_png(self.figure), format="png")
        if self._handle is None:
            self._handle = display(image, display_id=True)
        else:
            self._handle.update(image)

    def _repr_png_(self) -> bytes:
        return to_png(self.figure)
