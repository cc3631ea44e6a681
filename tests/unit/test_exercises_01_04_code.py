"""Lessons 01-04, the code and "why" exercises: each reference solution passes its check on fresh inputs
(two seeds), blanks and plausible wrong answers fail with a hint."""

import pytest

from conftest import load_solutions
from labkit.exercises import lesson01

pytestmark = pytest.mark.usefixtures("one_thread")  # the estimator's tiny replays run faster on one thread


# ---- lesson 01 -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def s01():
    return load_solutions(1)


@pytest.mark.parametrize("seed", [1, 7])
def test_largest_batch_fn_solution_passes(s01, seed, says):
    assert lesson01.check_largest_batch_fn(s01.largest_batch_fn, seed=seed) is True
    says("✅", "fresh cases")


def test_largest_batch_fn_cases_sit_between_two_batches():
    for model, seq, budget in lesson01._largest_batch_cases(3)[:2]:
        b = lesson01.largest_batch(model, seq, budget)
        assert b >= 1
        assert lesson01.predicted_peak(model, b, seq) <= budget < lesson01.predicted_peak(model, b + 1, seq)


def test_largest_batch_fn_wrong_answers_fail(s01, says, blank):
    def one_too_many(model, seq, budget):  # the first batch that does not fit
        return s01.largest_batch_fn(model, seq, budget) + 1

    assert lesson01.check_largest_batch_fn(one_too_many, seed=1) is False
    says("❌", "over the budget")

    def always_one(model, seq, budget):
        return 1

    assert lesson01.check_largest_batch_fn(always_one, seed=1) is False
    says("❌", "wrong for")

    def boom(model, seq, budget):
        raise RuntimeError("oops")

    assert lesson01.check_largest_batch_fn(boom, seed=1) is False
    says("❌", "raised RuntimeError")
    assert lesson01.check_largest_batch_fn(42, seed=1) is False
    says("❌", "expected a function")
    assert lesson01.check_largest_batch_fn(blank) is False
    says("❌", "not answered")


def test_why_peak(s01, says, blank):
    assert lesson01.check_why_peak(s01.WHY_PEAK) is True
    says("✅", "timeline")
    assert lesson01.check_why_peak("a") is False
    out = says("❌", "look at")
    assert "alive at the same moment" not in out
    assert lesson01.check_why_peak("(c)") is False
    says("❌", "phases")
    assert lesson01.check_why_peak("d") is False
    says("❌", "one of")
    assert lesson01.check_why_peak(blank) is False
    says("❌", "not answered")
