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


# ---- per-student inputs (labkit.exercises.Inputs) -----------------------------------------------------------
def test_zero3_state_bytes_inputs(sol13, monkeypatch, capsys):
    from labkit import exercises
    from labkit.estimate import spec_from

    monkeypatch.delenv(exercises.STUDENT_ENV, raising=False)
    assert lesson13.inputs("zero3_state_bytes") == {"n_params": N, "ranks": 8}  # the lesson's llama2-7b over 8
    assert capsys.readouterr().out == ""
    assert N == spec_from("llama2-7b").n_params
    table = lesson13.inputs.table["zero3_state_bytes"]
    assert [spec_from(m).n_params for m in ("llama2-7b", "llama2-13b", "llama2-70b", "llama-65b")] == \
        list(table["n_params"])
    every = lesson13.inputs.every("zero3_state_bytes")
    assert 1 < len(every) <= 24
    for ex in every:
        assert lesson13.check_zero3_state_bytes(sol13.zero3_state_bytes(**ex), **ex) is True
    drawn = [lesson13.inputs("zero3_state_bytes", f"s{i}", quiet=True) for i in range(12)]
    a, b = next((a, b) for a in drawn for b in drawn
                if sol13.zero3_state_bytes(**a) != sol13.zero3_state_bytes(**b))
    assert lesson13.check_zero3_state_bytes(sol13.zero3_state_bytes(**a), **b) is False  # a classmate's answer
