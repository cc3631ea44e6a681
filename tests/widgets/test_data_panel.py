"""Drive DataScalingPanel through its widgets: predictions follow the controls, the button measures."""

import matplotlib

matplotlib.use("Agg")

from labkit.memory import MiB  # noqa: E402
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
