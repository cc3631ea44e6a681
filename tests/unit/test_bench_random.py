"""bench/estimator_accuracy.py --random draws the Recipe fields added by issue 43 (chunked loss, QLoRA's
quantized set, a 16-bit frozen base, paged states) on a stream of their own: every earlier field of every
seed draws as it did before, so the figures reported for a seed stay comparable."""

import pytest

from test_keyed_corrections import _bench


@pytest.fixture(scope="module")
def bench():
    return _bench()


def test_the_added_fields_are_drawn_and_the_earlier_draws_stay(bench, monkeypatch):
    with_added = bench.random_configs(25, 3)
    monkeypatch.setattr(bench, "ADDED_P", dict.fromkeys(bench.ADDED_P, 0.0))
    before = bench.random_configs(25, 3)
    assert [bench._without_added(c) for c in with_added] == before
    drawn = {k for c in with_added for k in c.added}
    assert drawn >= {"loss_chunks", "paged_states"}, drawn  # the frequent ones, on 25 draws
    for c in with_added:  # each added field is in the label and in the overrides
        assert all(f"{k}={c.overrides[k]}" in c.label for k in c.added), c.label


def test_lora_draws_some_of_a_blocks_linears(bench):
    """LoRA on a subset of the Linears: the frozen ones save no input, which only such draws exercise."""
    lora = [c for c in bench.random_configs(70, 1) if "lora_targets" in c.added]
    assert lora
    for c in lora:
        family = c.label.split()[0]
        names = c.overrides["lora_targets"].split(",")
        assert 0 < len(names) < len(bench.BLOCK_LINEARS[family])
        assert set(names) <= set(bench.BLOCK_LINEARS[family])
