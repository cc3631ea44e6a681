"""Drive DataScalingPanel through its widgets: predictions follow the controls, the button measures."""

import matplotlib

matplotlib.use("Agg")

import math  # noqa: E402

from labkit.memory import MiB, fmt_bytes  # noqa: E402
from labkit.models.cnn import CNNConfig, predict  # noqa: E402
from labkit.viz.data_panel import DataScalingPanel  # noqa: E402


def _panel():
    return DataScalingPanel(corpus_tokens=100_000, batch=4, seq=32, cnn_batch=2, budget_mib=4.0)


def test_dataset_size_grows_the_disk_not_the_loader_ram():
    p = _panel()
    first = p.last_plan
    assert bytes(p.prediction.value).startswith(b"\x89PNG")
    p.repeat.value = 100
    assert p.last_plan.dataset_bytes == 100 * first.dataset_bytes
    assert p.last_plan.loader_bytes == first.loader_bytes
    p.workers.value, p.prefetch.value = 4, 4
    assert p.last_plan.loader_terms["batches in flight"] == 16 * 2 * 4 * 32 * 8
    p.workers.value = 0
    assert p.prefetch.disabled and p.last_plan.loader_terms["batches in flight"] == 2 * 4 * 32 * 8


def test_the_picture_is_linear_the_button_says_all_its_words_and_the_budget_is_the_lessons():
    p = DataScalingPanel(corpus_tokens=100_000, batch=4, seq=32, cnn_batch=2, budget_mib=26.64)
    assert "fits in 26.64 MiB" in p.verdict.value  # the lesson's budget, not a slider step near it (26.91)
    k = (math.log2(26.64) - p.budget.min) / p.budget.step
    assert abs(k - round(k)) < 1e-9  # the browser's slider snaps to this grid: it keeps 26.64
    assert p.button.layout.width == "auto"  # "Measure the CNN step", not cut short
    p.repeat.value = 1000
    fig = p.last_figure
    disk, ram = fig.axes[0], fig.axes[0].patches
    assert disk.get_yscale() == "linear"  # on a log axis 1000x drew as a step of 3 decades, alike to the eye
    heights = [b.get_height() for b in ram]
    assert heights[0] / heights[1] == p.last_plan.dataset_bytes / p.last_plan.loader_bytes
    words = [t.get_text() for t in disk.texts]
    assert words == [fmt_bytes(p.last_plan.dataset_bytes), fmt_bytes(p.last_plan.loader_bytes)]


def test_budget_and_phi_redraw_the_verdict_and_the_button_measures():
    p = _panel()
    c = CNNConfig()
    p.budget.value = predict(c.at(2), 2).resident / MiB * 1.001
    assert p.last_plan.best_phi == 2 and "largest phi that fits: 2" in p.verdict.value
    p.phi.value = 3.0
    assert "does not fit" in p.verdict.value
    p.button.click()
    fits, err = p.last_result
    assert not fits and "does not fit" in p.message.value
    p.phi.value = 0.0
    p.button.click()
    fits, m = p.last_result
    assert fits and m.saved == predict(c, 2).saved and "fits" in p.message.value
