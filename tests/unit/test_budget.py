"""Simulated budgets fail exactly where a device of that size would, and memory comes back."""

import gc
import re

import pytest
import torch

from labkit.memory import Category, Ledger, SimulatedOutOfMemoryError, run_within_budget
from labkit.estimate import Recipe
from labkit.run import measure_step
from labkit.memory.units import fmt_bytes, parse_bytes
from labkit.models.gpt import GPTConfig

CFG = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64)


def test_budget_fails_exactly_at_the_measured_peak():
    peak = measure_step(Recipe(CFG, 4, 64), steps=2).peak.total
    assert measure_step(Recipe(CFG, 4, 64), steps=2, budget=peak).peak.total == peak  # exactly enough
    with pytest.raises(SimulatedOutOfMemoryError) as info:
        measure_step(Recipe(CFG, 4, 64), steps=2, budget=peak - 1)
    e = info.value
    assert isinstance(e, torch.OutOfMemoryError)  # `except torch.OutOfMemoryError` catches it
    assert e.live.total <= e.budget < e.live.total + e.requested
    assert "budget" in str(e) and "activations" in str(e)


def test_run_within_budget_reports_and_returns_to_baseline():
    big = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=64)
    with Ledger() as outer:  # sees every allocation of the experiments inside it
        baseline = outer.live_bytes
        for _ in range(5):
            r = run_within_budget(lambda: measure_step(Recipe(big, 4, 64), budget=2**20), 2**20)
            assert not r.fits and r.message.startswith("does not fit:")
            gc.collect()
            assert outer.live_bytes == baseline
    ok = run_within_budget(lambda: measure_step(Recipe(CFG, 2, 32)), 2**30)
    assert ok.fits and ok.measurement is not None and ok.peak == ok.measurement.peak.total


def test_budget_message_names_the_largest_category():
    """'does not fit: NEED > BUDGET budget; cat1 X, cat2 Y, ... in use when Z more was asked for': the
    categories in use, largest first, and in-use plus asked is the need (each figure rounded to 0.01 unit)."""
    budget = 4 * 2**20
    big = Recipe(GPTConfig(n_layer=4, n_head=2, n_embd=64, block_size=256), 16, 256)
    r = run_within_budget(lambda: measure_step(big, budget=budget), budget)
    m = re.fullmatch(r"does not fit: (.+?) > 4\.00 MiB budget; (.+) in use when (.+?) more was asked for", r.message)
    assert m and not r.fits, r.message
    need, parts, asked = m.groups()
    assert need == fmt_bytes(r.peak) and r.peak > budget
    named = [p.rsplit(" ", 2) for p in parts.split(", ")]  # [["temporaries", "2.10", "MiB"], ...]
    assert len(named) >= 2 and {name for name, *_ in named} <= {c.value for c in Category}
    sizes = [parse_bytes(f"{v} {u}") for _, v, u in named]
    assert sizes == sorted(sizes, reverse=True)  # the largest first
    figures = [f"{v} {u}" for _, v, u in named] + [asked]
    rounding = sum(0.005 * parse_bytes(f"1 {f.split()[1]}") for f in figures)
    assert abs(sum(parse_bytes(f) for f in figures) - r.peak) <= rounding


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
