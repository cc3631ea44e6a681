"""Lesson 10: every reference solution passes its check; blanks and plausible wrong answers fail, with a hint."""

import pytest

from conftest import load_solutions
from labkit.exercises import lesson10
from labkit.models.gpt import GPT, GPTConfig

CFG = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=64)


@pytest.fixture(scope="module")
def sol10():
    return load_solutions(10)


def test_stage0_activations(sol10, says, blank):
    _, one, _ = lesson10.stage0_activation_bytes(CFG, 8, 64, 4, 8, "gpipe")
    g, f = sol10.stage0_activations(one, 4, 8)
    assert lesson10.check_stage0_activations(g, f, CFG, 8, 64, 4, 8) is True
    says("✅", "8 micro-batches in flight", "4 micro-batches in flight")
    assert lesson10.check_stage0_activations(g, g, CFG, 8, 64, 4, 8) is False
    says("❌", "min(p - s, m)")
    assert lesson10.check_stage0_activations(blank, f, CFG, 8, 64, 4, 8) is False
    says("❌", "not answered")


def test_bubble(sol10, says, blank):
    assert lesson10.check_bubble(sol10.bubble(4, 12), 4, 12) is True
    says("✅", "3/15")
    assert lesson10.check_bubble(3 / 12, 4, 12) is False
    says("❌", "relative to the ideal step")
    assert lesson10.check_bubble(blank) is False


def test_tp_param_bytes(sol10, says, blank):
    answer = sol10.tp_param_bytes(CFG, 2)
    assert answer == lesson10.tp_param_bytes(CFG, 2)
    assert lesson10.check_tp_param_bytes(answer, CFG, 2) is True
    says("✅", "whole on every rank")
    full = 4 * sum(p.numel() for p in GPT(CFG).parameters())
    assert lesson10.check_tp_param_bytes(full // 2, CFG, 2) is False
    says("❌", "replicated")
    assert lesson10.check_tp_param_bytes(blank, CFG, 2) is False


# ---- per-student inputs: every combination a course may draw, and a classmate's answer fails -------------------
EX_MODEL = GPTConfig(vocab_size=256, block_size=64, n_layer=8, n_head=4, n_embd=64)  # exercise 1's, smoke-sized


def _two_students(key):
    """The inputs of two students whose draws for exercise `key` differ."""
    drawn = [lesson10.inputs(key, f"s{i}", quiet=True) for i in range(40)]
    return drawn[0], next(d for d in drawn if d != drawn[0])


def test_inputs_on_your_own_are_the_lessons(monkeypatch):
    monkeypatch.delenv("LABKIT_STUDENT", raising=False)
    assert lesson10.inputs("stage0_activations") == {"batch": 16, "p": 4, "m": 8}
    assert lesson10.inputs("bubble") == {"p": 4, "m": 12}
    assert lesson10.inputs("tp_param_bytes") == {"t": 2, "dtype": "fp32"}
    assert all(len(lesson10.inputs.every(k)) <= 24 for k in lesson10.inputs.table)


def _stage0_answer(sol10, batch, p, m, seq=64):
    _, one, _ = lesson10.stage0_activation_bytes(EX_MODEL, batch, seq, p, m, "gpipe")
    return sol10.stage0_activations(one, p, m)


def test_stage0_activations_every_drawn_input(sol10, says):
    for drawn in lesson10.inputs.every("stage0_activations"):
        g, f = _stage0_answer(sol10, **drawn)
        assert lesson10.check_stage0_activations(g, f, EX_MODEL, seq=64, **drawn) is True, drawn
        says("✅", f"{drawn.m} micro-batches in flight", f"{min(drawn.p, drawn.m)} micro-batches in flight")
    mine, theirs = _two_students("stage0_activations")
    assert lesson10.check_stage0_activations(*_stage0_answer(sol10, **theirs), EX_MODEL, seq=64, **mine) is False


def test_bubble_every_drawn_input(sol10, says):
    for drawn in lesson10.inputs.every("bubble"):
        assert lesson10.check_bubble(sol10.bubble(**drawn), **drawn) is True, drawn
        says("✅", f"{drawn.p - 1}/{drawn.m + drawn.p - 1}")
        assert lesson10.check_bubble((drawn.p - 1) / drawn.m, **drawn) is False
        says("❌", "relative to the ideal step")
    mine, theirs = _two_students("bubble")
    assert lesson10.check_bubble(sol10.bubble(**theirs), **mine) is False


def test_tp_param_bytes_every_drawn_input(sol10, says):
    full = sum(p.numel() for p in GPT(CFG).parameters())
    for drawn in lesson10.inputs.every("tp_param_bytes"):
        answer = sol10.tp_param_bytes(CFG, **drawn)
        assert answer == lesson10.tp_param_bytes(CFG, drawn.t, lesson10.BYTES[drawn.dtype])
        assert lesson10.check_tp_param_bytes(answer, CFG, **drawn) is True, drawn
        says("✅", "whole on every rank", f"({drawn.dtype})")
        assert lesson10.check_tp_param_bytes(lesson10.BYTES[drawn.dtype] * full // drawn.t, CFG, **drawn) is False
        says("❌", "replicated")
        if drawn.dtype != "fp32":
            assert lesson10.check_tp_param_bytes(sol10.tp_param_bytes(CFG, drawn.t), CFG, **drawn) is False
            says("❌", "4 bytes per parameter")
    mine, theirs = _two_students("tp_param_bytes")
    assert lesson10.check_tp_param_bytes(sol10.tp_param_bytes(CFG, **theirs), CFG, **mine) is False
