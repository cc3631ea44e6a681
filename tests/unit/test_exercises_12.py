"""Lesson 12's exercise checks: the solutions pass, blanks and typical mistakes fail with a hint."""

import importlib.util
from pathlib import Path

import pytest

from labkit.exercises import lesson12
from labkit.models.cnn import CNNConfig, predict

SOL = Path(__file__).resolve().parents[2] / "notebooks" / "solutions" / "lesson12.py"


@pytest.fixture(scope="module")
def sol12():
    spec = importlib.util.spec_from_file_location("solutions_lesson12", SOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_unit_samples(sol12, blank, says):
    assert lesson12.check_unit_samples(sol12.UNIT_SAMPLES, 1000, 3, 2, 2, 1) is True
    says("✅")
    assert all(lesson12.check_unit_samples(sol12.unit_samples(1003, 2, 3, r, w), 1003, 2, 3, r, w)
               for r in range(2) for w in range(3))
    assert lesson12.check_unit_samples(blank, 1000, 3, 2, 2, 1) is False
    says("❌", "not answered")
    assert lesson12.check_unit_samples(166, 1000, 3, 2, 2, 1) is False
    says("❌", "equal=True")
    assert lesson12.check_unit_samples(333, 1000, 3, 2, 2, 1) is False
    says("❌", "workers split it again")


def test_in_flight_bytes(sol12, blank, says):
    assert lesson12.check_in_flight_bytes(sol12.IN_FLIGHT, 4, 2, 16, 256) is True
    says("✅", "does not grow")
    assert lesson12.check_in_flight_bytes(blank, 4, 2, 16, 256) is False
    for wrong, hint in ((sol12.IN_FLIGHT // 4, "per worker"), (sol12.IN_FLIGHT // 2, "x and y"),
                        (sol12.IN_FLIGHT // 8, "int64"), (123, "workers x prefetch_factor")):
        assert lesson12.check_in_flight_bytes(wrong, 4, 2, 16, 256) is False
        says("❌", hint)


def test_largest_phi(sol12, blank, says):
    c = CNNConfig()
    budget = (predict(c.at(2), 4).resident + predict(c.at(2.5), 4).resident) // 2
    assert sol12.largest_phi(c, 4, budget) == 2
    assert lesson12.check_largest_phi(sol12.largest_phi(c, 4, budget), c, 4, budget) is True
    says("✅")
    assert lesson12.check_largest_phi(blank, c, 4, budget) is False
    says("❌", "not answered")
    assert lesson12.check_largest_phi(3, c, 4, budget) is False
    says("❌", "over the budget")
    assert lesson12.check_largest_phi(1, c, 4, budget) is False
    says("❌", "larger phi")
