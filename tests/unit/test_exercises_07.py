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


# ---- exercise 3: the bytes of an AWQ int4 layer whose scale stays in the layer ---------------------------
def test_awq_bytes_solution_passes(sol07, says):
    assert sol07.AWQ_BYTES_W == 311_808
    assert lesson07.check_awq_bytes(sol07.AWQ_BYTES_W) is True
    assert lesson07.check_awq_bytes(sol07.awq_bytes(96, 64, 32), 96, 64, 32) is True
    says("✅", "n/2 + 3 n/128 + 2 d_in")


def test_awq_bytes_blank_fails(blank, says):
    assert lesson07.check_awq_bytes(blank) is False
    says("❌", "not answered yet")


N, GROUPS = 384 * 1536, 384 * 1536 // 128


@pytest.mark.parametrize("answer, hint", [
    (N // 2 + 3 * GROUPS, "int4 RTN"),
    (N // 2 + 3 * GROUPS + 2 * 384, "input feature (1536)"),
    (N // 2 + 4 * GROUPS + 2 * 1536, "one byte"),
    (N + 3 * GROUPS + 2 * 1536, "two 4-bit codes share a byte"),
    (N // 2 + 5 * GROUPS + 4 * 1536, "fp16"),
    (8 * 311_808, "bits"),
    (300_000, "add up"),
    (311_808.5, "whole number"),
])
def test_awq_bytes_wrong_answers_fail_with_a_hint(answer, hint, says):
    assert lesson07.check_awq_bytes(answer) is False
    says("❌", hint)
