"""Estimator options for checkpointing, activation offload and micro-batching, against the ledger."""

import pytest

from labkit.estimate import estimate
from labkit.run import measure_step
from labkit.estimate.moments import segments_of
from labkit.models.gpt import GPTConfig

G = GPTConfig(n_layer=6, n_head=4, n_embd=96, block_size=64)
G_MANUAL = GPTConfig(n_layer=4, n_head=4, n_embd=64, block_size=64, attention="manual", dropout=0.1)

CASES = [
    (G, 4, 64, "fp32", "sgd", dict(checkpoint="full")),
    (G, 4, 64, "fp32", "adamw", dict(checkpoint="sqrt")),
    (G, 2, 32, "mixed-bf16", "sgd", dict(checkpoint="full", segments=2)),  # 16-bit is slow on CPUs: small
    (G, 2, 32, "bf16", "sgd", dict(checkpoint="selective")),
    (G, 4, 64, "fp32", "sgd", dict(offload_activations=True)),
    (G, 2, 32, "mixed-bf16", "adamw", dict(offload_activations=True)),
    (G, 4, 64, "fp32", "sgd", dict(micro_batch=2)),
    (G, 2, 32, "mixed-bf16", "sgd", dict(micro_batch=1, checkpoint="full", segments=3)),
    (G_MANUAL, 4, 64, "fp32", "sgd", dict(offload_activations=True)),
    (G_MANUAL, 4, 64, "fp32", "sgd", dict(checkpoint="sqrt")),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[3]}-{c[4]}-" + "-".join(f"{k}={v}" for k, v in c[5].items()))
def test_option_within_3_percent_of_the_ledger(case):
    model, B, S, dtype, opt, kw = case
    e = estimate(model, B, S, dtype, opt, **kw)
    m = measure_step(model, B, S, dtype, opt, steps=2, **kw)
    assert abs(e.peak.total - m.peak.total) <= 0.03 * m.peak.total, (e.label, e.peak.total, m.peak.total)


def test_options_save_what_they_should():
    none = estimate(G, 8, 64).peak.total
    full = estimate(G, 8, 64, checkpoint="full").peak.total
    sqrt = estimate(G, 8, 64, checkpoint="sqrt").peak.total
    micro = estimate(G, 8, 64, micro_batch=2).peak.total
    assert full < sqrt < none and micro < none
    # what the forward leaves saved: every block's activations, or only the segments' inputs
    from labkit.memory import Category
    from labkit.estimate import Precision, spec_from
    from labkit.estimate.predict import input_bytes, walk_activations
    w, marks = walk_activations(spec_from(G), Precision.of("fp32"), 8, 64, "cpu")
    act_none = estimate(G, 8, 64).phases["forward"][Category.ACT]
    assert act_none == input_bytes(8, 64) + w.saved_bytes
    # with 2 segments the forward peaks inside the last segment's last block: the first segment's input and
    # the last one's (its checkpoint keeps it while its later blocks run) are the only activations held
    act_full = estimate(G, 8, 64, checkpoint="full", segments=2).phases["forward"][Category.ACT]
    assert act_full == input_bytes(8, 64) + marks[0][0] + 2 * 8 * 64 * 96 * 4


def test_segments_follow_recompute_segment_bounds():
    from labkit.recompute import segment_bounds, sqrt_segments
    for n in (1, 4, 7, 12):
        for k in range(1, n + 1):
            assert segments_of(n, "full", k) == [e - s for s, e in segment_bounds(n, k)]
        assert len(segments_of(n, "sqrt", None)) == sqrt_segments(n)


@pytest.mark.parametrize("kw, match", [
    (dict(checkpoint="some"), "checkpoint"), (dict(checkpoint="full", segments=0), "segments"),
    (dict(checkpoint="full", segments=9), "segments"), (dict(micro_batch=3), "micro_batch"),
    (dict(micro_batch=0), "micro_batch"),
])
def test_bad_options(kw, match):
    with pytest.raises(ValueError, match=match):
        estimate(G, 4, 32, **kw)
