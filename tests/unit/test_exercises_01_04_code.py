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


# ---- lesson 02 -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def s02():
    return load_solutions(2)


@pytest.mark.parametrize("seed", [1, 7])
def test_flush_share_solution_passes(s02, seed, says):
    from labkit.exercises import lesson02

    assert lesson02.check_flush_share(s02.flush_share, seed=seed) is True
    says("✅", "fresh tensors")


def test_flush_share_cases_have_zeros_and_flushes():
    from labkit.exercises import lesson02
    from labkit.precision import flush_fraction

    for t, scale in lesson02._flush_cases(3):
        assert (t == 0).any() and 0 < flush_fraction(t, "fp16", scale) < 1


@pytest.mark.parametrize("wrong, hint", [
    ("all_values", "nonzero values only"),
    ("no_scale", "multiplies the values before the cast"),
    ("bf16", "torch.float16"),
    ("below_min", "count the nonzero values"),
])
def test_flush_share_wrong_answers_fail_with_a_hint(wrong, hint, says):
    import torch

    from labkit.exercises import lesson02

    def fn(t, scale):
        x = t.double()
        if wrong == "all_values":  # zeros counted in the denominator
            return float(((x != 0) & ((x * scale).half() == 0)).sum()) / x.numel()
        if wrong == "no_scale":
            return float(((x != 0) & (x.half() == 0)).sum()) / float((x != 0).sum())
        if wrong == "bf16":
            return float(((x != 0) & ((x * scale).to(torch.bfloat16) == 0)).sum()) / float((x != 0).sum())
        # below fp16's smallest normal 2^-14, not its smallest subnormal: subnormals counted as flushed
        return float(((x != 0) & ((x * scale).abs() < 2.0**-14)).sum()) / float((x != 0).sum())

    assert lesson02.check_flush_share(fn, seed=1) is False
    says("❌", "wrong for", hint)


def test_flush_share_blank_and_errors_fail(says, blank):
    from labkit.exercises import lesson02

    assert lesson02.check_flush_share(blank) is False
    says("❌", "not answered")
    assert lesson02.check_flush_share(lambda t, s: 1 / 0, seed=1) is False
    says("❌", "raised ZeroDivisionError")
    assert lesson02.check_flush_share("0.5", seed=1) is False
    says("❌", "expected a function")


def test_why_skip(s02, says, blank):
    from labkit.exercises import lesson02

    assert lesson02.check_why_skip(s02.WHY_SKIP) is True
    says("✅", "corrupted model")
    assert lesson02.check_why_skip("b") is False
    says("❌", "inf / S")
    assert lesson02.check_why_skip("C") is False
    says("❌", "speed")
    assert lesson02.check_why_skip("x") is False
    says("❌", "one of")
    assert lesson02.check_why_skip(blank) is False
    says("❌", "not answered")


# ---- lesson 03 -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def s03():
    return load_solutions(3)


@pytest.mark.parametrize("seed", [1, 7])
def test_best_k_solution_passes(s03, seed, says):
    from labkit.exercises import lesson03

    assert lesson03.check_best_k(s03.best_k, seed=seed) is True
    says("✅", "best_segments")


def test_best_k_wrong_answers_fail_with_a_hint(says, blank):
    import math

    from labkit.exercises import lesson03

    def sqrt_rule(n, A, a):  # the smooth curve's minimum, rounded
        return max(1, min(n, round(math.sqrt(n * A / a))))

    def smooth(n, A, a):  # n / k blocks per segment, as if blocks could be split
        return min(range(1, n + 1), key=lambda k: k * a + n / k * A)

    def every_block(n, A, a):
        return n

    found = {}
    for name, fn in (("sqrt", sqrt_rule), ("smooth", smooth), ("n", every_block)):
        for seed in range(1, 40):  # a draw where this slip gives a worse peak
            if lesson03.check_best_k(fn, seed=seed) is False:
                found[name] = says("❌", "wrong for")
                break
    assert set(found) == {"sqrt", "smooth", "n"}
    assert "compare the candidates" in found["sqrt"] or "whole blocks" in found["sqrt"]
    assert "alive at the peak" in found["n"] or "whole" in found["n"]
    assert lesson03.check_best_k(lambda n, A, a: 0, seed=1) is False
    says("❌", "from 1 to n")
    assert lesson03.check_best_k(lambda n, A, a: [][0], seed=1) is False
    says("❌", "raised IndexError")
    assert lesson03.check_best_k(blank) is False
    says("❌", "not answered")


def test_why_pinned(s03, says, blank):
    from labkit.exercises import lesson03

    assert lesson03.check_why_pinned(s03.WHY_PINNED) is True
    says("✅", "copy engine")
    assert lesson03.check_why_pinned("a") is False
    says("❌", "overlap")
    assert lesson03.check_why_pinned("c") is False
    says("❌", "host RAM")
    assert lesson03.check_why_pinned("?") is False
    says("❌", "one of")
    assert lesson03.check_why_pinned(blank) is False
    says("❌", "not answered")


# ---- lesson 04 -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def s04():
    return load_solutions(4)


@pytest.mark.parametrize("seed", [1, 7])
def test_token_shares_solution_passes(s04, seed, says):
    from labkit.exercises import lesson04

    assert lesson04.check_token_shares(s04.token_shares, seed=seed) is True
    says("✅", "micro_shares")


def test_token_shares_cases_are_padded_and_uneven():
    from labkit.exercises import lesson04

    for y, sizes, ignore in lesson04._padded_cases(3):
        assert (y == ignore).any() and sum(sizes) == y.shape[0]
        assert ((y != ignore).sum(dim=1) >= 1).all()


@pytest.mark.parametrize("wrong, hint", [
    ("rows", "every position"),
    ("equal", "equal shares"),
    ("minus100", "the ignore_index passed in"),  # ignores the ignore_index it is given
    ("ones", "F.cross_entropy averages over"),
])
def test_token_shares_wrong_answers_fail_with_a_hint(wrong, hint, says):
    import torch

    from labkit.exercises import lesson04

    def fn(y, sizes, ignore_index):
        parts = torch.split(y, list(sizes))
        if wrong == "rows":
            return [s / y.shape[0] for s in sizes]
        if wrong == "equal":
            return [1 / len(sizes)] * len(sizes)
        if wrong == "ones":
            return [1.0] * len(sizes)
        counts = [int((p != -100).sum()) for p in parts]
        return [c / sum(counts) for c in counts]

    assert lesson04.check_token_shares(fn, seed=1) is False
    says("❌", "wrong for", hint)


def test_token_shares_blank_and_errors_fail(says, blank):
    from labkit.exercises import lesson04

    assert lesson04.check_token_shares(blank) is False
    says("❌", "not answered")
    assert lesson04.check_token_shares(lambda y, s, i: [1.0], seed=1) is False
    says("❌", "one share each")
    assert lesson04.check_token_shares(lambda y, s, i: y.foo, seed=1) is False
    says("❌", "raised AttributeError")


def test_why_no_sync(s04, says, blank):
    from labkit.exercises import lesson04

    assert lesson04.check_why_no_sync(s04.WHY_NO_SYNC) is True
    says("✅", "linear")
    assert lesson04.check_why_no_sync("a") is False
    says("❌", ".grad holds")
    assert lesson04.check_why_no_sync("c") is False
    says("❌", "frees nothing")
    assert lesson04.check_why_no_sync("") is False
    says("❌", "one of")
    assert lesson04.check_why_no_sync(blank) is False
    says("❌", "not answered")
