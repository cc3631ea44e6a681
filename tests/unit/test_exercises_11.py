"""Lesson 11's exercise checks: the solutions pass, blanks and typical mistakes fail with a hint."""

import math

from conftest import load_solutions
from labkit.exercises import lesson11


def test_dgc_bytes(blank, says):
    sol = load_solutions(11)
    assert lesson11.check_dgc_bytes(sol.dgc_bytes) is True
    says("✅", "fresh inputs")
    assert lesson11.check_dgc_bytes(sol.dgc_bytes, seed=3) is True  # other inputs, same function
    assert lesson11.check_dgc_bytes(blank) is False
    says("❌", "not answered")
    assert lesson11.check_dgc_bytes(3) is False
    says("❌", "expected a function")
    assert lesson11.check_dgc_bytes(lambda ns, d, w: ...) is False  # the notebook's stub, unchanged
    says("❌", "not answered")
    assert lesson11.check_dgc_bytes(lambda ns, d, w: "many") is False
    says("❌", "not a number")
    wrong = {
        "int32 index": lambda ns, d, w: sol.dgc_bytes(ns, d, w) / 2,
        "(N-1)/N": lambda ns, d, w: w * 8 * sum(max(1, math.ceil(n * d - 1e-9)) for n in ns),
        "all-reduce": lambda ns, d, w: 2 * sol.dgc_bytes(ns, d, w),
        "ceil": lambda ns, d, w: (w - 1) * 8 * sum(int(n * d) for n in ns),
        "raised": lambda ns, d, w: 1 / 0,
    }
    for hint, fn in wrong.items():
        assert lesson11.check_dgc_bytes(fn) is False, hint
        says("❌", hint)


def test_why_memory(blank, says):
    sol = load_solutions(11)
    assert lesson11.check_why_memory(sol.WHY) is True
    says("✅", "8,000,000 bytes")
    assert lesson11.check_why_memory(blank) is False
    says("❌", "not answered")
    for wrong, hint in (("a", "freed"), ("c", "tiny"), ("d", "ledger"), ("e", "one of")):
        assert lesson11.check_why_memory(wrong) is False
        says("❌", hint)
