"""Lesson 13: every reference solution passes its check; blanks and plausible wrong answers fail, with a hint."""

import pytest

from conftest import load_solutions
from labkit.exercises import lesson13

N = 6_738_415_616  # llama2-7b's parameters


@pytest.fixture(scope="module")
def sol13():
    return load_solutions(13)


def test_zero3_state_bytes(sol13, says, blank):
    assert lesson13.check_zero3_state_bytes(sol13.zero3_state_bytes(N, 8), N, 8) is True
    says("✅", "16 x")
    assert lesson13.check_zero3_state_bytes(2 * N + 14 * N / 8, N, 8) is False
    says("❌", "stage 2")
    assert lesson13.check_zero3_state_bytes(16 * N, N, 8) is False
    says("❌", "one device")
    assert lesson13.check_zero3_state_bytes(blank, N, 8) is False
    says("❌", "not answered")


def test_largest_micro_batch(sol13, says, blank):
    assert lesson13.check_largest_micro_batch(sol13.largest_micro_batch, seed=1) is True
    says("✅", "fresh cases")
    # fresh seeds: the reference passes whatever the draw
    assert lesson13.check_largest_micro_batch(sol13.largest_micro_batch, seed=7) is True

    def smallest(model, batch, seq, memory):  # a plausible slip: the smallest that fits
        return 1

    assert lesson13.check_largest_micro_batch(smallest, seed=1) is False
    says("❌", "wrong for")

    def whole(model, batch, seq, memory):  # ignores the budget
        return batch

    assert lesson13.check_largest_micro_batch(whole, seed=1) is False

    def boom(model, batch, seq, memory):
        raise RuntimeError("oops")

    assert lesson13.check_largest_micro_batch(boom, seed=1) is False
    says("❌", "raised RuntimeError")
    assert lesson13.check_largest_micro_batch(blank) is False
    says("❌", "not answered")


def test_why_dp(sol13, says, blank):
    assert lesson13.check_why_dp(sol13.WHY_DP) is True
    says("✅", "divides the rows")
    assert lesson13.check_why_dp("a") is False
    says("❌", "in place")
    assert lesson13.check_why_dp("z") is False
    says("❌", "one of")
    assert lesson13.check_why_dp(blank) is False


def test_cases_sit_between_the_ends():
    from labkit.estimate import estimate

    for model, batch, seq, memory in lesson13._cases(3)[:2]:
        assert estimate(model, batch, seq, micro_batch=1).peak.total < memory < estimate(model, batch, seq).peak.total
        assert lesson13.largest_micro_batch(model, batch, seq, memory) not in (None, batch)
