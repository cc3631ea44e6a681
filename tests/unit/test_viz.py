"""labkit.viz plots and LivePlot, on small hand-made estimates and measurements (no model, no IPython)."""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.collections import FillBetweenPolyCollection, PolyCollection  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from labkit.memory.report import CATEGORIES, Breakdown, Category, Estimate, Measurement, Timeline  # noqa: E402
from labkit.memory.units import GiB, MiB, fmt_bytes  # noqa: E402
from labkit.viz import (  # noqa: E402
    CATEGORY_COLORS,
    LivePlot,
    breakdown_table,
    compare_bar,
    fit_table,
    pick_unit,
    prediction_bar,
    timeline,
)


def bd(unit=MiB, **kw) -> Breakdown:
    return Breakdown({Category[k.upper()]: int(v * unit) for k, v in kw.items()})


def make_estimate(unit=MiB) -> Estimate:
    return Estimate("toy B=2 S=8 fp32 adamw", 1000, {
        "forward": bd(unit, param=1, opt=2, act=6, temp=1),
        "backward": bd(unit, param=1, grad=1, opt=2, act=4, temp=3),  # 11: the peak
        "optimizer": bd(unit, param=1, grad=1, opt=2, temp=1),
    })


def make_measurement() -> Measurement:
    # two steps: forward builds activations, backward trades them for gradients, optimizer adds state
    series = {c: [] for c in CATEGORIES}
    cur = {c: 0 for c in CATEGORIES}
    marks = []

    def event(**delta):
        for k, v in delta.items():
            cur[Category[k.upper()]] += int(v * MiB)
        for c in CATEGORIES:
            series[c].append(cur[c])

    event(param=1)
    for step in (1, 2):
        marks.append((len(series[Category.PARAM]), "forward", step))
        for _ in range(6):
            event(act=1)
        marks.append((len(series[Category.PARAM]), "backward", step))
        event(temp=3)
        for _ in range(6):
            event(act=-1, grad=1 / 6)
        event(temp=-3)
        marks.append((len(series[Category.PARAM]), "optimizer", step))
        event(opt=2 if step == 1 else 0)
        event(grad=-1)
    phases = {"forward": bd(param=1, opt=2, act=6), "backward": bd(param=1, opt=2, act=6, temp=3),
              "optimizer": bd(param=1, opt=2, grad=1)}
    return Measurement("toy B=2 S=8 fp32 adamw", phases, Timeline(series, marks), bd(param=1))


def texts(fig) -> str:
    return "\n".join(t.get_text() for ax in fig.axes for t in ax.texts + [ax.title])


def legend_texts(ax) -> list[str]:
    return [t.get_text() for t in ax.get_legend().get_texts()]


def bars(ax) -> list[Rectangle]:
    return [p for p in ax.patches if isinstance(p, Rectangle) and p.get_height() > 0]


# ---------------------------------------------------------------------------------------------- units
@pytest.mark.parametrize("n, unit", [(512, "B"), (3 * 1024, "KiB"), (5 * MiB, "MiB"), (1023 * MiB, "MiB"), (2 * GiB, "GiB")])
def test_pick_unit(n, unit):
    assert pick_unit(n)[0] == unit


def test_every_category_has_its_own_colour():
    assert set(CATEGORY_COLORS) == set(CATEGORIES)
    assert len({to_hex(c) for c in CATEGORY_COLORS.values()}) == len(CATEGORIES)


# ------------------------------------------------------------------------------------------ compare_bar
def test_compare_bar_stacks_one_segment_per_nonzero_category_and_prints_ratios():
    est, meas = make_estimate(), make_measurement()
    fig = compare_bar(est, meas)
    ax = fig.axes[0]
    nonzero = sum(1 for c in CATEGORIES if est.peak.bytes[c]) + sum(1 for c in CATEGORIES if meas.peak.bytes[c])
    assert len(bars(ax)) == nonzero
    assert ax.get_ylabel() == "memory (MiB)"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["predicted\n(backward)", "measured\n(backward)"]
    # the segments are coloured by category: activations' red is there
    assert to_hex(CATEGORY_COLORS[Category.ACT]) in {to_hex(p.get_facecolor()) for p in bars(ax)}
    cells = {(r, c): cell.get_text().get_text() for (r, c), cell in ax.tables[0].get_celld().items()}
    rows = {cells[(r, 0)]: [cells[(r, c)] for c in range(1, 4)] for r in range(1, len(CATEGORIES) + 2)}
    assert rows["activations"] == [fmt_bytes(4 * MiB), fmt_bytes(6 * MiB), "1.50"]
    assert rows["gradients"] == [fmt_bytes(MiB), "0 B", "0.00"]
    assert rows["buffers"][2] == "-"  # nothing predicted, nothing measured
    assert rows["total"] == [fmt_bytes(11 * MiB), fmt_bytes(12 * MiB), f"{12 / 11:.2f}"]
    assert f"measured / predicted = {12 / 11:.2f}" in texts(fig)
    assert fmt_bytes(12 * MiB) in texts(fig)  # the total over the measured bar


def test_compare_bar_picks_units_and_phases():
    fig = compare_bar(make_estimate(GiB), make_measurement(), phase="forward")
    ax = fig.axes[0]
    assert ax.get_ylabel() == "memory (GiB)"
    assert ax.get_xticklabels()[0].get_text() == "predicted\n(forward)"
    with pytest.raises(ValueError, match="no phase 'recompute'"):
        compare_bar(make_estimate(), make_measurement(), phase="recompute")


def test_compare_bar_draws_into_a_given_axes():
    from matplotlib.figure import Figure

    fig = Figure()
    ax = fig.add_subplot(1, 2, 1)
    assert compare_bar(make_estimate(), make_measurement(), ax=ax) is fig
    assert bars(ax)


# --------------------------------------------------------------------------------------------- timeline
def test_timeline_stacks_categories_and_names_phases_peak_and_budget():
    meas = make_measurement()
    fig = timeline(meas, budget=13 * MiB)
    ax = fig.axes[0]
    areas = [c for c in ax.collections if isinstance(c, (FillBetweenPolyCollection, PolyCollection))]
    assert len(areas) == sum(1 for c in CATEGORIES if any(meas.timeline.bytes[c]))  # 5: no buffers
    words = texts(fig)
    for label in ("forward 1", "backward 1", "optimizer 2", "peak 12.00 MiB (backward, step 2)"):
        assert label in words
    # the budget is named in the legend, beside its line: a label on the chart covered the stack under it
    assert "budget" not in words and "budget 13.00 MiB" in legend_texts(ax)
    lines = {(round(l.get_ydata()[0], 3), l.get_linestyle(), to_hex(l.get_color())) for l in ax.lines}
    assert (12.0, "--", "#000000") in lines  # the peak, dashed
    assert any(y == 13.0 and ls == "-" and c != "#000000" for y, ls, c in lines)  # the budget, solid red
    assert ax.get_ylim()[1] > 13  # the budget is on the chart
    assert [t.get_text() for t in ax.get_legend().get_texts()][-1] == "parameters"


def test_timelines_on_a_shared_y_axis_share_one_unit_and_the_tallest_limit():
    tall = make_measurement()  # peak 12 MiB
    small = {c: [v // 4096 for v in vs] for c, vs in tall.timeline.bytes.items()}  # peak 3 KiB
    short = Measurement("short", tall.phases, Timeline(small, tall.timeline.phase_starts), tall.baseline)
    fig = Figure()
    axes = fig.subplots(2, 1, sharey=True)
    timeline(tall, ax=axes[0])
    timeline(short, ax=axes[1])  # drawn last: before, its own limit (KiB) clipped the tall one
    for ax in axes:
        assert ax.get_ylim()[1] >= 12  # MiB: the taller peak is on the chart, in both panels
        assert ax.get_ylabel() == "live memory (MiB)"
    drawn = [c for c in axes[1].collections if isinstance(c, PolyCollection)]
    assert max(c.get_paths()[0].vertices[:, 1].max() for c in drawn) < 0.02  # 3 KiB, in MiB


def test_timeline_says_when_the_budget_is_off_the_chart_and_copes_with_nothing():
    fig = timeline(make_measurement(), budget=8 * GiB, title="a toy")
    assert "far above the peak" in texts(fig)
    assert fig.axes[0].get_title() == "a toy"
    assert fig.axes[0].get_ylim()[1] < 20  # MiB: the step is not squashed under an 8 GiB axis
    empty = Measurement("empty", {"forward": Breakdown()}, Timeline({c: [] for c in CATEGORIES}, []), Breakdown())
    assert "no allocations" in texts(timeline(empty))


def test_timelines_side_by_side_draw_one_legend_that_covers_no_axis():
    """Lesson 09: rank 0's legend, right of its axes, covered rank 1's axis."""
    fig = Figure(figsize=(12, 3.6))
    axes = fig.subplots(1, 2, sharey=True)
    for k, ax in enumerate(axes):
        timeline(make_measurement(), ax=ax, legend=k == 1)
    fig.subplots_adjust(left=0.06, right=0.83, wspace=0.08, top=0.78)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    assert axes[0].get_legend() is None
    box = axes[1].get_legend().get_window_extent(renderer)
    assert not any(box.overlaps(ax.bbox) for ax in axes)


def test_micro_batches_are_named_once_per_step_not_once_per_band():
    """Lesson 04: a step of 4 micro-batches drew "forward 1" four times, piled up over narrow bands."""
    series = {c: [] for c in CATEGORIES}
    marks = []
    for step in (1, 2):
        for _ in range(4):  # micro-batches: forward, backward, forward, backward, ...
            for phase in ("forward", "backward"):
                marks.append((len(series[Category.PARAM]), phase, step))
                for v in (1, 2, 1):
                    for c in CATEGORIES:
                        series[c].append(int(v * MiB) if c is Category.ACT else MiB if c is Category.PARAM else 0)
        marks.append((len(series[Category.PARAM]), "optimizer", step))
        for c in CATEGORIES:
            series[c].append(MiB if c is Category.PARAM else 0)
    phases = {"forward": bd(param=1, act=2), "backward": bd(param=1, act=2), "optimizer": bd(param=1)}
    fig = timeline(Measurement("accumulated", phases, Timeline(series, marks), bd(param=1)))
    ax = fig.axes[0]
    names = [t.get_text() for t in ax.texts if not t.get_text().startswith("peak")]
    assert names == ["4 micro-batches, step 1", "optimizer 1", "4 micro-batches, step 2", "optimizer 2"]
    assert len([p for p in ax.patches if p.get_alpha() == 0.10]) == 18  # each band still shaded: 2 x (8 + 1)
    peak = next(t.get_text() for t in ax.texts if t.get_text().startswith("peak"))
    assert peak.startswith("peak 3.00 MiB (forward of micro-batch 1, step 1)"), peak


# ----------------------------------------------------------------------------------------- prediction
def test_prediction_bar_names_its_kernels_and_the_budget_in_the_legend_not_over_the_bars():
    """Lesson 01: "budget 9.00 MiB" was written over the last bar; the panel did not say which kernels."""
    est = make_estimate()
    fig = prediction_bar(est, budget=9 * MiB, kernels="cpu")
    ax = fig.axes[0]
    assert "(cpu kernels)" in ax.get_title()
    assert "budget 9.00 MiB" in legend_texts(ax) and not any(t.get_text().startswith("budget") for t in ax.texts)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    for t in ax.texts:  # the totals sit on their bars; no text covers a bar
        box = t.get_window_extent(renderer).padded(-1.5)  # a pixel in: touching is not covering
        assert not any(box.overlaps(b.get_window_extent(renderer)) for b in bars(ax)), t.get_text()


def test_prediction_bar_says_whether_the_peak_fits():
    est = make_estimate()
    fits = prediction_bar(est, budget=16 * MiB)
    assert "fits: 11.00 MiB of 16.00 MiB" in texts(fits)
    assert len(bars(fits.axes[0])) == sum(1 for b in est.phases.values() for c in CATEGORIES if b.bytes[c])
    assert "does not fit: 11.00 MiB > 10.00 MiB budget" in texts(prediction_bar(est, budget=10 * MiB))
    assert "off the chart" in texts(prediction_bar(est, budget=GiB))


# ------------------------------------------------------------------------------------------ fit_table
def test_fit_table_colours_each_cell_by_whether_the_model_fits():
    rows = [("small", 3 * GiB), ("medium", 12 * GiB), ("big", 100 * GiB)]
    fig = fit_table(rows, {"T4": "16GiB", "laptop": 8 * GiB})
    ax = fig.axes[0]
    cells = [p for p in ax.patches if isinstance(p, Rectangle)]
    assert len(cells) == 6
    words = [t.get_text() for t in ax.texts]
    assert words == ["fits (19%)", "fits (38%)", "fits (75%)", "no (1.5x)", "no (6.2x)", "no (12.5x)"]
    greens = {to_hex(p.get_facecolor()) for p, w in zip(cells, words) if w.startswith("fits")}
    reds = {to_hex(p.get_facecolor()) for p, w in zip(cells, words) if w.startswith("no")}
    assert len(greens) == len(reds) == 1 and greens != reds
    assert [t.get_text() for t in ax.get_xticklabels()] == ["T4", "laptop"]
    assert ax.get_yticklabels()[2].get_text() == "big\npeak 100.0 GiB"
    assert [t.get_text() for t in fit_table(rows, [8 * GiB, "512MiB"]).axes[0].get_xticklabels()] == ["8 GiB", "512.0 MiB"]


# ------------------------------------------------------------------------------------ breakdown_table
def test_breakdown_table_lists_every_category_and_the_total_per_phase():
    table = breakdown_table(make_estimate())
    assert table.header == ["category", "forward", "backward (peak)", "optimizer"]
    assert [r[0] for r in table.rows] == [c.value for c in CATEGORIES] + ["total"]
    assert table.rows[-1] == ["total", 10 * MiB, 11 * MiB, 5 * MiB]
    text = str(table)
    assert "toy B=2 S=8 fp32 adamw" in text and "11.00 MiB" in text
    assert text.splitlines()[-1].split() == ["total", "10.00", "MiB", "11.00", "MiB", "5.00", "MiB"]
    assert table._repr_html_().count("<tr>") == 1 + len(CATEGORIES) + 1
    single = breakdown_table(bd(param=2))
    assert single.rows[0] == ["parameters", 2 * MiB] and single.rows[-1] == ["total", 2 * MiB]
    assert breakdown_table(make_measurement()).header[2] == "backward (peak)"


# -------------------------------------------------------------------------------------------- LivePlot
def test_liveplot_records_every_update_but_redraws_at_most_every_interval():
    lp = LivePlot("training", ylabel={"memory": "MiB"}, every=60)
    assert lp.update(0, loss=3.0, memory=10) is True  # the first update draws
    for step in range(1, 5):
        assert lp.update(step, loss=3.0 - step / 10, memory=10 + step) is False  # held back
    assert lp.redraws == 1
    assert lp.data["loss"] == ([0, 1, 2, 3, 4], [3.0, 2.9, 2.8, 2.7, 2.6])
    fig = lp.close()
    assert fig is lp.figure and lp.redraws == 2
    axes = fig.axes
    assert [ax.get_ylabel() for ax in axes] == ["loss", "MiB"]
    assert list(axes[0].lines[0].get_ydata()) == [3.0, 2.9, 2.8, 2.7, 2.6]
    assert axes[1].get_title(loc="left") == "memory: 14 at step 4"
    assert axes[0].get_ylim()[0] <= 2.6 and axes[0].get_ylim()[1] >= 3.0  # rescaled to the data


def test_liveplot_without_throttle_redraws_each_time_and_grows_new_series():
    lp = LivePlot(ylabel="MiB", every=0)
    for step in range(3):
        assert lp.update(step, memory=step)
    lp.update(3, memory=3, loss=1.0)
    assert lp.redraws == 4 and len(lp.figure.axes) == 2
    assert lp._repr_png_().startswith(b"\x89PNG")
    with pytest.raises(ValueError, match="at least one series"):
        lp.update(4)


# ------------------------------------------------------------------------------------- peak_bars
def test_peak_bars_draws_one_stack_per_item_with_totals_and_budgets():
    from labkit.viz import peak_bars

    est, meas = make_estimate(), make_measurement()
    items = {"a breakdown": bd(param=2, grad=1), "predicted": est, "measured": meas}
    fig = peak_bars(items, budgets_gib=(0.01,), title="three setups")
    ax = fig.axes[0]
    heights = {}
    for p in bars(ax):
        heights[round(p.get_x() + p.get_width() / 2)] = heights.get(round(p.get_x() + p.get_width() / 2), 0) + p.get_height()
    assert [round(heights[i], 6) for i in range(3)] == [3, 11, 12]  # MiB: each stack sums to its peak's total
    words = texts(fig)
    assert "3.00 MiB" in words and "11.00 MiB" in words and "12.00 MiB" in words and "0.01 GiB" in words
    assert [t.get_text() for t in ax.get_xticklabels()] == list(items)
    with pytest.raises(ValueError, match="at least one"):
        peak_bars({})
    with pytest.raises(TypeError, match="Breakdown"):
        peak_bars({"x": 3})


# ------------------------------------------------------------------------------------- module layout
def test_plots_still_offers_every_name_the_lessons_use():
    """The lessons write `plots.fit_table`, `plots.to_png`, ...; the tables and style moved out of plots."""
    from labkit.viz import plots, style, tables

    for name in ("fit_table", "breakdown_table", "BreakdownTable"):
        assert getattr(plots, name) is getattr(tables, name), name
    for name in ("to_png", "pick_unit", "CATEGORY_COLORS", "PHASE_COLORS", "FITS", "DOES_NOT_FIT"):
        assert getattr(plots, name) is getattr(style, name), name
    for name in ("compare_bar", "timeline", "prediction_bar"):
        assert callable(getattr(plots, name)), name
    assert set(plots.__all__) >= {"fit_table", "breakdown_table", "to_png", "compare_bar", "timeline", "prediction_bar"}
