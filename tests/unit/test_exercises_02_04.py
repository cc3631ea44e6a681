"""Lessons 02-04: every reference solution passes its check; blanks and plausible wrong answers fail, with a hint."""

import pytest
import torch

from labkit.exercises import lesson02, lesson03, lesson04
from labkit.memory import MiB
from labkit.estimate import estimate
from labkit.models.gpt import GPTConfig
from labkit.precision import quantize_fp8

CFG = GPTConfig(n_layer=3, n_head=2, n_embd=64, block_size=64)  # three blocks: k = 2 (sqrt) and k = 3 differ
B, S = 4, 32
GRADS = torch.tensor([3e-9, 2e-7, 5e-5, 1e-2, 4.0])
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny CPU steps run faster on one thread


# ---- lesson 02, exercise 1: bytes per parameter with fp32 masters ----------------------------------------
def test_master_bytes_solutions_pass(sol02, says):
    assert lesson02.check_master_bytes(sol02.MASTER_BYTES_PER_PARAM, "sgd-momentum") is True
    assert lesson02.check_master_bytes(sol02.ADAMW_MASTER_BYTES_PER_PARAM, "adamw") is True
    assert lesson02.check_master_bytes(sol02.master_bytes_per_param(0), "sgd") is True
    assert "❌" not in says("✅")
    assert sol02.MASTER_BYTES_PER_PARAM == 16 and sol02.ADAMW_MASTER_BYTES_PER_PARAM == 20


def test_master_bytes_blank_fails(blank, says):
    assert lesson02.check_master_bytes(blank) is False
    says("❌", "not answered yet")


@pytest.mark.parametrize("optimizer, answer, hint", [
    ("sgd-momentum", 12, "fp32 copy is missing"),  # masters or master gradients forgotten
    ("sgd-momentum", 14, "16-bit gradients"),
    ("sgd-momentum", 20, "adamw"),  # AdamW's states for SGD with momentum
    ("adamw", 16, "fp32 copy is missing"),  # the Ultra-Scale Playbook's count
    ("adamw", 18, "autocast"),
    ("adamw", 19, "add up"),
    ("sgd-momentum", "sixteen", "expected a number"),
])
def test_master_bytes_wrong_answers_fail_with_a_hint(optimizer, answer, hint, says):
    assert lesson02.check_master_bytes(answer, optimizer) is False
    says("❌", hint)


# ---- lesson 02, exercise 2: the window of usable loss scales ----------------------------------------------
def test_scale_window_solution_passes(sol02, says):
    assert lesson02.scale_window(GRADS) == (16.0, 8192.0)  # from flush_fraction and overflow_fraction
    assert (sol02.SMALLEST_SCALE, sol02.LARGEST_SCALE) == (16.0, 8192.0)
    assert sol02.largest_scale_by_hand(GRADS) == 8192.0
    assert lesson02.check_scale_window(sol02.SMALLEST_SCALE, sol02.LARGEST_SCALE, GRADS) is True
    other = torch.tensor([1e-6, 0.5, 30.0])
    assert lesson02.check_scale_window(sol02.smallest_scale(other), sol02.largest_scale(other), other) is True
    assert "❌" not in says("✅", "usable scales")


@pytest.mark.parametrize("smallest, largest", [(None, 8192), (16, None), (..., ...)])
def test_scale_window_blanks_fail(smallest, largest, says):
    assert lesson02.check_scale_window(smallest, largest, GRADS) is False
    says("❌", "not answered yet")


@pytest.mark.parametrize("smallest, largest, hint", [
    (8, 8192, "still flush"),  # too small
    (32, 8192, "half"),  # lifted above the smallest subnormal: not needed
    (32768, 8192, "normal"),  # lifted above the smallest normal
    (64, 8192, "not the smallest"),
    (16, 16384, "overflows"),  # 4 x 16384 = 65536 > 65504
    (16, 4096, "doubling"),
    (24, 8192, "power of two"),
    (16, 10000, "power of two"),
])
def test_scale_window_wrong_answers_fail_with_a_hint(smallest, largest, hint, says):
    assert lesson02.check_scale_window(smallest, largest, GRADS) is False
    says("❌", hint)


# ---- lesson 02, exercise 3: the scale torch._scaled_mm expects -------------------------------------------
def test_scaled_mm_scale_solution_passes(sol02, says):
    assert lesson02.check_scaled_mm_scale(sol02.SCALE_A, amax=1e4, fmt="e4m3") is True
    assert lesson02.check_scaled_mm_scale(sol02.scaled_mm_scale(3.0, 57344.0), amax=3.0, fmt="e5m2") is True
    says("✅")


def test_scaled_mm_scale_matches_the_quantizer():
    x = torch.zeros(4, 4)
    x[1, 2] = 1e4
    _, s = quantize_fp8(x, "e4m3", "tensor")  # s = 448 / amax; _scaled_mm wants 1 / s
    assert lesson02.scaled_mm_scale(1e4, "e4m3") == pytest.approx(1 / float(s))


def test_scaled_mm_scale_blank_fails(blank, says):
    assert lesson02.check_scaled_mm_scale(blank, amax=1e4) is False
    says("❌", "not answered yet")


@pytest.mark.parametrize("answer, hint", [(448 / 1e4, "reciprocal"), (1e4 / 57344, "e5m2"), (1.0, "undoes")])
def test_scaled_mm_scale_wrong_answers_fail_with_a_hint(answer, hint, says):
    assert lesson02.check_scaled_mm_scale(answer, amax=1e4, fmt="e4m3") is False
    says("❌", hint)


# ---- lesson 02: per-student inputs (labkit.exercises.Inputs) --------------------------------------------
def _two_students(inputs, key, answer, n=40):
    """Two students' drawn inputs whose right answers differ: (first student's, another's)."""
    drawn = [inputs(key, f"s{i}", quiet=True) for i in range(n)]
    return drawn[0], next(d for d in drawn[1:] if answer(d) != answer(drawn[0]))


def _window(sol02, grads):
    t = torch.tensor(grads)
    return sol02.smallest_scale(t), sol02.largest_scale(t)


def test_lesson02_own_inputs_on_your_own(monkeypatch):
    monkeypatch.delenv("LABKIT_STUDENT", raising=False)
    assert lesson02.inputs("master_bytes") == {"optimizer": "sgd-momentum"}
    assert lesson02.inputs("scale_window") == {"grads": (3e-9, 2e-7, 5e-5, 1e-2, 4.0)}
    assert torch.equal(torch.tensor(lesson02.inputs("scale_window").grads), GRADS)
    assert lesson02.inputs("scaled_mm_scale") == {"amax": 1e4, "fmt": "e4m3"}


def test_master_bytes_solution_passes_on_every_input(sol02, says):
    for drawn in lesson02.inputs.every("master_bytes"):
        assert lesson02.check_master_bytes(sol02.master_bytes_per_param(sol02.STATES[drawn.optimizer]), **drawn), drawn
    assert "❌" not in says("✅")


def test_master_bytes_another_students_answer_fails(sol02, says):
    def answer(d):
        return sol02.master_bytes_per_param(sol02.STATES[d.optimizer])

    mine, theirs = _two_students(lesson02.inputs, "master_bytes", answer)
    assert lesson02.check_master_bytes(answer(mine), **theirs) is False
    says("❌")


def test_scale_window_solution_passes_on_every_input(sol02, says):
    windows = set()
    for drawn in lesson02.inputs.every("scale_window"):
        smallest, largest = _window(sol02, drawn.grads)
        assert smallest < largest, drawn  # a usable window
        assert (smallest, largest) == lesson02.scale_window(torch.tensor(drawn.grads))
        assert lesson02.check_scale_window(smallest, largest, **drawn) is True, drawn
        assert lesson02.check_scale_window(smallest, largest, torch.tensor(drawn.grads)) is True  # a tensor too
        windows.add((smallest, largest))
    assert "❌" not in says("✅", "usable scales")
    assert len(windows) == len(lesson02.inputs.every("scale_window"))  # each gradient set its own window


def test_scale_window_another_students_answer_fails(sol02, says):
    mine, theirs = _two_students(lesson02.inputs, "scale_window", lambda d: _window(sol02, d.grads))
    assert lesson02.check_scale_window(*_window(sol02, mine.grads), **theirs) is False
    says("❌")


def test_scaled_mm_scale_solution_passes_on_every_input(sol02, says):
    for drawn in lesson02.inputs.every("scaled_mm_scale"):
        assert lesson02.check_scaled_mm_scale(sol02.scale_a_for(**drawn), **drawn) is True, drawn
    assert "❌" not in says("✅")
    assert sol02.scale_a_for(1e4, "e4m3") == sol02.SCALE_A


def test_scaled_mm_scale_another_students_answer_fails(sol02, says):
    mine, theirs = _two_students(lesson02.inputs, "scaled_mm_scale", lambda d: sol02.scale_a_for(**d))
    assert lesson02.check_scaled_mm_scale(sol02.scale_a_for(**mine), **theirs) is False
    says("❌")


# ---- lesson 03, exercise 1: what a checkpointed block keeps ----------------------------------------------
def test_kept_per_block_solution_passes(sol03, says):
    assert lesson03.check_kept_per_block(sol03.kept_per_block(CFG, B, S), CFG, B, S) is True
    assert lesson03.check_kept_per_block(sol03.kept_per_block(CFG, 3, 16, "bf16"), CFG, 3, 16, "bf16") is True
    says("✅")


def test_kept_per_block_blank_fails(blank, says):
    assert lesson03.check_kept_per_block(blank, CFG, B, S) is False
    says("❌", "not answered yet")


def test_kept_per_block_wrong_answers_fail_with_a_hint(says):
    right = B * S * CFG.n_embd * 4
    for answer, hint in ((right * CFG.n_layer, "per block"), (right // 4, "elements"), (right * 4, "inner width"),
                         (right / MiB, "MiB"), (right + 12345, "only its input")):
        assert lesson03.check_kept_per_block(answer, CFG, B, S) is False
        says("❌", hint)
    blocks = next(t.bytes for t in estimate(CFG, B, S).terms if t.name == "activations saved by the blocks")
    assert lesson03.check_kept_per_block(blocks / CFG.n_layer, CFG, B, S) is False
    says("❌", "without")


# ---- lesson 03, exercise 2: the best number of segments --------------------------------------------------
def test_best_segments_solution_passes(sol03, says):
    k = sol03.best_segments(CFG, B, S)
    assert lesson03.check_best_segments(k, CFG, B, S) is True
    says("✅")
    assert k == CFG.n_layer  # a block costs far more than its input: memory keeps falling up to k = n


def test_best_segments_blank_fails(blank, says):
    assert lesson03.check_best_segments(blank, CFG, B, S) is False
    says("❌", "not answered yet")


def test_best_segments_wrong_answers_fail_with_a_hint(says):
    assert lesson03.check_best_segments(2, CFG, B, S) is False  # round(sqrt(3))
    says("❌", "sqrt")
    assert lesson03.check_best_segments(1, CFG, B, S) is False
    says("❌", "every k")
    assert lesson03.check_best_segments(9, CFG, B, S) is False
    says("❌", "between 1")
    assert lesson03.check_best_segments(2.5, CFG, B, S) is False
    says("❌", "whole number")


# ---- lesson 03, exercise 3: the FLOPs recomputation adds -------------------------------------------------
def test_recompute_factor_solutions_pass(sol03, says):
    measured = sol03.measured_flops_factor(CFG, B, S)
    assert measured == pytest.approx(lesson03.recompute_factor(CFG, B, S))
    assert 1.2 < measured < 4 / 3  # one extra forward of the blocks; the head is not recomputed
    assert lesson03.check_recompute_factor(measured, CFG, B, S) is True
    assert lesson03.check_recompute_factor(sol03.FLOPS_FACTOR_ESTIMATE, CFG, B, S) is True  # the reasoning's 4/3
    says("✅", "head")


def test_recompute_factor_blank_fails(blank, says):
    assert lesson03.check_recompute_factor(blank, CFG, B, S) is False
    says("❌", "not answered yet")


@pytest.mark.parametrize("answer, hint", [(2.0, "not a whole second step"), (1.5, "two forwards"),
                                          (1.0, "not free"), (3.0, "count in forwards")])
def test_recompute_factor_wrong_answers_fail_with_a_hint(answer, hint, says):
    assert lesson03.check_recompute_factor(answer, CFG, B, S) is False
    says("❌", hint)


@pytest.mark.parametrize("ratio", lesson03.inputs.table["recompute_factor"]["backward_ratio"])
def test_recompute_factor_per_student_backward_ratio(sol03, ratio, says):
    """Issue 41 item 4: a student may be asked for a backward of 3 or 4 forwards: the reasoning's (2 + b) / (1 + b)
    passes, and the lesson's 4/3 (or the measurement) passes only for b = 2."""
    assert lesson03.check_recompute_factor(sol03.flops_factor(ratio), CFG, B, S, backward_ratio=ratio) is True
    says("✅", "right reasoning")
    if ratio != 2:
        assert lesson03.check_recompute_factor(4 / 3, CFG, B, S, backward_ratio=ratio) is False
        measured = sol03.measured_flops_factor(CFG, B, S)
        assert lesson03.check_recompute_factor(measured, CFG, B, S, backward_ratio=ratio) is False


# ---- lesson 04, exercise 1: the weight of a micro-batch's loss -------------------------------------------
def test_micro_weight_solution_passes(sol04, says):
    assert sol04.THIRD_WEIGHT == 0.25
    assert lesson04.check_micro_weight(sol04.THIRD_WEIGHT, [3, 3, 2], 2) is True
    assert lesson04.check_micro_weight(sol04.micro_weight([4, 4], 0), [4, 4], 0) is True
    says("✅")


def test_micro_weight_blank_fails(blank, says):
    assert lesson04.check_micro_weight(blank, [3, 3, 2], 2) is False
    says("❌", "not answered yet")


@pytest.mark.parametrize("answer, hint", [(1 / 3, "uneven"), (1.0, "too big"), (0.5, "already a mean"),
                                          (4.0, "upside down"), (0.3, "sum over micro-batches")])
def test_micro_weight_wrong_answers_fail_with_a_hint(answer, hint, says):
    assert lesson04.check_micro_weight(answer, [3, 3, 2], 2) is False
    says("❌", hint)


# ---- lesson 04, exercise 2: the largest micro-batch that fits ----------------------------------------------
def _peak(m, checkpoint="full"):
    return estimate(CFG, 8, S, checkpoint=checkpoint, micro_batch=m).peak.total


@pytest.fixture(scope="module")
def budget():
    """A budget that micro-batch 2 fits with full checkpointing and micro-batch 4 does not."""
    lo, hi = _peak(2), _peak(4)
    assert lo < hi
    return (lo + hi) // 2


def test_largest_micro_batch_solution_passes(sol04, budget, says):
    m = sol04.largest_micro_batch(CFG, 8, S, budget, checkpoint="full")
    assert m == 2 == lesson04.largest_micro_batch(CFG, 8, S, budget, checkpoint="full")
    assert lesson04.check_largest_micro_batch(m, CFG, 8, S, budget, checkpoint="full") is True
    tiny = _peak(1) // 2
    assert sol04.largest_micro_batch(CFG, 8, S, tiny) == 0
    assert lesson04.check_largest_micro_batch(0, CFG, 8, S, tiny, checkpoint="full") is True
    says("✅", "none fits")


def test_largest_micro_batch_blank_fails(blank, budget, says):
    assert lesson04.check_largest_micro_batch(blank, CFG, 8, S, budget, checkpoint="full") is False
    says("❌", "not answered yet")


@pytest.mark.parametrize("answer, hint", [(4, "does not fit"), (1, "larger"), (3, "does not divide"),
                                          (16, "between 1"), (1.5, "whole number")])
def test_largest_micro_batch_wrong_answers_fail_with_a_hint(answer, hint, budget, says):
    assert lesson04.check_largest_micro_batch(answer, CFG, 8, S, budget, checkpoint="full") is False
    says("❌", hint)


# ---- lessons 03-04: the inputs each student draws (labkit.exercises.Inputs) -----------------------------------
def _quiet_34(check, *args, **kwargs) -> bool:
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        return check(*args, **kwargs)


def _two_students_34(inputs, key, solve):
    """Two students whose drawn inputs give different answers: (inputs, answer) of each."""
    seen = {}
    for i in range(200):
        drawn = inputs(key, f"s{i}", quiet=True)
        answer = solve(drawn)
        for other, (drawn2, answer2) in seen.items():
            if answer2 != answer:
                return (drawn2, answer2), (drawn, answer)
        seen.setdefault(tuple(map(repr, drawn.values())), (drawn, answer))
    raise AssertionError(f"every student draws the same answer for {key}")


def test_lesson03_own_inputs_are_the_lessons(monkeypatch):
    monkeypatch.delenv("LABKIT_STUDENT", raising=False)
    assert lesson03.inputs("kept_per_block") == {"dtype": "fp32"}
    assert lesson03.inputs("best_segments") == {"n_layer": None}  # CONFIG as it is
    assert lesson03.inputs("scores_crossover") == {"dtype": "fp32"}  # the checks' defaults: today's calls


def test_lesson03_every_input_passes_with_the_solution_and_another_students_answer_fails(sol03):
    solve = {
        "kept_per_block": (lesson03.check_kept_per_block, lambda d: sol03.kept_per_block(CFG, B, S, **d)),
        "best_segments": (lesson03.check_best_segments, lambda d: sol03.best_segments(CFG, B, S, **d)),
        "scores_crossover": (lesson03.check_scores_crossover, lambda d: sol03.scores_crossover(CFG, B, S, **d)),
    }
    for key, (check, answer) in solve.items():
        answers = {}
        for drawn in lesson03.inputs.every(key):
            answers[repr(drawn)] = answer(drawn)
            assert _quiet_34(check, answers[repr(drawn)], CFG, B, S, **drawn) is True, (key, drawn)
        assert len(set(answers.values())) == len(answers), (key, answers)  # every choice changes the answer
        (mine, my_answer), (theirs, _) = _two_students_34(lesson03.inputs, key, answer)
        assert _quiet_34(check, my_answer, CFG, B, S, **theirs) is False, (key, mine, theirs)


def test_lesson03_drawn_depth_and_dtype_reach_the_check(sol03, says):
    assert sol03.best_segments(CFG, B, S, n_layer=10) < 10  # deep enough: the best k is below n
    assert lesson03.check_best_segments(sol03.best_segments(CFG, B, S, n_layer=10), CFG, B, S, n_layer=10) is True
    says("✅", "10 blocks")
    assert lesson03.check_best_segments(CFG.n_layer, CFG, B, S, n_layer=10) is False  # CONFIG's own depth's answer
    says("❌", "every k")
    assert lesson03.check_kept_per_block(B * S * CFG.n_embd, CFG, B, S, dtype="bf16") is False
    says("❌", "elements", "2 bytes in bf16")


def test_lesson04_own_inputs_are_the_lessons(monkeypatch):
    monkeypatch.delenv("LABKIT_STUDENT", raising=False)
    assert lesson04.inputs("micro_weight") == {"sizes": [3, 3, 2], "index": 2}
    assert lesson04.inputs("largest_micro_batch") == {"checkpoint": "full", "budget_scale": 1.0}


def test_lesson04_micro_weight_every_input_passes_and_another_students_answer_fails(sol04):
    every = lesson04.inputs.every("micro_weight")
    assert len(every) <= 24
    for drawn in every:
        right = sol04.micro_weight(**drawn)
        assert _quiet_34(lesson04.check_micro_weight, right, **drawn) is True, drawn
        assert right != 1 / len(drawn.sizes)  # every split is uneven for the micro-batch asked: 1/k stays a slip
        for other in every:
            if sol04.micro_weight(**other) != right:
                assert _quiet_34(lesson04.check_micro_weight, right, **other) is False, (drawn, other)
    (_, mine), (theirs, _) = _two_students_34(lesson04.inputs, "micro_weight", lambda d: sol04.micro_weight(**d))
    assert _quiet_34(lesson04.check_micro_weight, mine, **theirs) is False


def test_lesson04_largest_micro_batch_every_input_passes_and_another_students_answer_fails(sol04, budget):
    every = lesson04.inputs.every("largest_micro_batch")
    assert len(every) <= 24

    def solve(d):
        return sol04.largest_micro_batch(CFG, 8, S, budget, **d)

    answers = {repr(d): solve(d) for d in every}
    assert answers[repr(lesson04.inputs.every("largest_micro_batch")[0])] == 2  # the lesson's own: the fixture's
    assert len(set(answers.values())) >= 3, answers
    for drawn in every:
        assert _quiet_34(lesson04.check_largest_micro_batch, answers[repr(drawn)], CFG, 8, S, budget, **drawn) is True
        for other in every:
            if answers[repr(other)] != answers[repr(drawn)]:
                assert _quiet_34(lesson04.check_largest_micro_batch, answers[repr(drawn)], CFG, 8, S, budget,
                              **other) is False, (drawn, other)
    (_, mine), (theirs, _) = _two_students_34(lesson04.inputs, "largest_micro_batch", solve)
    assert _quiet_34(lesson04.check_largest_micro_batch, mine, CFG, 8, S, budget, **theirs) is False


def test_lesson04_budget_scale_scales_the_budget(budget, says):
    assert lesson04.check_largest_micro_batch(2, CFG, 8, S, budget, checkpoint="full", budget_scale=1.0) is True
    says("✅", f"({8 // 2} micro-batch(es) per step)")
    big = _peak(8) / budget + 0.01  # everything fits: the whole batch
    assert lesson04.check_largest_micro_batch(8, CFG, 8, S, budget, checkpoint="full", budget_scale=big) is True
    says("✅")
