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
