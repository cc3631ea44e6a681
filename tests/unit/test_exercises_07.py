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


# ---- per-student inputs: every combination a course may draw, and a classmate's answer fails -------------------
def _two_students(key):
    """The inputs of two students whose draws for exercise `key` differ."""
    drawn = [lesson07.inputs(key, f"s{i}", quiet=True) for i in range(40)]
    return drawn[0], next(d for d in drawn if d != drawn[0])


def test_inputs_on_your_own_are_the_lessons(monkeypatch):
    monkeypatch.delenv("LABKIT_STUDENT", raising=False)
    assert lesson07.inputs("nf4_bits") == {"blocksize": 128}
    assert lesson07.inputs("zeros_per_tensor") == {"bits": 8}
    assert lesson07.inputs("awq_bytes") == {"d_out": 384, "d_in": 1536, "group": 128}
    assert all(len(lesson07.inputs.every(k)) <= 24 for k in lesson07.inputs.table)


def test_nf4_bits_every_drawn_input(sol07, says):
    for drawn in lesson07.inputs.every("nf4_bits"):
        answer = sol07.nf4_bits(drawn.blocksize)
        assert lesson07.check_nf4_bits(answer, **drawn) is True, drawn
        assert lesson07.check_nf4_bits(round(answer, 4), **drawn) is True, drawn  # four decimals are enough
        says("✅", f"8/{drawn.blocksize}")
        assert lesson07.check_nf4_bits(4 + 8 / drawn.blocksize, **drawn) is False, drawn  # no second-level scale
        says("❌", "second-level")
        assert lesson07.check_nf4_bits(4 + 32 / drawn.blocksize, **drawn) is False, drawn
        says("❌", "without double quantization")
    mine, theirs = _two_students("nf4_bits")
    assert lesson07.check_nf4_bits(sol07.nf4_bits(**theirs), **mine) is False


def test_zeros_every_drawn_input(sol07, weight, says):
    answers = set()
    for drawn in lesson07.inputs.every("zeros_per_tensor"):
        answer = sol07.zeros_per_tensor(weight, **drawn)
        assert answer == lesson07.zeros_per_tensor(weight, **drawn)
        assert lesson07.check_zeros_per_tensor(answer, weight, **drawn) is True, drawn
        says("✅", f"max|W|/{2 ** (drawn.bits - 1) - 1}")
        step = weight.abs().max() / (2 ** (drawn.bits - 1) - 1)
        assert lesson07.check_zeros_per_tensor(int((weight.abs() < step).sum()), weight, **drawn) is False
        says("❌", "half")
        answers.add(answer)
    assert len(answers) == len(lesson07.inputs.every("zeros_per_tensor"))  # each bit more halves the zeros
    mine, theirs = _two_students("zeros_per_tensor")
    assert lesson07.check_zeros_per_tensor(sol07.zeros_per_tensor(weight, **theirs), weight, **mine) is False


def test_awq_bytes_every_drawn_input(sol07, says):
    for drawn in lesson07.inputs.every("awq_bytes"):
        answer = sol07.awq_bytes(**drawn)
        assert answer == lesson07.awq_layer_bytes(**drawn)
        assert lesson07.check_awq_bytes(answer, **drawn) is True, drawn
        says("✅", f"+ {2 * drawn.d_in:,} (")
        n = drawn.d_out * drawn.d_in
        assert lesson07.check_awq_bytes(n // 2 + 3 * n // drawn.group + 2 * drawn.d_out, **drawn) is False
        says("❌", f"input feature ({drawn.d_in})")
    mine, theirs = _two_students("awq_bytes")
    assert lesson07.check_awq_bytes(sol07.awq_bytes(**theirs), **mine) is False


# ---- exercise 4: zeropoint_blocks(x, blocksize) on fresh tensors --------------------------------------------
def test_zeropoint_blocks_solution_passes_on_fresh_tensors(sol07, says):
    assert lesson07.check_zeropoint_blocks(sol07.zeropoint_blocks, seed=1) is True
    says("✅", "fresh tensors")
    assert lesson07.check_zeropoint_blocks(sol07.zeropoint_blocks, seed=2) is True
    a, b = lesson07._tensors(1), lesson07._tensors(2)
    assert any(x.shape != y.shape or not torch.equal(x, y) for (_, x, _), (_, y, _) in zip(a, b))
    assert a[2][1].min() > 0 and a[0][1].min() < 0


def test_zeropoint_blocks_slips_fail_with_a_hint(sol07, says, blank):
    def no_zero_in_range(x, blocksize):  # [min, max] not stretched to hold 0
        g = x.float().reshape(-1, blocksize)
        lo, hi = g.amin(dim=1), g.amax(dim=1)
        scale = (hi - lo) / 255
        zero = torch.round(-lo / scale).clamp(0, 255)
        codes = (torch.round(g / scale[:, None]) + zero[:, None]).clamp(0, 255)
        return codes.to(torch.uint8).view(x.shape), scale, zero.to(torch.uint8)

    assert lesson07.check_zeropoint_blocks(no_zero_in_range, seed=1) is False
    says("❌", "all-positive", "hold 0")

    def per_row(x, blocksize):  # one scale per row instead of per block
        return sol07.zeropoint_blocks(x, x.shape[-1])

    for seed in (1, 2, 3):
        if any(x.shape[-1] != bs for _, x, bs in lesson07._tensors(seed)):
            assert lesson07.check_zeropoint_blocks(per_row, seed=seed) is False
            says("❌", "one scale and one zero point per block")
            break
    else:
        raise AssertionError("no drawn tensor has rows longer than a block")

    def unclamped(x, blocksize):  # codes wrap around instead of being clamped
        codes, scale, zero = sol07.zeropoint_blocks(x, blocksize)
        return (codes.long() + 1) % 256, scale, zero

    assert lesson07.check_zeropoint_blocks(unclamped, seed=1) is False
    says("❌", "wrong codes")

    def two_things(x, blocksize):
        return sol07.zeropoint_blocks(x, blocksize)[:2]

    assert lesson07.check_zeropoint_blocks(two_things, seed=1) is False
    says("❌", "three things")

    def boom(x, blocksize):
        raise ValueError("oops")

    assert lesson07.check_zeropoint_blocks(boom, seed=1) is False
    says("❌", "raised ValueError")
    assert lesson07.check_zeropoint_blocks(blank) is False
    says("❌", "not answered")


def test_zeropoint_blocks_accepts_ties_rounded_up_only_at_ties(sol07, says, monkeypatch):
    """round-half-up instead of torch's round-half-to-even: one code off, and right, exactly at the ties."""
    x = torch.cat([torch.tensor([0.0, 255.0]), torch.arange(30) + 0.5]).view(1, 32)  # scale 1, zero 0: x / scale = x
    monkeypatch.setattr(lesson07, "_tensors", lambda seed: [("a tensor of ties", x, 32)])

    def half_up(x, blocksize):
        codes, scale, zero = sol07.zeropoint_blocks(x, blocksize)
        return torch.floor(x.reshape(-1, blocksize) / scale[:, None] + 0.5).clamp(0, 255), scale, zero

    assert not torch.equal(half_up(x, 32)[0].reshape(-1), sol07.zeropoint_blocks(x, 32)[0].reshape(-1).float())
    assert lesson07.check_zeropoint_blocks(half_up, seed=0) is True
    says("✅")

    def one_off_off_a_tie(x, blocksize):
        codes, scale, zero = sol07.zeropoint_blocks(x, blocksize)
        codes = codes.clone().reshape(-1)
        codes[1] -= 1  # 255.0 is no tie
        return codes, scale, zero

    assert lesson07.check_zeropoint_blocks(one_off_off_a_tie, seed=0) is False
    says("❌", "wrong codes")


def test_why_127(sol07, says, blank):
    assert lesson07.check_why_127(sol07.WHY_127) is True
    says("✅", "+128 does not fit")
    assert lesson07.check_why_127("a") is False
    says("❌", "range of an int8")
    assert lesson07.check_why_127("B") is False
    says("❌", "clamp_min")
    assert lesson07.check_why_127("e") is False
    says("❌", "one of")
    assert lesson07.check_why_127(blank) is False
    says("❌", "not answered")
