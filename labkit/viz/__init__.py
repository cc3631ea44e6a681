"""Views of memory: static plots, a live plot for training loops, and widget panels over the library."""

from .live import LivePlot
from .methods import peak_bars
from .plots import (
    CATEGORY_COLORS,
    PHASE_COLORS,
    BreakdownTable,
    breakdown_table,
    compare_bar,
    fit_table,
    pick_unit,
    prediction_bar,
    timeline,
    to_png,
)


_PANELS = {"MemoryPanel": "panels", "RecipePanel": "panels", "CheckpointPanel": "lesson_panels",
           "AccumulationPanel": "lesson_panels", "OptimizerPanel": "lesson_panels", "RankPanel": "lesson_panels",
           "PEFTPanel": "lesson_panels", "QuantPanel": "lesson_panels",
           "AWQPanel": "lesson_panels"}


def __getattr__(name: str):
    # panels import ipywidgets and the models' presets (transformers): load them only when asked
    if name in _PANELS:
        import importlib

        return getattr(importlib.import_module(f".{_PANELS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
