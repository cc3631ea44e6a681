"""Drive MemoryPanel through its widgets: the prediction follows the controls, the button measures."""

import matplotlib

matplotlib.use("Agg")

import math  # noqa: E402

import ipywidgets as widgets  # noqa: E402
import pytest  # noqa: E402

from labkit.memory import GiB, Category, fmt_bytes  # noqa: E402
from labkit.viz.panels import MemoryPanel, with_tooltip  # noqa: E402


@pytest.fixture
def panel():
    # small and fast whatever the device profile says
    return MemoryPanel(model="gpt2-tiny", batch=2, seq=32, dtype="fp32", optimizer="adamw", budget_gib=1.0)


def test_tooltips_use_the_trait_this_ipywidgets_has():
    """7.x (Colab's 7.7.1): sliders and dropdowns have description_tooltip, buttons tooltip; 8.x: all tooltip."""
    major = int(widgets.__version__.split(".")[0])
    rank = MemoryPanel(model="gpt2-tiny").rank
    assert getattr(rank, "tooltip" if major >= 8 else "description_tooltip").startswith("GaLore's rank")
    button = with_tooltip(widgets.Button(description="b"), "run it")
    assert button.tooltip == "run it"
    assert with_tooltip(widgets.Dropdown(options=["a"]), "pick").has_trait("tooltip") == (major >= 8)


def test_panel_exposes_its_controls_and_a_box():
    p = MemoryPanel(model="gpt2-tiny")
    for name, kind in (("model", widgets.Dropdown), ("batch", widgets.IntSlider), ("seq", widgets.IntSlider),
                       ("dtype", widgets.Dropdown), ("optimizer", widgets.Dropdown), ("rank", widgets.SelectionSlider),
                       ("budget", widgets.FloatLogSlider), ("button", widgets.Button), ("output", widgets.Output)):
        assert isinstance(getattr(p, name), kind), name
    assert isinstance(p.widget, widgets.VBox) and callable(p._ipython_display_)
    assert {"gpt2-tiny", "gpt2-xl", "llama2-70b"} <= set(p.model.options)
    assert p.seq.value <= 128  # the default sequence suits gpt2-tiny's 128 positions
    assert p.last_estimate is not None and p.last_result is None  # predicted at once, measured on demand
    q = MemoryPanel(model="llama-tiny", batch=3, seq=48, dtype="bf16", optimizer="sgd", budget_gib=0.5)
    assert [w.value for w in (q.model, q.batch, q.seq, q.dtype, q.optimizer, q.budget)] == ["llama-tiny", 3, 48, "bf16", "sgd", 0.5]
    assert q.last_estimate.label == "llama-tiny B=3 S=48 bf16 sgd"


def test_prediction_redraws_when_any_control_changes(panel):
    est, png = panel.last_estimate, bytes(panel.prediction.value)
    assert png.startswith(b"\x89PNG")
    panel.batch.value = 8
    assert panel.last_estimate.peak[Category.ACT] > 3 * est.peak[Category.ACT]  # activations grow with B
    assert bytes(panel.prediction.value) != png
    panel.optimizer.value = "sgd"
    assert panel.last_estimate.peak[Category.OPT] == 0
    params_fp32 = panel.last_estimate.peak[Category.PARAM]
    panel.dtype.value = "bf16"
    assert panel.last_estimate.peak[Category.PARAM] == params_fp32 // 2
    assert "bf16" in panel.last_estimate.label and "sgd" in panel.last_estimate.label



def test_rank_is_offered_for_galore_only_and_moves_its_prediction(panel):
    assert panel.rank.disabled and "rank" not in panel.last_estimate.label  # adamw has no rank
    adamw_opt = panel.last_estimate.peak[Category.OPT]
    panel.rank.value = 4  # ignored while the optimizer has no rank
    assert panel.last_estimate.peak[Category.OPT] == adamw_opt
    for optimizer in ("galore", "galore8bit"):
        panel.optimizer.value = optimizer
        assert not panel.rank.disabled
        opt = {}
        for r in (4, 16, 32):
            panel.rank.value = r
            assert panel.last_estimate.label.endswith(f"{optimizer} rank={r}")
            opt[r] = panel.last_estimate.peak[Category.OPT]
        assert opt[4] < opt[16] < opt[32] < adamw_opt  # GaLore's state grows with the rank
    panel.rank.value = 128  # more than gpt2-tiny's 64-wide matrices: explained, not raised
    assert panel.last_estimate is None and "rank 128 exceeds" in panel.verdict.value
    panel.optimizer.value = "sgd"
    assert panel.rank.disabled and panel.last_estimate is not None
    assert MemoryPanel(model="gpt2-tiny", optimizer="galore", rank=12).last_estimate.label.endswith("rank=12")


def test_measuring_galore_uses_the_chosen_rank(panel):
    panel.optimizer.value = "galore"
    measured = {}
    for r in (8, 32):
        panel.rank.value = r
        panel.button.click()
        assert panel.last_error is None, panel.last_error
        measured[r] = panel.last_result.measurement.peak[Category.OPT]
        assert abs(measured[r] / panel.last_estimate.peak[Category.OPT] - 1) < 0.05  # the step ran GaLore at rank r
    assert measured[8] < measured[32]

def test_budget_changes_the_verdict_not_the_estimate(panel):
    est = panel.last_estimate
    assert "fits in 1.00 GiB" in panel.verdict.value and not panel.button.disabled
    panel.budget.value = 2**-10  # 1 MiB
    assert panel.last_estimate.peak.total == est.peak.total
    assert "does not fit in 1.00 MiB" in panel.verdict.value
    assert not panel.button.disabled  # measuring it is allowed: the learner sees the out-of-memory


def test_big_models_are_predicted_but_not_offered_for_measurement(panel):
    panel.model.value = "gpt2-xl"
    assert panel.last_estimate.n_params > 1_500_000_000
    assert panel.button.disabled and "too big to measure here" in panel.verdict.value
    panel.button.click()  # even a forced click does not start a 1.5B-parameter step
    assert panel.last_result is None
    panel.model.value = "gpt2-tiny"
    assert not panel.button.disabled


def png_size(png: bytes) -> tuple[int, int]:
    return int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")  # the IHDR chunk's width, height


def test_the_seq_slider_ends_at_the_models_positions_and_follows_the_model(panel):
    """gpt2-tiny has 128 positions: the slider ran to 4096, where every value past 128 predicted nothing."""
    assert panel.seq.max == 128
    panel.seq.value = 1024  # set past the end (as a script could): held at the end, and predicted
    assert panel.seq.value == 128 and panel.last_estimate.label == "gpt2-tiny B=2 S=128 fp32 adamw"
    panel.model.value = "gpt2"
    assert panel.seq.max == 1024 and panel.seq.value == 128  # room to grow; the sequence kept
    panel.seq.value = 1024
    assert panel.last_estimate.label == "gpt2 B=2 S=1024 fp32 adamw"
    panel.model.value = "gpt2-tiny"  # back to 128 positions: the sequence is cut to them, and predicted
    assert (panel.seq.max, panel.seq.value) == (128, 128) and panel.last_estimate.label.startswith("gpt2-tiny")
    assert MemoryPanel(model="llama2-7b", batch=1, seq=512).seq.max == 4096
    assert MemoryPanel(model="gpt2-tiny", seq=4096).seq.value == 128  # a too-long default is cut too


def test_a_sequence_the_estimator_refuses_is_explained_not_raised(panel):
    bars = png_size(bytes(panel.prediction.value))
    panel.seq.max = 4096  # a slider made past the model's positions (a panel over a Recipe can be)
    panel.seq.value = 1024  # the estimator refuses it
    assert png_size(bytes(panel.prediction.value)) == bars  # the explanation keeps the picture's shape
    assert panel.last_estimate is None
    assert "no prediction" in panel.verdict.value and "128 positions" in panel.verdict.value
    assert panel.button.disabled


def test_the_panel_says_which_kernels_it_predicts_for(panel):
    """Lesson 01's panel (cpu kernels) and its memory wall (cuda kernels) gave two figures for one recipe."""
    assert "cpu kernels" in panel.verdict.value
    cuda = MemoryPanel(model="gpt2-xl", batch=1, seq=1024, dtype="fp32")
    cuda.kind = "cuda"  # what a GPU's profile gives it
    cuda._on_change()
    assert "cuda kernels" in cuda.verdict.value
    assert cuda.last_estimate.peak.total < panel_peak("gpt2-xl", "cpu")  # the figure the kernels change


def panel_peak(model, kind):
    from labkit.estimate import estimate

    return estimate(model=model, batch=1, seq=1024, dtype="fp32", optimizer="adamw", device=kind).peak.total


@pytest.mark.parametrize("budget_gib", [26.64 / 1024, 0.75, 3.3, 24.0, 2.0**-25])
def test_the_budget_sliders_grid_passes_through_the_budget_given(budget_gib):
    """The browser snaps a slider to min + k * step: lesson 12's 26.64 MiB became 26.91 MiB."""
    p = MemoryPanel(model="gpt2-tiny", budget_gib=budget_gib)
    value = p.budget.value  # in GiB: the budget's whole bytes
    assert abs(value / budget_gib - 1) < 1e-7 and p.budget_readout.value == fmt_bytes(int(budget_gib * GiB))
    k = (math.log2(value) - p.budget.min) / p.budget.step
    assert abs(k - round(k)) < 1e-9 and p.budget.min <= math.log2(value) <= p.budget.max
    assert p.budget.max - p.budget.min > 20  # still a wide range
    assert abs(2 ** (p.budget.min + round(k) * p.budget.step) / value - 1) < 1e-12


def test_measure_with_a_generous_budget_draws_predicted_vs_measured(panel):
    panel.button.click()
    result = panel.last_result
    assert panel.last_error is None, panel.last_error
    assert result.fits and result.measurement is not None
    assert "fits" in panel.message.value and "does not" not in panel.message.value
    assert 0.7 < result.measurement.peak.total / panel.last_estimate.peak.total < 1.5
    fig = panel.last_figure
    assert fig is not None and len(fig.axes) == 2  # compare_bar and timeline
    assert not panel.button.disabled  # ready for the next run


def test_measure_with_a_tiny_budget_reports_out_of_memory_and_carries_on(panel):
    panel.budget.value = 2**-10  # 1 MiB: less than the model and its optimizer state
    panel.button.click()
    assert panel.last_error is None, panel.last_error
    assert panel.last_result.fits is False and panel.last_result.measurement is None
    assert panel.message.value.count("does not fit") == 1 and "1.00 MiB budget" in panel.message.value
    assert panel.last_figure is None
    panel.budget.value = 1.0  # the kernel lives on: the same panel measures again
    panel.button.click()
    assert panel.last_result.fits and panel.last_figure is not None


def test_controls_and_picture_wrap_rather_than_squeeze(panel):
    """Lessons 10 and 13 in a narrower window: the row of controls was squeezed ("sequenc", no readouts, cut
    drop-downs). The browser test checks the words at 1280 pixels; this checks the layout that keeps them."""
    row = panel.widget.children[0]
    assert row.layout.flex_flow == "row wrap"
    assert all(box.layout.flex == "0 0 auto" for box in row.children)  # none shrinks below its controls
    assert panel.prediction.layout.max_width == "100%"  # the picture scales down instead
