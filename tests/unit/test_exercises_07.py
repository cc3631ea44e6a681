"""Lesson 07: every reference solution passes its check; blanks and plausible wrong answers fail, with a hint."""

import pytest
import torch

from labkit.exercises import lesson07

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny CPU steps run faster on one thread


@pytest.fixture(scope="module")
def weight():
    """A (96, 128) weight like a transformer's, with one large outlier, as MiniLM's output projections have."""
    w = torch.randn(96, 128, generator=torch.Generator().manual_seed(0)) * 0.05
    w[3, 7] = 4.0
    return w


# ---- exercise 1: bits per parameter of NF4 with double quantization -------------------------------------
def test_nf4_bits_solution_passes(sol07, says):
    assert lesson07.check_nf4_bits(sol07.NF4_BITS_128, 128) is True
    assert lesson07.check_nf4_bits(sol07.nf4_bits(64), 64) is True
    assert lesson07.check_nf4_bits(sol07.nf4_bits(256), 256) is True
    assert "❌" not in says("✅", "4 + 8/128")
    assert abs(lesson07.nf4_bits_measured(64) - 4.127) < 1e-3  # the paper's figure


def test_nf4_bits_blank_fails(blank, says):
    assert lesson07.check_nf4_bits(blank) is False
    says("❌", "not answered yet")


@pytest.mark.parametrize("answer, hint", [
    (4 + 32 / 128, "without double quantization"),
    (4.5, "blocks of 64"),
    (4 + 8 / 64 + 32 / (64 * 256), "blocks of 64"),
    (4 + 8 / 128, "second-level"),
    (4, "codes alone"),
    ((4 + 8 / 128 + 32 / (128 * 256)) / 8, "bytes"),
    (5, "add up"),
    ("4.06", "expected a number"),
])
def test_nf4_bits_wrong_answers_fail_with_a_hint(answer, hint, says):
    assert lesson07.check_nf4_bits(answer, 128) is False
    says("❌", hint)


# ---- exercise 2: what one outlier does to per-tensor absmax int8 ----------------------------------------
def test_zeros_solution_passes(sol07, weight, says):
    answer = sol07.zeros_per_tensor(weight)
    assert answer == lesson07.zeros_per_tensor(weight)
    assert answer > weight.numel() // 5  # the outlier's step wipes out many small weights
    assert lesson07.check_zeros_per_tensor(answer, weight) is True
    says("✅", "max|W|/127")


def test_zeros_blank_fails(blank, weight, says):
    assert lesson07.check_zeros_per_tensor(blank, weight) is False
    says("❌", "not answered yet")


def test_zeros_wrong_answers_fail_with_a_hint(weight, says):
    step = weight.abs().max() / 127
    wrong = {
        int((torch.round(weight / (weight.abs().amax(1, keepdim=True) / 127)) == 0).sum()): "per channel",
        int((weight.abs() < step).sum()): "half",
        int((weight.abs() < weight.abs().max() / 255).sum()): "255",
        0: "already 0",
        7: "round(w / step)",
    }
    assert len(wrong) == 5, "the wrong answers must differ from each other for this weight"
    for answer, hint in wrong.items():
        assert lesson07.check_zeros_per_tensor(answer, weight) is False
        says("❌", hint)
    assert lesson07.check_zeros_per_tensor(2.5, weight) is False
    says("❌", "whole number")
