"""On a real GPU: the CNN's logical bytes equal the CPU's, and the allocator's growth with and without
expandable segments (reserved never below the peak allocated)."""

import pytest
import torch

from labkit.models.cnn import CNNConfig, measure, predict
from labkit.models.cnn_allocator import allocator_growth

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_saved_activations_on_cuda_match_the_cpu_prediction_within_bn_extras():
    c = CNNConfig().at(2)
    p, m = predict(c, 8), measure(c, 8, device="cuda")
    # cuDNN's batch norm may keep a reserve buffer the CPU kernel does not: allow only that, per BN layer
    assert p.saved <= m.saved and m.saved - p.saved < 0.01 * p.saved


@pytest.mark.parametrize("expandable", [False, True])
def test_allocator_reserves_at_least_the_peak(expandable):
    out = allocator_growth([64, 96, 128, 160], batch=32, expandable=expandable)
    assert out["conf"].endswith(str(expandable))
    for row in out["rows"]:
        assert row["reserved"] >= row["allocated"] and row["max_allocated"] > 0
