"""The compound-scaled CNN: every predicted byte against the ledger, the growth rule, budget and resizing."""

import pytest
import torch

from labkit.memory import Category
from labkit.models.cnn import (CNNConfig, activation_growth_per_phi, largest_phi, measure, predict,
                               progressive_schedule, resident_at_backward)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("phi", [0, 1, 2.5])
@pytest.mark.parametrize("batch", [1, 3])
def test_prediction_matches_the_ledger_exactly(phi, batch):
    c = CNNConfig().at(phi)
    p, m = predict(c, batch), measure(c, batch)
    assert p.saved == m.saved
    assert p.params == m.baseline[Category.PARAM] and p.bytes(Category.BUFFER) == m.baseline[Category.BUFFER]
    assert p.resident == resident_at_backward(m)
    assert m.peak.total > p.resident  # backward adds gradients and gradients in flight on top


def test_scaled_shapes_follow_the_compound_rule():
    c = CNNConfig().at(2)
    assert c.scaled_depths() == [2, 3, 3]  # ceil(1.44 x (1, 2, 2))
    assert c.scaled_widths() == [round(16 * 1.21), round(24 * 1.21), round(32 * 1.21)]
    assert c.scaled_resolution() == round(32 * 1.15**2)
    g = activation_growth_per_phi()
    assert g["flops"] == pytest.approx(1.2 * 1.1**2 * 1.15**2) and 1.9 < g["flops"] < 2.0
    assert g["activations"] == pytest.approx(1.2 * 1.1 * 1.15**2)


def test_activations_grow_like_depth_width_resolution_squared():
    # saved activations per image ~ sum over layers of C * H * W: from phi 0 to 4 the continuous rule
    # gives x1.75^4 = 9.4; the integer rounding of depth and width makes the real family differ by < 25 %
    base, big = CNNConfig(), CNNConfig().at(4)
    ratio = predict(big, 8).saved / predict(base, 8).saved
    assert abs(ratio / activation_growth_per_phi()["activations"] ** 4 - 1) < 0.25, ratio
    per_image = [predict(CNNConfig().at(2), b).saved for b in (1, 2)]
    assert per_image[1] - per_image[0] > 0.99 * per_image[0]  # linear in the batch (a few scalars aside)


def test_largest_phi_in_a_budget():
    c = CNNConfig()
    budget = predict(c.at(3), 8).resident
    assert largest_phi(c, 8, budget) == 3
    assert largest_phi(c, 8, budget - 1) == 2.5
    assert largest_phi(c, 8, predict(c, 8).resident - 1) is None


def test_progressive_resizing_peak_is_the_last_phase_unless_the_batch_shrinks():
    c = CNNConfig()
    fixed = progressive_schedule(c, 8, [16, 24, 32])
    assert [f for _, _, f in fixed] == sorted(f for _, _, f in fixed) and fixed[-1][2] == predict(c, 8, 32).resident
    scaled = progressive_schedule(c, 8, [16, 24, 32], scale_batch=True)
    assert [b for _, b, _ in scaled] == [32, 14, 8]
    assert max(f for _, _, f in scaled) <= 1.05 * scaled[-1][2]  # level within the rounding of the batch


def test_scaling_plan_takes_a_loader_config():
    """plan's loader bytes are loader_ram of the LoaderConfig's settings, by hand: 2 workers x 3 batches of
    (x, y) int64 in flight, 256 positions per worker's shuffle buffer, 2 open shards of 1024 rows of seq + 1
    uint16 tokens per worker; the dataset is corpus x repeat x 2 bytes."""
    from labkit.data.loading import LoaderConfig
    from labkit.models.scaling import plan

    p = plan(1000, 10, LoaderConfig(2, 3, 4, 32), 1.0, 2, 10**9)
    assert p.loader_terms == {"batches in flight": 2 * 3 * 2 * 4 * 32 * 8, "shuffle buffers": 2 * 256 * 8,
                              "open shards (mapped pages)": 2 * 2 * 1024 * 33 * 2}
    assert p.loader_bytes == sum(p.loader_terms.values()) and p.dataset_bytes == 1000 * 10 * 2
    assert 1.0 in p.phis and len(p.resident) == len(p.phis)


@pytest.mark.parametrize("kwargs, field", [(dict(workers=-1), "workers"), (dict(prefetch=0), "prefetch"),
                                           (dict(batch=True), "batch"), (dict(seq=0), "seq"),
                                           (dict(shuffle_buffer=-1), "shuffle_buffer"), (dict(shard_rows=2.0), "shard_rows")])
def test_loader_config_rejects_bad_values(kwargs, field):
    from labkit.data.loading import LoaderConfig

    with pytest.raises(ValueError, match=f"LoaderConfig.{field} "):
        LoaderConfig(**(dict(workers=2, prefetch=2, batch=4, seq=32) | kwargs))
