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


# ---- per-student inputs (labkit.exercises.Inputs) -----------------------------------------------------------
def _copied_answer_fails(key, solve, check):
    """A classmate's right answer, checked on another student's inputs (ones whose answer differs), fails."""
    drawn = [lesson12.inputs(key, f"s{i}", quiet=True) for i in range(12)]
    pairs = [(a, b) for a in drawn for b in drawn if a != b and solve(**a) != solve(**b)]
    assert pairs, key
    a, b = pairs[0]
    assert check(solve(**a), **b) is False


def test_inputs_are_the_lessons_own_on_your_own(monkeypatch, capsys):
    from labkit import exercises

    monkeypatch.delenv(exercises.STUDENT_ENV, raising=False)
    assert lesson12.inputs("unit_samples") == {"num_samples": 1000, "world": 3, "workers": 2, "rank": 2}
    assert lesson12.inputs("in_flight_bytes") == {"num_workers": 4, "prefetch_factor": 2, "batch": 16, "seq": 256}
    assert lesson12.inputs("largest_phi") == {"gamma": CNNConfig().gamma, "budget_scale": 1}  # the CNN as it is
    assert capsys.readouterr().out == ""
    assert all(len(lesson12.inputs.every(k)) <= 24 for k in lesson12.inputs.table)


def test_unit_samples_every_input(sol12):
    for ex in lesson12.inputs.every("unit_samples"):
        assert ex.rank < ex.world  # rank `rank`'s worker 1 exists
        assert lesson12.check_unit_samples(sol12.unit_samples(worker=1, **ex), worker=1, **ex) is True
        assert ex.num_samples % (ex.world * ex.workers)  # the leftover samples make the exercise
    _copied_answer_fails("unit_samples", lambda **ex: sol12.unit_samples(worker=1, **ex),
                         lambda answer, **ex: lesson12.check_unit_samples(answer, worker=1, **ex))


def test_in_flight_bytes_every_input(sol12):
    for ex in lesson12.inputs.every("in_flight_bytes"):
        assert lesson12.check_in_flight_bytes(sol12.in_flight_bytes(**ex), **ex) is True
    _copied_answer_fails("in_flight_bytes", sol12.in_flight_bytes, lesson12.check_in_flight_bytes)


@pytest.mark.parametrize("batch, phis", [(4, [0, 1, 2, 3]), (16, [0, 1, 2, 3, 4, 5])])  # smoke, full (the notebook)
def test_largest_phi_every_input(sol12, batch, phis):
    c = CNNConfig()
    budget = (predict(c.at(phis[-2]), batch).resident + predict(c.at(phis[-1]), batch).resident) // 2
    answers = set()
    for ex in lesson12.inputs.every("largest_phi"):
        phi = sol12.largest_phi(c, batch, budget, **ex)
        assert phi is not None and 0 <= phi < 8, ex  # inside the range, not stuck at its end
        assert lesson12.check_largest_phi(phi, c, batch, budget, **ex) is True
        answers.add(phi)
    assert len(answers) > 3
    assert sol12.largest_phi(c, batch, budget, **lesson12.inputs.every("largest_phi")[0]) == \
        sol12.largest_phi(c, batch, budget)  # the lesson's own inputs: today's question
    _copied_answer_fails("largest_phi", lambda **ex: sol12.largest_phi(c, batch, budget, **ex),
                         lambda answer, **ex: lesson12.check_largest_phi(answer, c, batch, budget, **ex))
